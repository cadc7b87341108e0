"""`ddpjob run --local` and the operator make the same decision for the same failures: the local
runner describes its nodes as pods and asks lifecycle.decide (localpolicy)."""
from __future__ import annotations

import datetime as dt

import pytest

from ddpjob_api.phases import Phase
from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions.lifecycle import decide
from ddpjob_cli.localpolicy import Tally, after_failure, exit_code, node_pod
from tests.support.builders import make_job

NOW = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.timezone.utc)


@pytest.mark.parametrize("returncode, code", [(0, 0), (1, 1), (78, 78), (-9, 137), (-15, 143)])
def test_a_killed_process_reads_as_the_kubelet_reports_a_killed_container(returncode, code):
    assert exit_code(returncode) == code


# (tally before, node return codes (None: still running), spec) -> (phase, reason, tally after)
CASES = [
    (Tally(), {0: 1, 1: None}, {}, Phase.RESTARTING, "PodFailed", Tally(1, 1, 1)),
    (Tally(), {0: -9, 1: None}, {}, Phase.RESTARTING, "PodFailed", Tally(1, 1, 1)),
    (Tally(), {0: None, 1: 78}, {}, Phase.FAILED, "BadConfiguration", Tally()),
    (Tally(), {0: 1, 1: 78}, {}, Phase.FAILED, "BadConfiguration", Tally()),   # one node's 78 decides
    (Tally(1, 1, 1), {0: 1, 1: 0}, {}, Phase.RESTARTING, "PodFailed", Tally(2, 2, 2)),
    (Tally(2, 2, 2), {0: 1, 1: None}, {}, Phase.FAILED, "RestartLimitExceeded", Tally(2, 2, 2)),
    (Tally(), {0: 1, 1: None}, {"failurePolicy": {"maxRestarts": 0}}, Phase.FAILED, "RestartLimitExceeded",
     Tally()),
    (Tally(), {0: 1, 1: None}, {"activeDeadlineSeconds": 60}, Phase.FAILED, "DeadlineExceeded", Tally()),
]


@pytest.mark.parametrize("tally, codes, spec, phase, reason, after", CASES)
def test_the_local_runner_decides_as_the_operator_does(tally, codes, spec, phase, reason, after):
    j = make_job(**{"failurePolicy": {"maxRestarts": 2}, **spec})  # a case may bring its own policy
    started = NOW - dt.timedelta(seconds=120)
    local = after_failure(j, tally=tally, returncodes=codes, started=started, now=NOW)
    # The operator, from the same pods as its watch would deliver them and its own status.
    pods = [node_pod(j, r, tally=tally, returncode=codes[r]) for r in range(j.spec.nodes)]
    prev = {"phase": "Running", "attempt": tally.attempt, "launchedAttempt": tally.attempt,
            "restarts": tally.restarts, "countedRestarts": tally.counted_restarts,
            "startTime": started.strftime("%Y-%m-%dT%H:%M:%SZ")}
    operator = decide(j, Group.of(pods), now=NOW, prev_status=prev)
    for d in (local, operator):
        assert (d.phase, d.reason) == (phase, reason), d.message
        assert Tally(d.attempt, d.restarts, d.counted_restarts) == after
    assert local.message == operator.message
