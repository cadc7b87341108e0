"""A per-step job (spec.faultTolerance): any lost or failed pod is replaced alone, rank 0 too, and
its restartHistory entry says mode perStep (lifecycle.replace_lost, inplace, job_status); the
job's Lighthouse is kept beside its pods (lifecycle.keep_lighthouse) and made again when deleted
(the Reconciler, on the fake API of test_reconcile)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
from kubernetes.client.rest import ApiException

from ddpjob_api import labels
from ddpjob_api.phases import Phase, Reason
from ddpjob_operator.base.group import Group
from ddpjob_operator.builders.lighthouse import render_lighthouse_pod
from ddpjob_operator.decisions import lifecycle
from ddpjob_operator.decisions.lifecycle import decide
from ddpjob_operator.decisions.status import job_status
from tests.support.builders import NOW, make_job, make_manifest, make_pod, running_status
from tests.support.status import condition as cond
from tests.unit.test_inplace import Sample
from tests.unit.test_policies import BAD, DELETED, EVICTED, FAILED, act, first
from tests.unit.test_reconcile import NS, FakeK8s, reconciler, run, set_phase
from tests.unit.test_replace import T0, replacement_pod
from tests.unit.test_status import Report

FT = {"faultTolerance": {"mode": "perStep", "minReplicas": 1}}
SPEC = {"nodes": 3, "failurePolicy": {"maxRestarts": 3}}
QUIET = lifecycle.observe(make_job(**SPEC, **FT), Group.of([make_pod(r) for r in range(3)]), running_status(), now=NOW)
FAILED_0 = dataclasses.replace(FAILED, message="pod j-0 failed with exit code 1")


def lost(*ranked):
    return dataclasses.replace(QUIET, lost=[(r, QUIET.current[r], f) for r, f in ranked],
                               failures=[f for _, f in ranked])


# (the pods lost in this pass) -> what the first policy that answers does, and what it charges.
@pytest.mark.parametrize("seen, answer, counted", [
    (lost((1, EVICTED)), "replace", 0),
    (lost((1, DELETED)), "replace", 1),
    # A failed pod fails alone: its peers are groups of their own, they do not fail with it.
    (lost((1, FAILED)), "replace", 1),
    # Rank 0 hosts no store the others need: replaced alone too.
    (lost((0, FAILED_0)), "replace", 1),
    (lost((0, DELETED), (2, EVICTED)), "replace", 1),
    # Every group lost: no peer holds the state; the group restarts from the checkpoints.
    (lost((0, DELETED), (1, EVICTED), (2, EVICTED)), "restart", 1),
    # What no restart can help still fails the job, and a spent budget still ends it.
    (lost((1, BAD)), "fail", 0),
    (dataclasses.replace(lost((1, FAILED)), active=dataclasses.replace(QUIET.active, counted_restarts=3)), "fail", 3),
], ids=["evicted", "deleted", "failed", "rank-0-failed", "two-lost", "all-lost", "bad-configuration",
        "budget-spent"])
def test_any_lost_pod_of_a_per_step_job_is_replaced_alone(seen, answer, counted):
    d = first(seen)
    assert d is not None and act(d) == answer and d.counted_restarts == counted
    if answer == "replace":
        assert d.phase is Phase.RUNNING and d.reason == Reason.REPLACING_POD and d.attempt == 0
        assert d.restarts == len(seen.lost) and d.restarted is None
        assert all(r.mode == "perStep" for r in d.replaced)
        assert {r.rank for r in d.replaced} == {r for r, _, _ in seen.lost}


def test_the_same_losses_restart_the_group_without_fault_tolerance():
    plain = dataclasses.replace(QUIET, job=make_job(**SPEC))
    for facts in ([(1, FAILED)], [(0, DELETED)]):
        s = dataclasses.replace(plain, lost=[(r, QUIET.current[r], f) for r, f in facts], failures=[f for _, f in facts])
        assert act(first(s)) == "restart"


def test_kueue_still_restarts_a_per_step_group():
    job = make_job(**SPEC, **FT, podLabels={"kueue.x-k8s.io/queue-name": "q"})
    assert act(first(dataclasses.replace(lost((1, EVICTED)), job=job))) == "restart"


def step(job, pods, prev, **kw):
    group = Group.of(pods, departed=kw.pop("departed", ()))
    d = decide(job, group, now=NOW, prev_status=prev)
    status, events = job_status(job, group, now=NOW, prev_status=prev, decision=d, **kw)
    return d, status, events


def test_a_per_step_replacement_from_the_failure_to_its_first_step():
    job = make_job(nodes=2, **FT)
    survivor = make_pod(0, node_name="n0")
    failed = make_pod(1, phase="Failed", exit_code=1, node_name="n1")
    # The failed pod is kept for its logs and replaced at once; pod 0 is not touched.
    d, st, events = step(job, [survivor, failed], running_status(progress={"step": 40}))
    (entry,) = st["restartHistory"]
    assert entry == {**entry, "kind": "Replace", "mode": "perStep", "rank": 1, "pod": "j-1", "newPod": "j-1-r1",
                     "reason": "PodFailed"}
    assert (st["phase"], st["reason"], st["restarts"], st["countedRestarts"], st["attempt"]) == (
        "Running", "ReplacingPod", 1, 1, 0)
    assert d.create_ranks == [1] and d.replacement == {1: 1} and d.delete_pods == []
    assert "train on without it" in cond(st, "Restarting")["message"]
    # The survivor steps on without it (its worker never restarted): Running on 1 of 2, Resized.
    new = replacement_pod(1, 1, phase="Pending")
    ranks = {0: Sample("j-0", first_step_timestamp=T0 - 500, last_step_timestamp=T0 + 2, resumed_from_step=0)}
    d, st2, events = step(job, [survivor, failed, new], st, report=Report(ranks=ranks))
    assert (st2["phase"], st2["attempt"], d.create_ranks, d.delete_pods) == ("Running", 0, [], [])
    resized = cond(st2, "Resized")
    assert resized["status"] == "True" and "on 1 of 2 nodes (spec.faultTolerance.minReplicas=1)" in resized["message"]
    assert "recoverySeconds" not in st2["restartHistory"][0]
    # The replacement steps: recovered, and every group trains again.
    ranks[1] = Sample("j-1-r1", first_step_timestamp=T0 + 9, last_step_timestamp=T0 + 9, resumed_from_step=41)
    d, st3, events = step(job, [survivor, failed, replacement_pod(1, 1)], st2, report=Report(ranks=ranks))
    (entry,) = st3["restartHistory"]
    assert entry["recoverySeconds"] == 9.0 and entry["resumedFromStep"] == 41
    assert (cond(st3, "Resized")["status"], st3["reason"]) == ("False", "Running")
    assert {"AllNodes", "PodReplaced"} <= {e[1] for e in events}


LIGHTHOUSE = render_lighthouse_pod(make_job(nodes=3, **FT))


def up(pod, **status):
    return {**copy.deepcopy(pod), "status": {"phase": "Running", **status}}


READY = up(LIGHTHOUSE, conditions=[{"type": "Ready", "status": "True"}])


# (phase of the pass, cleanPodPolicy, the Lighthouse listed) -> (make it, delete it, it serves)
@pytest.mark.parametrize("phase, policy, pod, create, delete, ready", [
    (Phase.PENDING, "Running", None, True, False, False),
    (Phase.RUNNING, "Running", None, True, False, False),
    (Phase.RESTARTING, "Running", READY, False, False, True),
    (Phase.RUNNING, "Running", READY, False, False, True),
    (Phase.RUNNING, "Running", up(LIGHTHOUSE), False, False, False),   # its probe does not pass yet
    # Evicted (restartPolicy Always keeps it up otherwise): deleted; its DELETED event brings the next.
    (Phase.RUNNING, "Running", up(LIGHTHOUSE, phase="Failed", reason="Evicted"), False, True, False),
    (Phase.SUSPENDED, "Running", READY, False, True, None),
    (Phase.SUSPENDED, "Running", None, False, False, None),
    (Phase.SUCCEEDED, "Running", READY, False, True, None),
    (Phase.FAILED, "All", READY, False, True, None),
    (Phase.SUCCEEDED, "None", READY, False, False, None),
    (Phase.SUCCEEDED, "Running", None, False, False, None),
])
def test_the_lighthouse_lives_while_the_job_may_run(phase, policy, pod, create, delete, ready):
    job = make_job(nodes=3, cleanPodPolicy=policy, **FT)
    d = lifecycle.keep_lighthouse(job, dataclasses.replace(QUIET.base, phase=phase, delete_pods=["j-2"]), pod)
    assert d.create_lighthouse is create and d.lighthouse_ready is ready
    assert d.delete_pods == ["j-2"] + (["j-ft"] if delete else [])


def test_lighthouse_ready_once_it_serves_and_not_while_it_is_made_again():
    job = make_job(nodes=3, **FT)
    group = Group.of([make_pod(r) for r in range(3)])
    prev = running_status()
    for pod, status in ((up(LIGHTHOUSE), None), (READY, "True"), (None, "False"), (READY, "True")):
        d = decide(job, group, now=NOW, prev_status=prev, lighthouse=pod)
        prev, _ = job_status(job, group, now=NOW, prev_status=prev, decision=d)
        assert (cond(prev, "LighthouseReady") or {}).get("status") == status, (pod, prev.get("conditions"))
    assert prev["phase"] == "Running"
    plain = make_job(nodes=3)
    st, _ = job_status(plain, group, now=NOW, prev_status=running_status(),
                       decision=decide(plain, group, now=NOW, prev_status=running_status(), lighthouse=READY))
    assert cond(st, "LighthouseReady") is None


def test_a_job_without_fault_tolerance_has_no_lighthouse():
    d = lifecycle.keep_lighthouse(make_job(nodes=3), QUIET.base, None)
    assert d == QUIET.base


# --- the Reconciler: the Lighthouse among the job's children ------------------------------------

def children(k8s):
    return [c[1:] for c in k8s.writes() if c[0] == "create"]


async def created(k8s, rec):
    """A new two-node per-step job's first pass: its children made."""
    rec.job_event(k8s.add_job(make_manifest(nodes=2, **FT)))
    await rec.reconcile(NS, "j")


def test_a_per_step_job_gets_its_lighthouse_first_and_it_is_made_again_alone_when_deleted():
    k8s = FakeK8s()
    rec = reconciler(k8s)

    async def main():
        await created(k8s, rec)
        assert children(k8s) == [("Service", "j-ft"), ("Pod", "j-ft"), ("Service", "j"), ("Pod", "j-0"), ("Pod", "j-1")]
        set_phase(rec, k8s, "Running")
        rec.coalesce = 0.0
        await rec.reconcile(NS, "j")
        status = k8s.jobs["j"]["status"]
        # The Lighthouse counts as none of the job's nodes.
        assert status["phase"] == "Running" and status["message"] == "all 2 node(s) running", status
        k8s.calls.clear()
        # Deleted (its watch says so): made again, nothing else created, deleted or restarted.
        pod = k8s.objects.pop(("Pod", "j-ft"))
        rec.pods.delete(copy.deepcopy(pod))
        assert rec.kicked[-1] == (NS, "j") and "j-ft" not in rec._departed.get((NS, "j"), {})
        await rec.reconcile(NS, "j")
        assert children(k8s) == [("Service", "j-ft"), ("Pod", "j-ft")]
        assert not [c for c in k8s.calls if c[0] == "delete_pod"]
        assert k8s.jobs["j"]["status"]["restarts"] == 0 and k8s.jobs["j"]["status"]["phase"] == "Running"
        # A pass with everything there creates nothing.
        k8s.calls.clear()
        await rec.reconcile(NS, "j")
        assert children(k8s) == []
        await rec.shutdown()
    run(main())


def test_a_finished_per_step_job_deletes_its_lighthouse_with_its_pods():
    k8s = FakeK8s()
    rec = reconciler(k8s)

    async def main():
        await created(k8s, rec)
        for name in ("j-0", "j-1"):
            set_phase(rec, k8s, "Succeeded", name=name)
        set_phase(rec, k8s, "Running", name="j-ft")
        k8s.calls.clear()
        await rec.reconcile(NS, "j")
        assert k8s.jobs["j"]["status"]["phase"] == "Succeeded"
        assert [c[1] for c in k8s.calls if c[0] == "delete_pod"] == ["j-ft"]  # cleanPodPolicy Running
        await rec.shutdown()
    run(main())


def test_the_lighthouse_refused_leaves_the_group_uncreated_and_says_why():
    k8s = FakeK8s()
    k8s.objects[("Service", "j-ft")] = {"kind": "Service", "metadata": {"name": "j-ft", "namespace": NS,
                                                                        "labels": {labels.JOB_NAME: "other"}}}
    rec = reconciler(k8s)

    async def main():
        await created(k8s, rec)
        await rec.shutdown()
    run(main())
    assert children(k8s) == [("Service", "j-ft")]  # the 409; no pod
    message = cond(k8s.jobs["j"]["status"], "FailedCreatePod")["message"]
    assert "service j-ft exists and is not owned by this DDPJob" in message


class QuotaK8s(FakeK8s):
    """Refuses the Lighthouse pod as a namespace's exhausted quota does (403), while `full`."""

    full = False

    async def create(self, obj):
        if self.full and obj["kind"] == "Pod" and obj["metadata"]["name"] == "j-ft":
            self.calls.append(("create", "Pod", "j-ft"))
            raise ApiException(status=403, reason="Forbidden")
        return await super().create(obj)


def test_a_refused_lighthouse_of_a_running_job_is_said_until_it_is_made():
    k8s = QuotaK8s()
    rec = reconciler(k8s)

    async def main():
        await created(k8s, rec)
        set_phase(rec, k8s, "Running")
        rec.coalesce = 0.0
        await rec.reconcile(NS, "j")
        k8s.full = True
        rec.pods.delete(copy.deepcopy(k8s.objects.pop(("Pod", "j-ft"))))
        for _ in range(2):  # the refusal, then the retry REFUSED_RETRY_SECONDS later: refused again
            await rec.reconcile(NS, "j")
            assert cond(k8s.jobs["j"]["status"], "FailedCreatePod")["status"] == "True"
        # One condition and one event for the one refusal, not one per retry.
        assert [c for c in k8s.calls if c == ("event", "FailedCreatePod")] == [("event", "FailedCreatePod")]
        k8s.full = False
        await rec.reconcile(NS, "j")   # made
        assert ("Pod", "j-ft") in k8s.objects
        await rec.reconcile(NS, "j")   # as its ADDED event brings
        status = k8s.jobs["j"]["status"]
        assert cond(status, "FailedCreatePod")["status"] == "False" and status["phase"] == "Running", status
        assert not [c for c in k8s.calls if c[0] == "delete_pod"]
        await rec.shutdown()
    run(main())
