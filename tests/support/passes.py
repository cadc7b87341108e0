"""One reconcile pass, pure, as the Reconciler makes it: decide, then the status that follows."""
from __future__ import annotations

import datetime as dt
from typing import Any

from ddpjob_api.spec import JobSpec
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions.lifecycle import decide
from ddpjob_operator.decisions.samples import MonitorReport
from ddpjob_operator.decisions.status import Event, job_status


def pass_status(job: JobSpec, group: Group, *, now: dt.datetime, prev_status: dict[str, Any] | None,
                config: OperatorConfig | None = None, report: MonitorReport | None = None,
                podgroup: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[Event]]:
    """(new status, events) of the pass app/controller.py makes from these pods and this status."""
    decision = decide(job, group, now=now, prev_status=prev_status, config=config,
                      hang_overdue=report is not None and report.hang_overdue,
                      ranks=report.ranks if report is not None else None)
    return job_status(job, group, now=now, prev_status=prev_status, config=config, decision=decision,
                      report=report, podgroup=podgroup)
