"""Kueue's plain-pod groups: the labels that queue a DDPJob's pods, and the Admitted condition."""
from __future__ import annotations

import pytest

from ddpjob_api.phases import Phase
from ddpjob_api.spec import from_manifest
from ddpjob_operator.base.group import Group
from ddpjob_operator.builders import kueue
from ddpjob_operator.decisions.lifecycle import decide
from ddpjob_operator.builders.pods import render_pod
from tests.support.builders import NOW, ago, make_manifest, make_pod
from tests.support.passes import pass_status


def queued_job(name="j", queue="team-a", uid="0123456789", **spec):
    m = make_manifest(name, uid=uid, **spec)
    if queue:
        m["metadata"]["labels"] = {kueue.QUEUE_LABEL: queue}
    return from_manifest(m)


@pytest.mark.parametrize("attempt", [0, 3])
def test_every_pod_of_an_attempt_joins_one_group_of_all_nodes(attempt):
    job = queued_job(nodes=3)
    groups = set()
    for rank in range(3):
        meta = render_pod(job, rank, attempt=attempt)["metadata"]
        assert meta["labels"][kueue.QUEUE_LABEL] == "team-a"
        groups.add(meta["labels"][kueue.GROUP_LABEL])
        assert meta["annotations"][kueue.TOTAL_ANNOTATION] == "3"
        # A group never waits for replacements: the operator replaces whole groups.
        assert meta["annotations"][kueue.RETRIABLE_ANNOTATION] == "false"
    assert groups == {f"j-01234-a{attempt}"}


def test_group_names_differ_per_attempt_and_job_incarnation_and_fit_63():
    a = queued_job(uid="aaaaaaaa")
    b = queued_job(uid="bbbbbbbb")
    assert kueue.group_name(a, 0) != kueue.group_name(a, 1) != kueue.group_name(b, 1)
    long = queued_job(name="x" * 58)
    name = kueue.group_name(long, 12345)
    assert len(name) <= 63 and name.endswith("-01234-a12345")


def test_no_queue_label_no_kueue_metadata():
    meta = render_pod(queued_job(queue=None), 0)["metadata"]
    assert not [k for k in {**meta["labels"], **meta["annotations"]} if k.startswith("kueue.")]


def test_the_operators_group_wins_over_podlabels():
    job = queued_job(podLabels={kueue.GROUP_LABEL: "mine", kueue.QUEUE_LABEL: "other"})
    labels = render_pod(job, 0)["metadata"]["labels"]
    assert labels[kueue.GROUP_LABEL] == "j-01234-a0" and labels[kueue.QUEUE_LABEL] == "team-a"


def pod(rank, *, gated=False, managed=True, attempt=0):
    p = make_pod(rank, phase="Pending", attempt=attempt)
    if managed:
        p["metadata"]["labels"][kueue.MANAGED_LABEL] = "true"
    p["spec"] = {"schedulingGates": [{"name": kueue.ADMISSION_GATE}]} if gated else {"nodeName": "n"}
    return p


def admitted(status):
    return next((c for c in status["conditions"] if c["type"] == "Admitted"), None)


def test_admitted_condition_follows_the_gates():
    job = queued_job(nodes=2)
    waiting = [pod(0, gated=True), pod(1, gated=True)]
    status, events = pass_status(job, Group.of(waiting), now=NOW, prev_status={})
    cond = admitted(status)
    assert (cond["status"], cond["reason"]) == ("False", "Queued")
    assert "waiting in Kueue LocalQueue team-a for quota for all 2 pods: 2 gated" in cond["message"]
    assert "Workload j-01234-a0" in cond["message"]
    assert status["phase"] == "Pending"
    assert [e[1] for e in events].count("Queued") == 1
    _, again = pass_status(job, Group.of(waiting), now=NOW, prev_status=status)
    assert not [e for e in again if e[1] == "Queued"]  # still queued: announced once

    status2, events2 = pass_status(job, Group.of([pod(0), pod(1)]), now=NOW, prev_status=status)
    cond = admitted(status2)
    assert (cond["status"], cond["reason"]) == ("True", "Admitted")
    assert [e[1] for e in events2].count("Admitted") == 1
    _, events3 = pass_status(job, Group.of([pod(0), pod(1)]), now=NOW, prev_status=status2)
    assert not [e for e in events3 if e[1] in ("Admitted", "Queued")]


def test_pods_kueue_did_not_take_are_named_as_such():
    job = queued_job(nodes=1)
    status, events = pass_status(job, Group.of([pod(0, managed=False)]), now=NOW, prev_status={})
    cond = admitted(status)
    assert (cond["status"], cond["reason"]) == ("False", "NotManagedByKueue")
    assert "Kueue did not take them" in cond["message"]
    assert ("Warning", "NotManagedByKueue") in [e[:2] for e in events]


def test_no_condition_without_a_queue_or_before_the_pods():
    assert admitted(pass_status(queued_job(queue=None), Group.of([pod(0, gated=True)]), now=NOW,
                                prev_status={})[0]) is None
    assert admitted(pass_status(queued_job(), Group.of([]), now=NOW, prev_status={})[0]) is None


def test_queue_label_among_the_pod_labels_still_makes_one_group():
    """Set through podLabels or the template, the queue label alone would have Kueue admit the
    pods one by one (the deadlock queues are for): the operator makes them one group anyway."""
    for spec in ({"podLabels": {kueue.QUEUE_LABEL: "gpus"}},
                 {"template": {"metadata": {"labels": {kueue.QUEUE_LABEL: "gpus"}}}}):
        job = queued_job(queue=None, nodes=2, **spec)
        meta = render_pod(job, 1)["metadata"]
        assert meta["labels"][kueue.QUEUE_LABEL] == "gpus"
        assert meta["labels"][kueue.GROUP_LABEL] == "j-01234-a0"
        assert meta["annotations"][kueue.TOTAL_ANNOTATION] == "2"


def test_time_in_the_queue_does_not_count_toward_the_deadline():
    job = queued_job(nodes=2, activeDeadlineSeconds=600)
    prev = {"phase": "Pending", "attempt": 0, "startTime": ago(3600)}
    d = decide(job, Group.of([pod(0, gated=True), pod(1, gated=True)]), now=NOW, prev_status=prev)
    assert d.phase is Phase.PENDING and d.start_time == NOW
    # Admitted: the clock runs from then on.
    d = decide(job, Group.of([pod(0), pod(1)]), now=NOW, prev_status={**prev, "startTime": ago(599)})
    assert d.phase is not Phase.FAILED
    d = decide(job, Group.of([pod(0), pod(1)]), now=NOW, prev_status={**prev, "startTime": ago(601)})
    assert d.phase is Phase.FAILED and d.reason == "DeadlineExceeded"


def test_a_group_kueue_evicts_restarts_without_using_the_budget():
    job = queued_job(nodes=2)
    evicted = pod(1)
    evicted["status"] = {"phase": "Failed", "conditions": [
        {"type": "TerminationTarget", "status": "True", "reason": "WorkloadEvictedDueToPreempted",
         "message": "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue"}],
        "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": 143}}}]}
    d = decide(job, Group.of([pod(0), evicted]), now=NOW,
               prev_status={"phase": "Running", "attempt": 0, "restarts": 0, "countedRestarts": 0,
                            "startTime": ago(100)})
    assert d.restarted is not None and d.restarted.reason == "PodPreempted"
    assert (d.restarts, d.counted_restarts) == (1, 0)
    assert "Kueue: Preempted to accommodate" in d.message


def test_taking_the_queue_label_off_drops_the_admitted_condition():
    """The next attempt's pods are not queued: an earlier group's admission would be stale."""
    status, _ = pass_status(queued_job(nodes=1), Group.of([pod(0)]), now=NOW, prev_status={})
    assert admitted(status)["reason"] == "Admitted"
    unqueued = queued_job(nodes=1, queue=None)
    after, events = pass_status(unqueued, Group.of([pod(0, managed=False)]), now=NOW, prev_status=status)
    assert admitted(after) is None and not [e for e in events if e[1] in ("Admitted", "Queued")]
    # Between attempts (no current pod) a queued job keeps what it had.
    kept, _ = pass_status(queued_job(nodes=1), Group.of([]), now=NOW, prev_status=status)
    assert admitted(kept)["reason"] == "Admitted"
