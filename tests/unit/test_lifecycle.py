"""lifecycle.decide: restart, fail, succeed, suspend, deadline and TTL from observed pods."""
from __future__ import annotations

import pytest

from ddpjob_api.phases import Phase
from ddpjob_operator.base.group import Group
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.builders.pods import render_pod
from ddpjob_operator.decisions.lifecycle import decide
from tests.support.builders import NOW, ago, make_job, make_pod, running_status


def test_first_pass_creates_every_rank():
    d = decide(make_job(nodes=4), Group.of([]), now=NOW, prev_status=None)
    assert d.phase is Phase.PENDING and d.create_ranks == [0, 1, 2, 3] and d.attempt == 0
    assert d.start_time == NOW and d.delete_pods == []


def test_resume_after_partial_creation_creates_only_the_missing_ranks():
    # The operator died after creating 2 of 4 pods: no restart, just the rest.
    d = decide(make_job(nodes=4), Group.of([make_pod(0), make_pod(1)]), now=NOW,
               prev_status={"phase": "Pending", "attempt": 0, "launchedAttempt": -1})
    assert d.create_ranks == [2, 3] and d.restarts == 0 and d.phase is Phase.PENDING


def test_all_running():
    d = decide(make_job(nodes=2), Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status={"phase": "Pending"})
    assert d.phase is Phase.RUNNING and d.launched_attempt == 0 and d.create_ranks == []


@pytest.mark.parametrize("pods,reason,counted", [
    ([make_pod(0), make_pod(1, phase="Failed", exit_code=1)], "PodFailed", 1),
    # Rank 0 lost: it hosts the c10d store (a lost pod of another rank is replaced alone: test_replace.py).
    ([make_pod(0, deleting=True), make_pod(1)], "PodDeleted", 1),
    ([make_pod(1)], "PodDeleted", 1),                                          # vanished after launch
    ([make_pod(0, phase="Failed", exit_code=137, evicted=True), make_pod(1)], "PodEvicted", 0),  # free
])
def test_failure_restarts_the_whole_group(pods, reason, counted):
    d = decide(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=running_status())
    assert d.phase is Phase.RESTARTING and d.reason == reason
    assert d.attempt == 1 and d.restarts == 1 and d.counted_restarts == counted
    live = {p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")}
    ended = {p["metadata"]["name"] for p in pods if p["status"]["phase"] == "Failed"}  # kept for their logs
    assert set(d.delete_pods) == live - ended and d.create_ranks == []
    assert d.restarted is not None


@pytest.mark.parametrize("keep, attempt, kept", [
    # Attempt 2 restarted into 3: its ended pods stay; still-running ones go (they hold GPUs).
    (1, 3, {"j-1-a2"}),
    (2, 3, {"j-1-a1", "j-0-a1", "j-1-a2"}),   # two attempts back
    (0, 3, set()),                             # nothing kept
    (10, 3, {"j-1", "j-1-a1", "j-0-a1", "j-1-a2"}),
])
def test_a_restart_keeps_the_ended_pods_of_the_last_failed_attempts(keep, attempt, kept):
    pods = [make_pod(1, attempt=0, phase="Failed", exit_code=1),
            make_pod(0, attempt=1, phase="Failed", exit_code=143), make_pod(1, attempt=1, phase="Failed", exit_code=1),
            make_pod(0, attempt=2), make_pod(1, attempt=2, phase="Failed", exit_code=1)]
    job = make_job(nodes=2, failurePolicy={"keepFailedAttempts": keep})
    prev = running_status(attempt=2, launchedAttempt=2, restarts=2, countedRestarts=2)
    d = decide(job, Group.of(pods), now=NOW, prev_status=prev)
    assert d.phase is Phase.RESTARTING and d.attempt == attempt
    assert set(d.delete_pods) == {p["metadata"]["name"] for p in pods} - kept
    # Once the running pod is gone, the new attempt starts beside the kept ones, under new names.
    left = [p for p in pods if p["metadata"]["name"] in kept]
    prev = {**prev, "phase": "Restarting", "attempt": 3, "restarts": 3, "countedRestarts": 3}
    d = decide(job, Group.of(left), now=NOW, prev_status=prev)
    assert d.delete_pods == [] and d.create_ranks == [0, 1]
    created = [render_pod(job, r, attempt=d.attempt)["metadata"]["name"] for r in d.create_ranks]
    assert created == ["j-0-a3", "j-1-a3"]
    # Older than the window: pruned in a later pass as well (the window moved, or the spec changed).
    d = decide(make_job(nodes=2, failurePolicy={"keepFailedAttempts": 0}), Group.of(left), now=NOW, prev_status=prev)
    assert set(d.delete_pods) == kept and d.create_ranks == [0, 1]


def test_a_rank_that_had_exited_0_is_not_kept():
    # Its log tells nothing of the failure, and a gang scheduler counting finished members
    # (Volcano) could count it towards the next attempt's gang.
    pods = [make_pod(0, phase="Succeeded", exit_code=0), make_pod(1, phase="Failed", exit_code=1)]
    d = decide(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=running_status())
    assert d.phase is Phase.RESTARTING and d.delete_pods == ["j-0"]


def test_a_suspend_and_cleanpodpolicy_all_delete_kept_pods():
    kept = make_pod(1, attempt=0, phase="Failed", exit_code=1)
    running = [make_pod(0, attempt=1), make_pod(1, attempt=1)]
    prev = running_status(attempt=1, launchedAttempt=1, restarts=1, countedRestarts=1)
    d = decide(make_job(nodes=2, suspend=True), Group.of([kept, *running]), now=NOW, prev_status=prev)
    assert set(d.delete_pods) == {"j-1", "j-0-a1", "j-1-a1"}
    done = [make_pod(0, attempt=1, phase="Succeeded", exit_code=0), make_pod(1, attempt=1, phase="Succeeded", exit_code=0)]
    d = decide(make_job(nodes=2), Group.of([kept, *done]), now=NOW, prev_status=prev)
    assert d.phase is Phase.SUCCEEDED and d.delete_pods == []     # cleanPodPolicy Running: kept until the TTL
    d = decide(make_job(nodes=2, cleanPodPolicy="All"), Group.of([kept, *done]), now=NOW, prev_status=prev)
    assert set(d.delete_pods) == {"j-1", "j-0-a1", "j-1-a1"}


@pytest.mark.parametrize("old, create", [
    # Rank 0's old pod (the old master) is still terminating: nothing new yet, not even rank 1,
    # whose name is free — a new worker would find the old master's store on the job's DNS name.
    ([make_pod(0, attempt=0, deleting=True)], []),
    ([make_pod(0, attempt=0, deleting=True), make_pod(1, attempt=0, deleting=True)], []),
    # Gone: the new attempt starts.
    ([], [0, 1]),
    # Still there 31 s after its grace period: its node's kubelet stopped reporting; it no longer
    # holds the attempt up (the new attempt's pods have names of their own).
    ([make_pod(0, attempt=0, deleting=31)], [0, 1]),
    # Ended pods of the failed attempt (kept for their logs) hold nothing up.
    ([make_pod(0, attempt=0, phase="Failed", exit_code=143), make_pod(1, attempt=0, phase="Failed", exit_code=1)],
     [0, 1]),
])
def test_a_new_attempt_starts_once_every_pod_of_the_old_one_is_gone(old, create):
    prev = running_status(phase="Restarting", attempt=1, restarts=1, countedRestarts=1)
    d = decide(make_job(nodes=2), Group.of(old), now=NOW, prev_status=prev)
    assert d.phase is Phase.RESTARTING and d.create_ranks == create and d.restarts == 1
    if not create:
        assert d.requeue_after is not None and 0 < d.requeue_after <= 30  # re-checked, not forgotten


def test_an_old_pod_that_was_never_deleted_is_deleted_before_anything_is_created():
    prev = running_status(phase="Restarting", attempt=1, restarts=1, countedRestarts=1)
    # The operator died after writing status, before deleting rank 0's old pod.
    d = decide(make_job(nodes=2), Group.of([make_pod(0, attempt=0), make_pod(1, attempt=1)]), now=NOW, prev_status=prev)
    assert d.delete_pods == ["j-0"] and d.create_ranks == [] and d.restarts == 1


def test_restart_budget_exhausted_fails_and_cleans_running_pods():
    prev = running_status(restarts=3, countedRestarts=3)
    d = decide(make_job(nodes=2, failurePolicy={"maxRestarts": 3}),
               Group.of([make_pod(0), make_pod(1, phase="Failed", exit_code=1)]), now=NOW, prev_status=prev)
    assert d.phase is Phase.FAILED and d.reason == "RestartLimitExceeded"
    assert "maxRestarts=3" in d.message and d.completion_time == NOW
    assert d.delete_pods == ["j-0"]  # cleanPodPolicy Running: the failed pod stays for its logs


def test_evictions_do_not_use_the_budget():
    prev = running_status(restarts=5, countedRestarts=3)
    d = decide(make_job(nodes=2, failurePolicy={"maxRestarts": 3}),
               Group.of([make_pod(0, phase="Failed", exit_code=137, evicted=True), make_pod(1)]), now=NOW,
               prev_status=prev)
    assert d.phase is Phase.RESTARTING and d.restarts == 6 and d.counted_restarts == 3


def test_bad_configuration_fails_at_once():
    pods = [make_pod(0, phase="Failed", exit_code=78, message="bad lr"), make_pod(1)]
    d = decide(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=running_status())
    assert d.phase is Phase.FAILED and d.reason == "BadConfiguration" and d.restarts == 0
    # The trainer's words only where the job opted in (spec.failurePolicy.logTailInStatus).
    assert "bad lr" not in d.message and "kubectl logs j-0" in d.message
    d = decide(make_job(nodes=2, failurePolicy={"logTailInStatus": True}), Group.of(pods), now=NOW,
               prev_status=running_status())
    assert "bad lr" in d.message


def test_success_when_all_ranks_exit_zero():
    pods = [make_pod(0, phase="Succeeded", exit_code=0), make_pod(1, phase="Succeeded", exit_code=0)]
    d = decide(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=running_status())
    assert d.phase is Phase.SUCCEEDED and d.completion_time == NOW and d.delete_pods == []
    partial = decide(make_job(nodes=2), Group.of(pods[:1] + [make_pod(1)]), now=NOW, prev_status=running_status())
    assert partial.phase is Phase.RUNNING


@pytest.mark.parametrize("policy,deleted", [("None", []), ("Running", ["j-1"]), ("All", ["j-0", "j-1"])])
def test_clean_pod_policy_on_finish(policy, deleted):
    pods = [make_pod(0, phase="Failed", exit_code=78), make_pod(1)]
    d = decide(make_job(nodes=2, cleanPodPolicy=policy), Group.of(pods), now=NOW, prev_status=running_status())
    assert d.phase is Phase.FAILED and sorted(d.delete_pods) == deleted


def test_finished_is_sticky_and_ttl_deletes_the_job():
    prev = {"phase": "Succeeded", "completionTime": ago(30), "startTime": ago(100)}
    d = decide(make_job(nodes=2, ttlSecondsAfterFinished=60), Group.of([]), now=NOW, prev_status=prev)
    assert d.phase is Phase.SUCCEEDED and not d.delete_job and d.requeue_after == pytest.approx(30)
    assert decide(make_job(nodes=2, ttlSecondsAfterFinished=10), Group.of([]), now=NOW, prev_status=prev).delete_job
    assert not decide(make_job(nodes=2), Group.of([]), now=NOW, prev_status=prev).delete_job  # no TTL: kept


def test_active_deadline():
    job = make_job(nodes=2, activeDeadlineSeconds=60)
    d = decide(job, Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=running_status(startTime=ago(30)))
    assert d.phase is Phase.RUNNING and d.requeue_after == pytest.approx(30)
    d = decide(job, Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=running_status(startTime=ago(61)))
    assert d.phase is Phase.FAILED and d.reason == "DeadlineExceeded"
    assert sorted(d.delete_pods) == ["j-0", "j-1"]


def test_suspend_and_resume():
    job = make_job(nodes=2, suspend=True)
    d = decide(job, Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=running_status())
    assert d.phase is Phase.SUSPENDED and sorted(d.delete_pods) == ["j-0", "j-1"] and d.restarts == 0
    prev = running_status(phase="Suspended", startTime=ago(1000))
    d = decide(make_job(nodes=2, activeDeadlineSeconds=500), Group.of([]), now=NOW, prev_status=prev)
    assert d.phase is Phase.PENDING and d.reason == "Resumed"
    assert d.attempt == 1 and d.create_ranks == [0, 1] and d.restarts == 0
    assert d.start_time == NOW  # the deadline clock restarts on resume


@pytest.mark.parametrize("policy,overdue,restarts", [
    ({}, False, False),                         # stalled, or not: the pods' agents restart in place first
    ({}, True, True),                           # still stalled a timeout later: the group (the default)
    ({"restartOnHang": True}, True, True),      # an old manifest's true: the same
    ({"restartOnHang": False}, True, False),    # off: Stalled is only a condition
])
def test_a_stall_restarts_the_group_only_once_overdue_and_only_with_restart_on_hang(policy, overdue, restarts):
    pods = [make_pod(0), make_pod(1)]
    d = decide(make_job(nodes=2, failurePolicy=policy), Group.of(pods), now=NOW, prev_status=running_status(),
               hang_overdue=overdue)
    if restarts:
        assert d.phase is Phase.RESTARTING and d.reason == "Stalled" and d.counted_restarts == 1
        assert "not restarted in place" in d.message
    else:
        assert d.phase is Phase.RUNNING and not d.delete_pods


@pytest.mark.parametrize("waited,flagged", [(10, False), (400, True)])
def test_unschedulable_after_timeout(waited, flagged):
    pods = [make_pod(0, phase="Pending", unschedulable_for=waited), make_pod(1)]
    d = decide(make_job(nodes=2), Group.of(pods), now=NOW, prev_status={"phase": "Pending", "startTime": ago(waited)},
               config=OperatorConfig(unschedulable_timeout=300))
    assert (d.unschedulable is not None) == flagged
    if flagged:
        assert "Insufficient nvidia.com/gpu" in d.unschedulable
    else:
        assert d.requeue_after == pytest.approx(290)
