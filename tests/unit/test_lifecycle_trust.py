"""lifecycle: which pod endings cost the restart budget (the rule table), departed pods (lost
nodes), and counters a status edit cannot rewrite; redact: no credentials in status or events."""
from __future__ import annotations

import functools

import pytest

from ddpjob_api import labels
from ddpjob_api.phases import Phase
from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions.lifecycle import Verdict, decide, trusted_counters, verdict
from ddpjob_operator.builders.pods import render_pod
from ddpjob_operator.decisions.redact import redact
from tests.support.builders import NOW, make_job, make_pod, running_status


# The pods of the rule table ended unless a row says otherwise.
ended = functools.partial(make_pod, phase="Failed")


# The rule table: a pod's last known state -> (reason, verdict).
@pytest.mark.parametrize("pod,gone,reason,expected", [
    (ended(exit_code=1), False, "PodFailed", Verdict.RESTART),
    (ended(exit_code=137), True, "PodFailed", Verdict.RESTART),                 # vanished after failing
    (ended(exit_code=78), False, "BadConfiguration", Verdict.FAIL),
    (ended(exit_code=78, disruption="DeletionByPodGC"), True, "BadConfiguration", Verdict.FAIL),
    (ended(disruption="DeletionByPodGC"), True, "NodeLost", Verdict.RESTART_FREE),  # node deleted
    (make_pod(disruption="DeletionByTaintManager", deleting=True), False, "NodeLost", Verdict.RESTART_FREE),
    (make_pod(disruption="EvictionByEvictionAPI", deleting=True), False, "PodEvicted", Verdict.RESTART_FREE),
    (make_pod(disruption="PreemptionByScheduler", deleting=True), False, "PodPreempted", Verdict.RESTART_FREE),
    (ended(disruption="TerminationByKubelet", reason="Evicted"), False, "PodEvicted", Verdict.RESTART_FREE),
    (ended(reason="Evicted"), False, "PodEvicted", Verdict.RESTART_FREE),       # old kubelets: no condition
    (ended(reason="NodeLost"), False, "NodeLost", Verdict.RESTART_FREE),
    (make_pod(disruption="SomethingNew", deleting=True), False, "PodEvicted", Verdict.RESTART_FREE),
    (make_pod(deleting=True), False, "PodDeleted", Verdict.RESTART),            # kubectl delete pod
    (make_pod(), True, "PodDeleted", Verdict.RESTART),                          # force-deleted, no trace
    ({"metadata": {"name": "j-0"}}, True, "PodDeleted", Verdict.RESTART),      # never seen ending
])
def test_rule_table(pod, gone, reason, expected):
    f = verdict(pod, gone=gone)
    assert f is not None and f.reason == reason
    assert (f.fatal, f.counted) == {Verdict.FAIL: (True, False), Verdict.RESTART: (False, True),
                                    Verdict.RESTART_FREE: (False, False)}[expected]


@pytest.mark.parametrize("pod", [make_pod(0), make_pod(0, phase="Pending"),
                                 make_pod(0, phase="Succeeded", exit_code=0)])
def test_pods_that_did_not_end_have_no_verdict(pod):
    assert verdict(pod) is None


def test_a_lost_node_restarts_the_group_for_free():
    """PodGC marks the pod Failed + DisruptionTarget(DeletionByPodGC), then force-deletes it: the
    pass sees only the survivors, and the departed record says why the other one left."""
    lost = ended(1, disruption="DeletionByPodGC")
    prev = running_status(countedRestarts=0)
    d = decide(make_job(nodes=2, failurePolicy={"maxRestarts": 0}), Group.of([make_pod(0)], departed=[lost]),
               now=NOW, prev_status=prev)
    assert d.phase is Phase.RESTARTING and d.reason == "NodeLost"
    assert d.restarts == 1 and d.counted_restarts == 0 and d.delete_pods == ["j-0"]
    # Without the record the same disappearance is a deleted pod: charged, here over budget.
    d = decide(make_job(nodes=2, failurePolicy={"maxRestarts": 0}), Group.of([make_pod(0)]), now=NOW, prev_status=prev)
    assert d.phase is Phase.FAILED and d.reason == "RestartLimitExceeded"


def test_departed_records_of_other_attempts_or_reused_names_are_ignored():
    prev = running_status(attempt=1, launchedAttempt=1)
    old = ended(0, disruption="DeletionByPodGC", attempt=0)
    d = decide(make_job(nodes=2), Group.of([make_pod(1, attempt=1)], departed=[old]), now=NOW, prev_status=prev)
    assert d.reason == "PodDeleted" and d.counted_restarts == 1
    # A pod of the same name exists again: its record is history.
    group = Group.of([make_pod(0), make_pod(1)], departed=[ended(0, disruption="DeletionByPodGC")])
    d = decide(make_job(nodes=2), group, now=NOW, prev_status=running_status())
    assert d.phase is Phase.RUNNING and d.restarts == 0


# Status edits: counters from the pods' annotations and labels win over the status.
@pytest.mark.parametrize("status,pods,expected", [
    ({"attempt": 2, "restarts": 2, "countedRestarts": 0}, [make_pod(0, attempt=2, restarts=2, counted_restarts=2)],
     (2, 2, 2)),                                      # countedRestarts edited down: the pods remember
    ({"attempt": 0, "restarts": 0, "countedRestarts": 0}, [make_pod(0, attempt=3, restarts=3, counted_restarts=1)],
     (3, 3, 1)),                                      # attempt edited down: labels win
    ({"attempt": 10 ** 18}, [make_pod(0, attempt=4)], (5, 0, 0)),     # at most one past the pods' attempt
    ({"attempt": 7}, [], (7, 0, 0)),                                  # no pods: nothing better to go on
    ({"attempt": -5, "restarts": "x", "countedRestarts": -100}, [], (0, 0, 0)),
    ({"countedRestarts": 3, "restarts": 1}, [], (0, 3, 3)),           # restarts >= counted restarts
])
def test_trusted_counters(status, pods, expected):
    assert trusted_counters(status, Group.of(pods)) == expected


def test_an_edited_budget_grants_no_restart():
    job = make_job(nodes=2, failurePolicy={"maxRestarts": 2})
    pods = [ended(0, exit_code=1, attempt=2, restarts=2, counted_restarts=2),
            make_pod(1, attempt=2, restarts=2, counted_restarts=2)]
    edited = running_status(attempt=2, launchedAttempt=2, restarts=0, countedRestarts=0)
    d = decide(job, Group.of(pods), now=NOW, prev_status=edited)
    assert d.phase is Phase.FAILED and d.reason == "RestartLimitExceeded"


def test_pods_carry_the_counters_they_were_created_under():
    job = make_job(nodes=2)
    job.raw["status"] = {"restarts": 4, "countedRestarts": 1}
    ann = render_pod(job, 0, attempt=4)["metadata"]["annotations"]
    assert ann[labels.RESTARTS] == "4" and ann[labels.COUNTED_RESTARTS] == "1"
    ann = render_pod(job, 0, attempt=4, restarts=5, counted_restarts=2)["metadata"]["annotations"]
    assert ann[labels.RESTARTS] == "5" and ann[labels.COUNTED_RESTARTS] == "2"


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_phase_written_over_a_running_group_kills_nothing(phase):
    pods = [make_pod(0), make_pod(1)]
    d = decide(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=running_status(phase=phase, reason="Edited"))
    assert d.phase is Phase.RUNNING and d.delete_pods == [] and d.completion_time is None


def test_a_real_finish_is_still_sticky():
    pods = [make_pod(0, phase="Succeeded", exit_code=0), make_pod(1, phase="Succeeded", exit_code=0)]
    prev = running_status(phase="Succeeded", completionTime="2026-11-22T11:00:00Z")
    assert decide(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=prev).phase is Phase.SUCCEEDED
    # Failed with the failed rank still there (cleanPodPolicy Running keeps it): stays failed.
    pods = [ended(0, exit_code=1), make_pod(1)]
    d = decide(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=running_status(phase="Failed"))
    assert d.phase is Phase.FAILED and d.delete_pods == ["j-1"]


@pytest.mark.parametrize("text,leaked,kept", [
    ("mlflow at https://alice:hunter2@mlflow.example:5000/api", "hunter2", "https://***@mlflow.example:5000/api"),
    ("git clone https://ghp_abcdefghijklmnopqrstuvwxyz0123456789@github.com/x/y", "ghp_abc", "github.com/x/y"),
    ("curl -H 'Authorization: Bearer abc.def-ghi_jkl0123'", "abc.def", "Authorization: ***"),
    ("password=s3cr3t user=bob", "s3cr3t", "user=bob"),
    ('{"api_key": "k-123456", "lr": 0.1}', "k-123456", '"lr": 0.1'),
    ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG", "wJalr", "AWS_SECRET_ACCESS_KEY=***"),
    ("key id AKIAIOSFODNN7EXAMPLE used", "AKIAIOSFODNN7EXAMPLE", "key id *** used"),
    ("HF_TOKEN hf_abcdefghijklmnopqrstuvwxyz123", "hf_abcdef", "HF_TOKEN"),
    ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJlX2hlcmU", "eyJhbGci", "jwt ***"),
    # MLflow's credential variables (from spec.trainer.mlflow.credentialsSecret), echoed by a script.
    ("MLFLOW_TRACKING_TOKEN=dapi0123456789abcdef", "dapi0123", "MLFLOW_TRACKING_TOKEN=***"),
    ("export MLFLOW_TRACKING_PASSWORD='pa ss' ok", "pa ss", "MLFLOW_TRACKING_PASSWORD=*** ok"),
    ("MLflow: no run at http://bob:pw1234@mlflow:5000", "pw1234", "http://***@mlflow:5000"),
])
def test_redact(text, leaked, kept):
    out = redact(text)
    assert leaked not in out and kept in out, out


def test_redact_leaves_ordinary_failures_alone():
    text = "RuntimeError: CUDA out of memory at step 420 (https://pytorch.org/docs/notes)"
    assert redact(text) == text
