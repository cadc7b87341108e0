"""A lost pod of a rank other than 0 is replaced alone (lifecycle.decide, inplace.update, job_status):
which causes replace and which restart the group, the replacement's name and hostname, which pod
stands for a rank, when the replacement is created, what it is charged, and how it shows."""
from __future__ import annotations

import pytest

from ddpjob_api import labels
from ddpjob_api.phases import Phase, Reason, Recovery
from ddpjob_api.names import pod_name
from ddpjob_operator.base.group import Group
from ddpjob_operator.builders.pods import render_pod
from ddpjob_operator.decisions import inplace
from ddpjob_operator.decisions.lifecycle import decide
from ddpjob_operator.decisions.status import job_status
from tests.support.builders import NOW, make_job, make_pod, running_status
from tests.support.status import condition as cond
from tests.unit.test_inplace import Sample, failure
from tests.unit.test_status import Report


def replacement_pod(rank: int, n: int, *, attempt: int = 0, **kw) -> dict:
    pod = make_pod(rank, attempt=attempt, name=pod_name("j", rank, attempt, n), **kw)
    pod["metadata"]["labels"][labels.REPLACEMENT] = str(n)
    return pod


T0 = NOW.timestamp()  # the pass that sees the loss; the pods' clocks agree here
GONE = object()  # rank 1's pod vanished after the launch (force-deleted, PodGC)


@pytest.mark.parametrize("lost, job, replaced, reason, counted", [
    (make_pod(1, deleting=True), {}, True, "PodDeleted", 1),
    (GONE, {}, True, "PodDeleted", 1),
    (make_pod(1, phase="Failed", exit_code=137, evicted=True), {}, True, "PodEvicted", 0),
    (make_pod(1, phase="Failed", exit_code=137, disruption="PreemptionByScheduler"), {}, True, "PodPreempted", 0),
    (make_pod(1, phase="Failed", exit_code=137, disruption="DeletionByPodGC"), {}, True, "NodeLost", 0),
    (make_pod(1, phase="Failed", exit_code=137, reason="NodeLost"), {}, True, "NodeLost", 0),
    # Its launcher or agent failed (or its in-place budget was spent): the others may be failing too.
    (make_pod(1, phase="Failed", exit_code=1), {}, False, "PodFailed", 1),
    # Kueue admits a pod group whole; no in-place restarts: the survivors cannot wait for a peer;
    # the job's own rendezvous endpoint: who hosts it is not ours to know.
    (make_pod(1, deleting=True), {"podLabels": {"kueue.x-k8s.io/queue-name": "q"}}, False, "PodDeleted", 1),
    (make_pod(1, phase="Failed", exit_code=137, evicted=True), {"failurePolicy": {"maxRestarts": 0}}, False,
     "PodEvicted", 0),
    (make_pod(1, deleting=True), {"env": [{"name": "PET_RDZV_ENDPOINT", "value": "etcd:2379"}]}, False,
     "PodDeleted", 1),
], ids=["deleted", "vanished", "evicted", "preempted", "node-gone", "node-lost", "failed", "kueue",
        "no-inplace-budget", "own-rendezvous"])
def test_which_lost_pods_are_replaced_alone(lost, job, replaced, reason, counted):
    pods = [make_pod(0)] + ([] if lost is GONE else [lost])
    d = decide(make_job(nodes=2, **job), Group.of(pods), now=NOW, prev_status=running_status())
    assert d.counted_restarts == counted and d.restarts == 1
    if replaced:
        (r,) = d.replaced
        assert (r.rank, r.old_pod, r.number, r.new_pod, r.failure.reason) == (1, "j-1", 1, "j-1-r1", reason)
        assert d.phase is Phase.RUNNING and d.reason == Reason.REPLACING_POD and d.attempt == 0
        assert "j-0" not in d.delete_pods and d.restarted is None
    else:
        assert d.replaced == [] and d.phase is Phase.RESTARTING and d.reason == reason and d.attempt == 1


def test_rank_0_lost_restarts_the_group_even_with_another_rank_lost():
    # Pod 0 hosts the c10d store every agent's rendezvous goes through.
    pods = [make_pod(0, deleting=True), make_pod(1, deleting=True), make_pod(2)]
    d = decide(make_job(nodes=3), Group.of(pods), now=NOW, prev_status=running_status())
    assert d.phase is Phase.RESTARTING and d.replaced == [] and d.attempt == 1


def test_several_lost_ranks_are_each_replaced():
    pods = [make_pod(0), make_pod(1, deleting=True), make_pod(2, phase="Failed", exit_code=137, evicted=True)]
    d = decide(make_job(nodes=3), Group.of(pods), now=NOW, prev_status=running_status())
    assert [(r.rank, r.new_pod, r.failure.counted) for r in d.replaced] == [(1, "j-1-r1", True), (2, "j-2-r1", False)]
    assert (d.restarts, d.counted_restarts) == (2, 1)
    # The evicted pod has ended: its replacement is created now (the deleted one's waits), and it
    # is kept for its logs.
    assert d.create_ranks == [] and d.requeue_after is not None  # rank 1's pod still terminates
    assert d.delete_pods == []


def test_the_name_differs_the_hostname_does_not():
    job = make_job(nodes=11)
    assert pod_name("j", 3, 0, 1) == "j-3-r1" and pod_name("j", 3, 2, 4) == "j-3-a2-r4" and pod_name("j", 3, 2) == "j-3-a2"
    pod = render_pod(job, 3, attempt=2, replacement=4)
    assert pod["metadata"]["name"] == "j-3-a2-r4" and pod["spec"]["hostname"] == "j-03"
    assert pod["metadata"]["labels"][labels.REPLACEMENT] == "4" and pod["metadata"]["labels"][labels.NODE_RANK] == "3"
    assert labels.REPLACEMENT not in render_pod(job, 3, attempt=2)["metadata"]["labels"]


@pytest.mark.parametrize("order", [0, 1])
def test_by_rank_is_the_newest_replacement_whatever_the_listing_order(order):
    pods = [make_pod(1, deleting=True), replacement_pod(1, 2), replacement_pod(1, 1, phase="Failed")]
    pods = pods if order == 0 else pods[::-1]
    assert Group.of([make_pod(0)] + pods).at(0).by_rank[1]["metadata"]["name"] == "j-1-r2"


def step(pods, prev, **kw):
    """One pass: the decision and the status it writes."""
    group = Group.of(pods, departed=kw.pop("departed", ()))
    d = decide(make_job(nodes=2), group, now=NOW, prev_status=prev)
    status, events = job_status(make_job(nodes=2), group, now=NOW, prev_status=prev, decision=d, **kw)
    return d, status, events


def test_a_replacement_from_the_loss_to_its_first_step():
    # Pass 1: rank 1's pod is being deleted. Recorded and charged once; nothing created while the
    # old pod still exists (the headless Service may still resolve its hostname).
    survivor = make_pod(0, node_name="n0")
    old = make_pod(1, deleting=True, node_name="n1")
    d, st, events = step([survivor, old], running_status(progress={"step": 40}))
    (entry,) = st["restartHistory"]
    assert entry == {**entry, "kind": "Replace", "attempt": 0, "rank": 1, "pod": "j-1", "node": "n1", "replacement": 1,
                     "newPod": "j-1-r1", "reason": "PodDeleted", "stepAtFailure": 40}
    assert (st["phase"], st["reason"], st["restarts"], st["countedRestarts"], st["attempt"]) == (
        "Running", "ReplacingPod", 1, 1, 0)
    assert cond(st, "Restarting")["reason"] == "ReplacingPod" and "j-1-r1" in cond(st, "Restarting")["message"]
    assert [e[1] for e in events] == ["ReplacingPod"] and d.create_ranks == [] and d.delete_pods == []

    # Pass 2: still terminating: not charged again, still waiting.
    d, st2, events = step([survivor, old], st)
    assert (st2["restarts"], st2["countedRestarts"], len(st2["restartHistory"])) == (1, 1, 1)
    assert d.create_ranks == [] and d.replaced == [] and events == []

    # Pass 3: gone: its replacement is created, under its own name, same rank and attempt.
    d, st3, _ = step([survivor], st2, departed=[old])
    assert d.create_ranks == [1] and d.replacement == {1: 1} and d.replaced == [] and st3["restarts"] == 1

    # Pass 4: the survivor's worker failed on its lost peer and was restarted in place: part of the
    # replacement (alsoFailed), no restart of its own. The new pod has not stepped yet: still open.
    new = replacement_pod(1, 1, phase="Pending")
    ranks = {0: Sample("j-0", worker_failures=[failure(T0 + 0.5, code=1, signal="", error="PeerStopped")],
                       first_step_timestamp=T0 + 1, resumed_from_step=40)}
    d, st4, _ = step([survivor, new], st3, report=Report(ranks=ranks))
    (entry,) = st4["restartHistory"]
    assert "inPlaceRestarts" not in st4 and [a["pod"] for a in entry["alsoFailed"]] == ["j-0"]
    assert "recoverySeconds" not in entry and d.create_ranks == [] and st4["reason"] == "ReplacingPod"

    # Pass 5: the new pod steps: recovered, measured like an in-place restart.
    running = replacement_pod(1, 1)
    ranks[1] = Sample("j-1-r1", first_step_timestamp=T0 + 9, resumed_from_step=40)
    d, st5, events = step([survivor, running], st4, report=Report(ranks=ranks))
    (entry,) = st5["restartHistory"]
    assert entry["recoverySeconds"] == 9.0 and entry["stepsLost"] == 0 and st5["reason"] == "Running"
    assert (cond(st5, "Restarting")["status"], cond(st5, "Restarting")["reason"]) == ("False", "PodReplaced")
    assert [e[1] for e in events] == ["PodReplaced"]
    assert inplace.recoveries(st4, st5) == [("Replace", 9.0, 0)]


def test_an_in_place_restart_seen_before_the_loss_is_folded_into_the_replacement():
    prev = running_status(inPlaceRestarts=1, restartHistory=[
        {"kind": "InPlace", "attempt": 0, "restart": 0, "rank": 0, "pod": "j-0", "exitCode": 1, "failedAt": T0 - 1}])
    _, st, _ = step([make_pod(0), make_pod(1, deleting=True)], prev)
    (entry,) = st["restartHistory"]
    assert entry["kind"] == "Replace" and entry["failedAt"] == T0 - 1 and entry["alsoFailed"][0]["pod"] == "j-0"
    assert "inPlaceRestarts" not in st and st["restarts"] == 1


def test_an_evicted_pod_is_kept_and_replaced_at_once_and_a_lost_replacement_is_replaced_again():
    evicted = make_pod(1, phase="Failed", exit_code=137, evicted=True)
    d, st, _ = step([make_pod(0), evicted], running_status())
    assert d.create_ranks == [1] and d.replacement == {1: 1} and d.delete_pods == []
    assert st["countedRestarts"] == 0 and st["restarts"] == 1
    # Its replacement is deleted in turn: the next one is -r2; the evicted pod stays for its logs.
    d, st, _ = step([make_pod(0), evicted, replacement_pod(1, 1, deleting=True)], st)
    assert [(r.old_pod, r.new_pod) for r in d.replaced] == [("j-1-r1", "j-1-r2")]
    assert (st["restarts"], st["countedRestarts"]) == (2, 1) and d.delete_pods == []


def test_a_deletion_with_the_budget_spent_fails_the_job():
    prev = running_status(countedRestarts=2, restarts=2)
    d = decide(make_job(nodes=2, failurePolicy={"maxRestarts": 2}), Group.of([make_pod(0), make_pod(1, deleting=True)]),
               now=NOW, prev_status=prev)
    assert d.phase is Phase.FAILED and d.reason == "RestartLimitExceeded" and d.replaced == []
    # An eviction is free: replaced even then.
    d = decide(make_job(nodes=2, failurePolicy={"maxRestarts": 2}),
               Group.of([make_pod(0), make_pod(1, phase="Failed", exit_code=137, evicted=True)]), now=NOW, prev_status=prev)
    assert [r.new_pod for r in d.replaced] == ["j-1-r1"] and d.counted_restarts == 2


def test_a_status_edit_naming_a_live_pod_as_replaced_gets_nothing_deleted():
    prev = running_status(restartHistory=[{"kind": "Replace", "attempt": 0, "rank": 1, "pod": "j-1", "replacement": 1,
                                           "newPod": "j-1-r1", "reason": "PodDeleted", "failedAt": 1.0}])
    d = decide(make_job(nodes=2), Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=prev)
    assert d.phase is Phase.RUNNING and d.delete_pods == [] and d.create_ranks == [] and d.replaced == []


def test_an_elastic_job_trains_on_fewer_nodes_while_the_replacement_cannot_start_and_grows_back():
    job = make_job(nodes=3, elastic={"minNodes": 2, "maxNodes": 3})
    survivors = [make_pod(0), make_pod(1)]
    d0 = decide(job, Group.of([*survivors, make_pod(2, deleting=True)]), now=NOW, prev_status=running_status())
    st, _ = job_status(job, Group.of([*survivors, make_pod(2, deleting=True)]), now=NOW, prev_status=running_status(),
                       decision=d0)
    # The replacement is pending (unschedulable); the survivors' round completed after its last call.
    pending = replacement_pod(2, 1, phase="Pending", unschedulable_for=600)
    ranks = {r: Sample(f"j-{r}", first_step_timestamp=T0 + 40, resumed_from_step=40) for r in (0, 1)}
    group = Group.of([*survivors, pending])
    d = decide(job, group, now=NOW, prev_status=st)
    st2, events = job_status(job, group, now=NOW, prev_status=st, decision=d, report=Report(ranks=ranks))
    assert (st2["phase"], st2["attempt"], d.delete_pods, d.create_ranks) == ("Running", 0, [], [])
    resized = cond(st2, "Resized")
    assert (resized["status"], resized["reason"]) == ("True", "FewerNodes") and "on 2 of 3 nodes" in resized["message"]
    assert [e[1] for e in events] == ["FewerNodes", "Unschedulable"]
    assert "recoverySeconds" not in st2["restartHistory"][0]  # not recovered: it runs short of a node
    # The same in a job that cannot shrink: the survivors wait for it (no Resized).
    rigid = make_job(nodes=3)
    st3, _ = job_status(rigid, group, now=NOW, prev_status=st, decision=decide(rigid, group, now=NOW, prev_status=st),
                        report=Report(ranks=ranks))
    assert cond(st3, "Resized") is None
    # It starts and steps: every node trains again.
    running = replacement_pod(2, 1)
    ranks[2] = Sample("j-2-r1", first_step_timestamp=T0 + 90, resumed_from_step=60)
    for r in (0, 1):
        ranks[r].first_step_timestamp = T0 + 89
    group = Group.of([*survivors, running])
    st4, events = job_status(job, group, now=NOW, prev_status=st2, decision=decide(job, group, now=NOW, prev_status=st2),
                             report=Report(ranks=ranks))
    assert (cond(st4, "Resized")["status"], cond(st4, "Resized")["reason"]) == ("False", "AllNodes")
    assert st4["restartHistory"][0]["recoverySeconds"] == 90.0 and {"AllNodes", "PodReplaced"} <= {e[1] for e in events}


@pytest.mark.parametrize("survivor_rounds, lost_now, counted, phase", [
    (1, False, 1, "Running"),  # the survivors' round for the replacement its pods show: the replacement's
    (2, False, 1, "Failed"),   # one more round: an in-place restart of its own, proven by the agent
    (1, True, 0, "Running"),   # the round for a pod lost in this very pass: what replaces it answers it
])
def test_the_survivors_round_for_a_replacement_is_not_charged_in_place(survivor_rounds, lost_now, counted, phase):
    """The in-place count is never below what the agents prove (inplace.proven), but a round a lost
    pod took the survivors through is its replacement's (or group restart's), charged as that."""
    job = make_job(nodes=3, failurePolicy={"maxRestarts": 1})
    pods = [make_pod(0), replacement_pod(1, 1), make_pod(2, deleting=True) if lost_now else make_pod(2)]
    ranks = {0: Sample("j-0", worker_failures=[failure(T0 + 60 * r, restart=r) for r in range(survivor_rounds)])}
    d = decide(job, Group.of(pods), now=NOW, prev_status=running_status(restarts=1, countedRestarts=counted),
               ranks=ranks)
    assert d.phase.value == phase, (d.reason, d.message)
    if phase == "Failed":
        assert d.reason == "RestartLimitExceeded" and "1 restart(s) in place" in d.message, d.message
    if lost_now:
        assert [r.new_pod for r in d.replaced] == ["j-2-r1"]


def test_the_survivors_round_is_not_charged_while_the_replacement_is_not_created_yet():
    """Between the pass that decided a replacement and the new pod (the old one still going),
    neither the pods nor the pass show it: the history's pending replacement does (seen on the
    real nodes: an in-place restart, then a deletion, failed the job with RestartLimitExceeded)."""
    job = make_job(nodes=2, failurePolicy={"maxRestarts": 2})
    # What the passes before wrote: rank 0's in-place restart, then the replacement its second
    # failure belongs to.
    history = [{"kind": Recovery.IN_PLACE, "attempt": 0, "rank": 0, "pod": "j-0", "restart": 0, "time": "2026-01-01T00:00:00Z"},
               {"kind": Recovery.REPLACE, "attempt": 0, "rank": 1, "pod": "j-1", "replacement": 1,
                "newPod": "j-1-r1", "reason": "PodDeleted", "time": "2026-01-01T00:01:00Z",
                "alsoFailed": [{"attempt": 0, "pod": "j-0", "rank": 0, "restart": 1}]}]
    prev = running_status(restarts=1, countedRestarts=1, inPlaceRestarts=1, restartHistory=history)
    # j-0's agent: restarted once in place (restart 0), once for the replacement (restart 1).
    ranks = {0: Sample("j-0", worker_failures=[failure(T0, restart=0), failure(T0 + 60, restart=1)])}
    for pods in ([make_pod(0), make_pod(1, deleting=True)], [make_pod(0)]):
        d = decide(job, Group.of(pods), now=NOW, prev_status=prev, ranks=ranks)
        assert d.phase is Phase.RUNNING and d.reason == Reason.REPLACING_POD, (d.reason, d.message)
        st, _ = job_status(job, Group.of(pods), now=NOW, prev_status=prev, decision=d, report=Report(ranks=ranks))
        assert st["inPlaceRestarts"] == 1 and st["phase"] == "Running", st
    # An edited history naming a replacement for a rank whose pod still stands counts nothing.
    forged = running_status(restarts=1, countedRestarts=1, inPlaceRestarts=0, restartHistory=[
        {**history[1], "pod": "j-0", "rank": 0}])
    d = decide(job, Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=forged, ranks=ranks)
    assert d.replacement_rounds == 0
