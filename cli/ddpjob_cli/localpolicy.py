"""The local runner's restart policy is the operator's: after an attempt ends in failure, its nodes
are described as the pods they stand for and `lifecycle.decide` says what happens next, so
`ddpjob run --local` fails, restarts and counts restarts exactly as the operator would for the
same exits (bad configuration, the restart budget, activeDeadlineSeconds)."""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from ddpjob_api import labels
from ddpjob_api.names import pod_name
from ddpjob_api.phases import Phase
from ddpjob_api.spec import JobSpec
from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions.lifecycle import Decision, decide


@dataclass(frozen=True)
class Tally:
    """Where a local run stands between attempts (the operator keeps this in the job's status)."""

    attempt: int = 0
    restarts: int = 0
    counted_restarts: int = 0


def exit_code(returncode: int) -> int:
    """A process's return code as a container's exit code (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def node_pod(job: JobSpec, rank: int, *, tally: Tally, returncode: int | None) -> dict:
    """Node `rank` of the current attempt as the pod the operator would see (None: still running)."""
    status: dict = {"phase": Phase.RUNNING.value}
    if returncode is not None:
        code = exit_code(returncode)
        status = {"phase": Phase.SUCCEEDED.value if code == 0 else Phase.FAILED.value,
                  "containerStatuses": [{"name": labels.CONTAINER,
                                         "state": {"terminated": {"exitCode": code}}}]}
    return {"metadata": {"name": pod_name(job.name, rank, tally.attempt), "namespace": job.namespace,
                         "labels": {labels.JOB_NAME: job.name, labels.NODE_RANK: str(rank),
                                    labels.ATTEMPT: str(tally.attempt)},
                         "annotations": {labels.RESTARTS: str(tally.restarts),
                                         labels.COUNTED_RESTARTS: str(tally.counted_restarts)}},
            "status": status}


def after_failure(job: JobSpec, *, tally: Tally, returncodes: dict[int, int | None], started: dt.datetime,
                  now: dt.datetime) -> Decision:
    """The operator's decision once a node of the attempt failed: Phase.FAILED (with its reason:
    BadConfiguration, RestartLimitExceeded, DeadlineExceeded) or Phase.RESTARTING."""
    pods = [node_pod(job, rank, tally=tally, returncode=returncodes.get(rank)) for rank in range(job.spec.nodes)]
    prev = {"phase": Phase.RUNNING.value, "attempt": tally.attempt, "launchedAttempt": tally.attempt,
            "restarts": tally.restarts, "countedRestarts": tally.counted_restarts,
            "startTime": started.isoformat()}
    return decide(job, Group.of(pods), now=now, prev_status=prev)


def next_tally(d: Decision) -> Tally:
    return Tally(attempt=d.attempt, restarts=d.restarts, counted_restarts=d.counted_restarts)
