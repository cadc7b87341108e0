"""Reconciler.reconcile against an in-memory fake of the narrow K8s facade.

The fake keeps objects the way the API server does where it matters here: resourceVersions
that move on every write, a 409 for a status write based on a stale read, merge-patch nulls,
and a schema that may refuse the monitor's part of the status (422). Pods reach the Reconciler
through its cache, as the watch would deliver them.
"""
from __future__ import annotations

import asyncio
import copy
import datetime as dt

import pytest
from kubernetes.client.rest import ApiException
from prometheus_client import CollectorRegistry

from ddpjob_api import labels
from ddpjob_api.spec import from_manifest
from ddpjob_operator.cluster.cache import PeerGate, Store
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.app import controller
from ddpjob_operator.app.controller import COME_UP_FOLD, Reconciler
from ddpjob_operator.decisions.samples import MonitorReport, RankSample
from ddpjob_operator.app.operator_metrics import OperatorMetrics
from ddpjob_operator.builders.service import render_service
from tests.support.builders import make_manifest

NS = "ns"  # make_manifest's namespace


class FakeK8s:
    """The Reconciler's I/O boundary, in memory; `calls` records every request in order."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.objects: dict[tuple[str, str], dict] = {}   # (kind, name) -> Pod/Service
        self.calls: list[tuple] = []
        self.rv = 100
        self.refuse_progress = 0    # HTTP code for a status write that carries progress (0: accept)
        self.fail_status: list[int] = []   # HTTP codes the next status writes fail with

    def _bump(self, obj: dict) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def add_job(self, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        self._bump(obj)
        self.jobs[obj["metadata"]["name"]] = obj
        return copy.deepcopy(obj)

    def touch(self, name: str, **status) -> dict:
        """Someone else writes the job (a user, another replica)."""
        obj = self.jobs[name]
        obj.setdefault("status", {}).update(status)
        self._bump(obj)
        return copy.deepcopy(obj)

    async def get_job(self, namespace, name):
        self.calls.append(("get_job", name))
        obj = self.jobs.get(name)
        return copy.deepcopy(obj) if obj else None

    async def patch_status(self, namespace, name, patch, *, resource_version=None):
        self.calls.append(("patch_status", name, resource_version))
        if self.fail_status:
            raise ApiException(status=self.fail_status.pop(0), reason="injected")
        obj = self.jobs.get(name)
        if obj is None:
            raise ApiException(status=404, reason="NotFound")
        if resource_version and resource_version != obj["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        if self.refuse_progress and patch.get("progress"):
            raise ApiException(status=self.refuse_progress, reason="Invalid")
        status = obj.setdefault("status", {})
        for key, value in patch.items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = copy.deepcopy(value)
        self._bump(obj)
        return copy.deepcopy(obj)

    async def create(self, obj):
        kind, name = obj["kind"], obj["metadata"]["name"]
        self.calls.append(("create", kind, name))
        if (kind, name) in self.objects:
            return None
        obj = copy.deepcopy(obj)
        obj["metadata"]["uid"] = f"uid-{kind}-{name}-{self.rv}"
        self._bump(obj)
        self.objects[(kind, name)] = obj
        return copy.deepcopy(obj)

    async def get_child(self, kind, namespace, name, *, job, api_version="v1"):
        self.calls.append(("get_child", kind, name))
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj else None

    async def delete_pod(self, namespace, name, *, job, uid=None):
        self.calls.append(("delete_pod", name))
        return self.objects.pop(("Pod", name), None) is not None

    async def delete_job(self, namespace, name):
        self.calls.append(("delete_job", name))
        return self.jobs.pop(name, None) is not None

    async def post_event(self, job, type, reason, message):
        self.calls.append(("event", reason))

    def close(self) -> None:
        pass

    def writes(self) -> list[tuple]:
        return [c for c in self.calls if c[0] != "event"]


def reconciler(k8s: FakeK8s, *, monitor=None, queue: bool = False, **kw) -> Reconciler:
    """A Reconciler on the fake. Without `queue` the test drives the passes: kicks are recorded in
    `rec.kicked`, not run (a new job's pass runs at once, and would race the test's own)."""
    cfg = OperatorConfig(namespaces=(NS,), peering="")
    rec = Reconciler(cfg, k8s, OperatorMetrics(CollectorRegistry()), monitor=monitor, **kw)
    if not queue:
        kicked: list[tuple[str, str]] = []
        rec.kicked = kicked  # type: ignore[attr-defined]
        rec.queue.kick = lambda namespace, name, **_: kicked.append((namespace, name))  # type: ignore[method-assign]
    return rec


def set_phase(rec: Reconciler, k8s: FakeK8s, phase: str, *, name: str | None = None, code: int | None = None):
    """kwok/kubelet moved pods (all, or one) to `phase`; the watch delivers it to the cache."""
    for (kind, pname), pod in k8s.objects.items():
        if kind != "Pod" or (name and pname != name):
            continue
        pod["status"] = {"phase": phase}
        if code is not None:
            pod["status"]["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {"exitCode": code}}}]
        k8s._bump(pod)
        rec.pods.upsert(copy.deepcopy(pod), notify=False)


def run(coro):
    return asyncio.run(coro)


async def until(cond, *, desc: str, timeout: float = 60.0) -> None:
    """Wait for what the background passes do (an event), not for a fixed time a loaded machine can
    overrun: `timeout` only bounds a test whose condition never comes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out after {timeout:g}s waiting for {desc}"
        await asyncio.sleep(0.02)


async def start_running(k8s: FakeK8s, rec: Reconciler, nodes: int = 2, **spec) -> None:
    rec.job_event(k8s.add_job(make_manifest(nodes=nodes, **spec)))
    await rec.reconcile(NS, "j")              # status, then Service and pods
    set_phase(rec, k8s, "Running")
    rec.coalesce = 0.0
    await rec.reconcile(NS, "j")              # -> Running
    assert k8s.jobs["j"]["status"]["phase"] == "Running"
    k8s.calls.clear()


def first_pass(k8s: FakeK8s, rec: Reconciler) -> None:
    """A new two-node job's first pass, then the reconciler's shutdown."""
    async def main():
        rec.job_event(k8s.add_job(make_manifest(nodes=2)))
        await rec.reconcile(NS, "j")
        await rec.shutdown()
    run(main())


async def next_group_pass(k8s: FakeK8s, rec: Reconciler) -> None:
    """The old group's pods vanish from the cache (as their watch reports), then one pass with
    fresh call records (it creates the next group), then shutdown."""
    for pod in list(rec.pods.by_index(NS, "j")):
        rec.pods.delete(pod, notify=False)
    k8s.calls.clear()
    await rec.reconcile(NS, "j")
    await rec.shutdown()


def name_conflict(k8s: FakeK8s) -> str:
    """The FailedCreatePod NameConflict message of a job left Pending by a taken name."""
    status = k8s.jobs["j"]["status"]
    assert status["phase"] == "Pending" and status["reason"] == "FailedCreatePod", status
    cond = next(c for c in status["conditions"] if c["type"] == "FailedCreatePod")
    assert cond["reason"] == "NameConflict", cond
    return cond["message"]


def test_first_pass_stores_status_then_creates_service_and_pods():
    k8s = FakeK8s()
    rec = reconciler(k8s)

    first_pass(k8s, rec)
    assert [c[:2] for c in k8s.writes()] == [("patch_status", "j"), ("create", "Service"),
                                             ("create", "Pod"), ("create", "Pod")]
    # The created pods are in the cache at once: a second pass creates nothing again.
    k8s.calls.clear()

    async def again():
        await rec.reconcile(NS, "j")
    run(again())
    assert not [c for c in k8s.calls if c[0] == "create"]


def test_restart_writes_the_new_attempt_before_deleting_and_keeps_the_service():
    k8s = FakeK8s()
    rec = reconciler(k8s)

    async def main():
        await start_running(k8s, rec)
        set_phase(rec, k8s, "Failed", name="j-1", code=1)
        await rec.reconcile(NS, "j")
        order = [c[0] for c in k8s.writes()]
        assert order[0] == "patch_status" and set(order[1:]) == {"delete_pod"}
        assert k8s.jobs["j"]["status"]["attempt"] == 1
        assert k8s.jobs["j"]["status"]["phase"] == "Restarting"
        # The old pods are gone (as the watch reports): the new attempt's pods, no second Service.
        await next_group_pass(k8s, rec)
    run(main())
    created = [c[1] for c in k8s.calls if c[0] == "create"]
    assert created == ["Pod", "Pod"]


def test_pods_of_a_lost_node_vanish_and_the_new_group_is_created_without_another_event():
    """PodGC marks a lost node's pods Failed + DisruptionTarget and force-deletes them: the watch
    delivers nothing after the DELETED events, so the restart's own pass must lead to the creates."""
    k8s = FakeK8s()
    rec = reconciler(k8s, queue=True)

    async def main():
        await start_running(k8s, rec)
        for (kind, name), pod in list(k8s.objects.items()):
            if kind != "Pod":
                continue
            pod["status"] = {"phase": "Failed", "conditions": [
                {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC",
                 "message": "PodGC: node no longer exists"}]}
            del k8s.objects[(kind, name)]
            rec.pods.delete(copy.deepcopy(pod))   # notify: the controller's DELETED hook runs
        await until(lambda: len([c for c in k8s.calls if c[:2] == ("create", "Pod")]) == 2,
                    desc="the next attempt's two pods")
        await rec.shutdown()
    run(main())
    status = k8s.jobs["j"]["status"]
    assert status["attempt"] == 1 and status["restarts"] == 1 and status["countedRestarts"] == 0, status
    assert status["reason"] == "NodeLost", status
    created = [c[2] for c in k8s.calls if c[:2] == ("create", "Pod")]
    assert sorted(created) == ["j-0-a1", "j-1-a1"], k8s.calls
    assert all(p["metadata"]["annotations"].get(labels.ATTEMPT, p["metadata"]["labels"].get(labels.ATTEMPT)) == "1"
               for (kind, _), p in k8s.objects.items() if kind == "Pod"), k8s.objects


def test_job_at_rest_costs_no_requests():
    k8s = FakeK8s()
    rec = reconciler(k8s)

    async def main():
        await start_running(k8s, rec)
        for _ in range(3):
            await rec.reconcile(NS, "j", scrape=True)
        await rec.shutdown()
    run(main())
    assert k8s.calls == []


def test_stale_write_gets_409_and_is_decided_again_from_the_fresh_object():
    k8s = FakeK8s()
    rec = reconciler(k8s)

    async def main():
        rec.job_event(k8s.add_job(make_manifest(nodes=2)))
        await rec.reconcile(NS, "j")
        set_phase(rec, k8s, "Running")
        # Another writer stored restarts=5 after our cache's copy: our write must not undo it.
        k8s.touch("j", restarts=5)
        rec.coalesce = 0.0
        await rec.reconcile(NS, "j")
        await rec.shutdown()
    run(main())
    status_calls = [c for c in k8s.calls if c[0] in ("patch_status", "get_job")]
    assert [c[0] for c in status_calls[-3:]] == ["patch_status", "get_job", "patch_status"]
    assert status_calls[-1][2] != status_calls[-3][2]  # retried with the fresh resourceVersion
    assert k8s.jobs["j"]["status"]["phase"] == "Running"
    assert k8s.jobs["j"]["status"]["restarts"] == 5


class ProgressMonitor:
    """Returns a progress report the (fake) schema refuses."""

    async def observe(self, job, pods):
        return MonitorReport(progress={"step": 3, "bogus": True}, conditions=[], events=[], stalled=False)

    def forget(self, uid):
        pass


# 422: the schema refused a field; 400: the body itself (e.g. a non-finite number a pod served).
@pytest.mark.parametrize("code", [422, 400])
def test_status_refused_with_the_monitor_report_is_written_without_it(code):
    k8s = FakeK8s()
    rec = reconciler(k8s, monitor=ProgressMonitor())

    async def main():
        await start_running(k8s, rec)
        k8s.refuse_progress = code
        set_phase(rec, k8s, "Failed", name="j-0", code=1)
        await rec.reconcile(NS, "j", scrape=True)
        await rec.shutdown()
    run(main())
    patches = [c for c in k8s.calls if c[0] == "patch_status"]
    assert len(patches) == 2
    status = k8s.jobs["j"]["status"]
    assert status["phase"] == "Restarting" and "progress" not in status
    # The lifecycle went on: the running rank is deleted, the failed one kept for its logs.
    assert ("delete_pod", "j-1") in k8s.calls and ("delete_pod", "j-0") not in k8s.calls


def test_own_status_write_echo_does_not_trigger_a_pass_but_a_foreign_change_does():
    k8s = FakeK8s()
    rec = reconciler(k8s, queue=True)

    async def main():
        rec.job_event(k8s.add_job(make_manifest()))
        await until(lambda: "status" in k8s.jobs["j"] and ("ns", "j") not in rec.queue.workers,
                    desc="the kicked pass's status write, then the pass's end")
        k8s.calls.clear()
        rec.job_event(copy.deepcopy(k8s.jobs["j"]))   # the watch echo of our write
        assert ("ns", "j") not in rec.queue.workers
        rec.job_event(k8s.touch("j", message="edited"))
        assert ("ns", "j") in rec.queue.workers
        await rec.shutdown()
    run(main())


def test_failed_pass_is_retried_with_backoff():
    k8s = FakeK8s()
    rec = reconciler(k8s, queue=True)

    async def main():
        k8s.fail_status = [500]
        rec.job_event(k8s.add_job(make_manifest()))
        await until(lambda: rec.metrics.reconcile_errors._value.get() == 1, desc="the failed pass")
        assert "status" not in k8s.jobs["j"]    # nothing yet: waiting out the backoff
        await until(lambda: "status" in k8s.jobs["j"], desc="the retried pass's status write")
        assert k8s.jobs["j"]["status"]["phase"] == "Pending"
        assert rec.metrics.reconcile_errors._value.get() == 1
        await rec.shutdown()
    run(main())


def test_a_job_coming_up_costs_two_status_writes():
    """The attempt created (before its pods), then all Running: the node counts of each pod that
    is scheduled or starts in between are carried by the second write, never written alone."""
    k8s = FakeK8s()
    rec = reconciler(k8s, queue=True, coalesce=0.05)

    async def main():
        rec.job_event(k8s.add_job(make_manifest(nodes=3)))
        await until(lambda: len([c for c in k8s.objects if c[0] == "Pod"]) == 3, desc="the pods' creation")
        for name in ("j-0", "j-1", "j-2"):       # each pod reaches the cache Pending, then Running
            set_phase(rec, k8s, "Pending", name=name)
            rec.queue.kick(NS, "j")
        for name in ("j-0", "j-1"):
            set_phase(rec, k8s, "Running", name=name)
            rec.queue.kick(NS, "j")
        # Room for the coalescing timer's write, which would be the bug (none is set while pending).
        await asyncio.sleep(20 * rec.coalesce)
        await until(lambda: not rec.queue.workers, desc="the passes")
        assert len([c for c in k8s.calls if c[0] == "patch_status"]) == 1
        assert k8s.jobs["j"]["status"]["nodes"]["running"] == 0     # stale until the next write
        set_phase(rec, k8s, "Running", name="j-2")
        rec.queue.kick(NS, "j")
        await until(lambda: k8s.jobs["j"]["status"]["phase"] == "Running", desc="the Running write")
        await rec.shutdown()
    run(main())
    assert len([c for c in k8s.calls if c[0] == "patch_status"]) == 2
    status = k8s.jobs["j"]["status"]
    assert status["nodes"]["running"] == 3 and status["launchedAttempt"] == 0


def test_a_quiet_come_up_runs_no_pass_until_its_last_pod_starts():
    """A plain job's first attempt: the pods' plain moves (created, scheduled, started) ask for no
    pass until the last one runs, which asks for the Running write at once: two passes, two writes."""
    k8s = FakeK8s()
    rec = reconciler(k8s, queue=True)
    key = (NS, "j")

    async def main():
        rec.job_event(k8s.add_job(make_manifest(nodes=3)))
        await until(lambda: len([c for c in k8s.objects if c[0] == "Pod"]) == 3, desc="the pods' creation")
        await until(lambda: not rec.queue.workers, desc="the first pass")
        for name, phase in (("j-0", "Pending"), ("j-1", "Pending"), ("j-0", "Running"), ("j-1", "Running"),
                            ("j-2", "Pending")):
            moved(rec, k8s, name, phase)
            assert key not in rec.queue.workers and key not in rec.queue.timers, (name, phase)
        moved(rec, k8s, "j-2", "Running")
        assert key in rec.queue.workers                                  # the last one: now
        await until(lambda: k8s.jobs["j"]["status"]["phase"] == "Running", desc="the Running write")
        await until(lambda: not rec.queue.workers, desc="the passes")
        await rec.shutdown()
    run(main())
    assert len([c for c in k8s.calls if c[0] == "patch_status"]) == 2
    assert sum(s.value for s in rec.metrics.reconcile_seconds.collect()[0].samples
               if s.name.endswith("_count")) == 2


def test_a_pod_that_shows_something_ends_the_quiet_come_up():
    """A move that is not plain (a start error, unschedulable) folds into one later pass, as do the
    moves after it; a failure kicks at once, as does any move of a Running job's pods."""
    k8s = FakeK8s()
    rec = reconciler(k8s, queue=True)
    key = (NS, "j")

    async def main():
        rec.job_event(k8s.add_job(make_manifest(nodes=3)))
        await until(lambda: len([c for c in k8s.objects if c[0] == "Pod"]) == 3, desc="the pods' creation")
        await until(lambda: not rec.queue.workers, desc="the first pass")
        assert k8s.jobs["j"]["status"]["phase"] == "Pending"
        moved(rec, k8s, "j-0", "Pending", waiting="ErrImagePull")
        moved(rec, k8s, "j-1", "Running")
        assert key not in rec.queue.workers and key in rec.queue.timers   # one pass, later
        assert rec.queue.timers[key][0] - asyncio.get_running_loop().time() <= COME_UP_FOLD
        moved(rec, k8s, "j-2", "Failed", code=1)
        assert key in rec.queue.workers                                  # a failure: now
        await rec.shutdown()
    run(main())

    # While hundreds of jobs come up, the fold waits longer, as the progress interval does.
    k8s = FakeK8s()
    rec = reconciler(k8s, queue=True)

    async def crowded():
        rec.job_event(k8s.add_job(make_manifest(nodes=3)))
        await until(lambda: len([c for c in k8s.objects if c[0] == "Pod"]) == 3, desc="the pods' creation")
        await until(lambda: not rec.queue.workers, desc="the first pass")
        rec.coming_up = 300
        moved(rec, k8s, "j-0", "Pending", unschedulable=True)
        assert rec.queue.timers[key][0] - asyncio.get_running_loop().time() > 3 * COME_UP_FOLD
        await rec.shutdown()
    run(crowded())

    k8s = FakeK8s()
    rec = reconciler(k8s, queue=True)

    async def running():
        await start_running(k8s, rec, nodes=2)
        await until(lambda: not rec.queue.workers, desc="the passes")
        moved(rec, k8s, "j-0", "Running")
        assert key in rec.queue.workers                                  # a Running job's pod: now
        await rec.shutdown()
    run(running())


def moved(rec: Reconciler, k8s: FakeK8s, name: str, phase: str, code: int | None = None, *,
          waiting: str | None = None, unschedulable: bool = False) -> None:
    """One pod moved (as set_phase) and its watch event reached the reconciler."""
    set_phase(rec, k8s, phase, name=name, code=code)
    pod = rec.pods.get(NS, name)
    if waiting or unschedulable:
        status = k8s.objects[("Pod", name)]["status"]
        if waiting:
            status["containerStatuses"] = [{"name": "trainer", "state": {"waiting": {"reason": waiting}}}]
        if unschedulable:
            status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
        k8s._bump(k8s.objects[("Pod", name)])
        rec.pods.upsert(copy.deepcopy(k8s.objects[("Pod", name)]), notify=False)
        pod = rec.pods.get(NS, name)
    rec._pod_changed("MODIFIED", pod)


def test_pod_count_changes_of_a_running_job_coalesce_into_one_later_write():
    k8s = FakeK8s()
    rec = reconciler(k8s, queue=True, coalesce=0.5)

    async def main():
        await start_running(k8s, rec, nodes=3)
        rec.coalesce = 0.5
        # Pods end one by one (a pass after each); the job runs on (the others still run).
        set_phase(rec, k8s, "Succeeded", name="j-1", code=0)
        await rec.reconcile(NS, "j")
        set_phase(rec, k8s, "Succeeded", name="j-2", code=0)
        await rec.reconcile(NS, "j")
        assert [c for c in k8s.calls if c[0] == "patch_status"] == []
        await until(lambda: any(c[0] == "patch_status" for c in k8s.calls), desc="the coalescing timer's pass")
        await asyncio.sleep(2 * rec.coalesce)   # room for a second write, which would be the bug
        await rec.shutdown()
    run(main())
    assert len([c for c in k8s.calls if c[0] == "patch_status"]) == 1
    assert k8s.jobs["j"]["status"]["nodes"]["succeeded"] == 2


def test_forget_leaves_no_state_behind():
    k8s = FakeK8s()
    rec = reconciler(k8s, queue=True)

    async def main():
        await start_running(k8s, rec, nodes=2)
        rec.queue.kick(NS, "j")
        rec.queue.kick_later(("ns", "j"), 60)
        rec.job_deleted(copy.deepcopy(k8s.jobs["j"]))
        await asyncio.sleep(0.3)
        await rec.shutdown()
    run(main())
    for table in (rec._written_rv, rec._last_write, rec.queue.dirty, rec.queue.workers, rec.queue.timers, rec.children.services):
        assert not table
    assert rec.jobs.get(NS, "j") is None


def test_deleted_job_stops_at_404():
    k8s = FakeK8s()
    rec = reconciler(k8s)

    async def main():
        rec.jobs.upsert(make_manifest("gone"), notify=False)   # the cache still has it; the server does not
        await rec.reconcile(NS, "gone")
        await rec.shutdown()
    run(main())
    assert rec.jobs.get(NS, "gone") is None
    assert not [c for c in k8s.calls if c[0] == "create"]


def test_passes_wait_for_the_pod_cache_to_sync():
    k8s = FakeK8s()
    pods = Store(index_label=labels.JOB_NAME)
    pods.informers = 1   # one informer feeds it and has not listed yet
    rec = reconciler(k8s, queue=True, pods=pods)

    async def main():
        rec.job_event(k8s.add_job(make_manifest()))
        await asyncio.sleep(0.3)
        assert k8s.calls == []          # no pass may decide from an empty, unsynced cache
        pods.mark_synced()
        await until(lambda: k8s.calls, desc="the pass that waited for the cache")
        await rec.shutdown()
    run(main())
    assert k8s.calls[0][0] == "patch_status"


def _peer(priority: int, *, seconds_ago: float, lifetime: int = 60) -> dict:
    seen = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds_ago)
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}


# (priority, seconds ago) per peer: the timestamps are made when the test runs, not at collection,
# or a long session ages the "live" peer past its lifetime before the test gets to it.
@pytest.mark.parametrize("peer_specs, acts", [
    ({"other": (10, 1)}, False),
    ({"low": (1, 1), "dead": (10, 3600)}, True),
    ({"me": (10, 1)}, True),
])
def test_peer_gate_from_the_cached_peering_object(peer_specs, acts):
    peers = {name: _peer(prio, seconds_ago=ago) for name, (prio, ago) in peer_specs.items()}
    k8s = FakeK8s()
    store = Store()
    store.upsert({"metadata": {"name": "ddpjob", "namespace": NS, "resourceVersion": "1"}, "status": peers})
    rec = reconciler(k8s, queue=True, gate=PeerGate(store, identity="me", priority=5))

    async def main():
        rec.job_event(k8s.add_job(make_manifest()))
        await asyncio.sleep(0.3)
        if not acts:
            assert k8s.calls == []
            # The peer leaves (kopf removes its entry): the held-back pass runs at once.
            store.upsert({"metadata": {"name": "ddpjob", "namespace": NS, "resourceVersion": "2"},
                          "status": {}})
        await until(lambda: k8s.calls, desc="the pass the gate let through")
        await rec.shutdown()
    run(main())
    assert [c for c in k8s.calls if c[0] == "get_peering"] == []
    assert k8s.calls and k8s.calls[0][0] == "patch_status"


class SilentMonitor:
    """Running pods whose metrics endpoints never answer (e.g. the user's own command serves none)."""

    def __init__(self):
        self.answer = False
        self.observed = 0

    async def observe(self, job, pods):
        self.observed += 1
        return MonitorReport(progress={"step": 1} if self.answer else None, conditions=[], events=[], stalled=False,
                             unreachable=not self.answer)

    def forget(self, uid):
        pass


def test_jobs_whose_metrics_never_answer_are_scraped_less_often_but_never_given_up():
    k8s = FakeK8s()
    mon = SilentMonitor()
    rec = reconciler(k8s, monitor=mon)
    key = (NS, "j")

    async def main():
        await start_running(k8s, rec)
        periods = []
        for _ in range(4):
            assert not await rec.scrape(NS, "j")
            periods.append(rec._scrape_every[key])
        assert periods == [2, 4, 8, 8]      # every 8th interval from now on, not never
        pod = rec.pods.by_index(NS, "j")[0]
        rec._pod_changed("MODIFIED", pod)   # a pod change (a restart) scrapes at the full rate again
        assert key not in rec._scrape_every
        assert not await rec.scrape(NS, "j") and rec._scrape_every[key] == 2
        mon.answer = True                   # a slow start finally serves its first sample, no pod event
        assert await rec.scrape(NS, "j")    # the first progress is worth a pass
        assert key not in rec._scrape_every
        await rec.reconcile(NS, "j")
        await rec.shutdown()
    run(main())
    assert k8s.jobs["j"]["status"]["progress"]["step"] == 1


def test_a_scrape_round_takes_no_more_jobs_at_a_time_than_its_slots():
    """Thousands of jobs' scrapes begun together queued a task per pod, and the last ran past
    their timeout (1,917 of them while 50,000 pods were created); a round starts a job's scrape
    only when one of its slots is free, and ends when all have."""
    rec = reconciler(FakeK8s(), monitor=SilentMonitor())
    started: list[tuple[str, str]] = []
    finished: list[tuple[str, str]] = []

    async def main():
        gate = asyncio.Event()

        async def held(key):
            started.append(key)
            await gate.wait()
            finished.append(key)
        rec._scrape_and_kick = held  # type: ignore[method-assign]
        await rec.scrape_round([])                  # nothing running: an empty round
        many = [(NS, f"k{i}") for i in range(controller.SCRAPES_IN_FLIGHT + 3)]
        round_ = asyncio.ensure_future(rec.scrape_round(many))
        for _ in range(100):                        # the loop runs whatever can run meanwhile
            await asyncio.sleep(0)
        assert started == many[:controller.SCRAPES_IN_FLIGHT] and not round_.done()
        gate.set()
        await round_
        assert sorted(finished) == sorted(many)     # the round waited for every scrape it started
    run(main())


class SteppingMonitor:
    """Ranks that step on every scrape."""

    def __init__(self):
        self.step = 0

    async def observe(self, job, pods):
        self.step += 1
        return MonitorReport(progress={"step": self.step}, conditions=[], events=[], stalled=False,
                             ranks={0: RankSample(rank=0, step=self.step)})

    def forget(self, uid):
        pass


def test_progress_is_written_once_per_progress_interval_not_per_scrape():
    k8s = FakeK8s()
    mon = SteppingMonitor()
    rec = reconciler(k8s, monitor=mon)
    key = (NS, "j")

    async def main():
        await start_running(k8s, rec)
        assert await rec.scrape(NS, "j")          # the first progress: a pass, written at once
        await rec.reconcile(NS, "j")
        for _ in range(3):                        # the next scrapes, within the interval: no pass
            assert not await rec.scrape(NS, "j")
        await rec.reconcile(NS, "j")              # a pass for another reason writes no progress
        assert len([c for c in k8s.calls if c[0] == "patch_status"]) == 1
        assert (rec.progress_interval, k8s.jobs["j"]["status"]["progress"]["step"]) == (30.0, 1)
        rec._last_write[key] -= rec.progress_interval   # the interval has passed since that write
        assert await rec.scrape(NS, "j")
        await rec.reconcile(NS, "j")
        await rec.shutdown()
    run(main())
    assert len([c for c in k8s.calls if c[0] == "patch_status"]) == 2
    assert k8s.jobs["j"]["status"]["progress"]["step"] == mon.step == 5


def test_progress_waits_longer_while_hundreds_of_jobs_come_up():
    """A burst of jobs coming up stretches a running job's progress interval (decisions/writes:
    each PROGRESS_YIELD_JOBS add one); once they are up, the configured interval is back."""
    k8s = FakeK8s()
    mon = SteppingMonitor()
    rec = reconciler(k8s, monitor=mon)
    key = (NS, "j")
    others = [{"metadata": {"namespace": NS, "name": f"o{i}", "uid": f"u{i}"},
               **({"status": {"phase": "Pending", "attempt": 0}} if i % 2 else {})} for i in range(150)]

    async def main():
        await start_running(k8s, rec)
        for obj in others:                                # 150 jobs submitted, half with a status yet
            rec.jobs.upsert(obj, notify=False)
        assert rec.tally() == [key] and rec.coming_up == 150
        assert rec.progress_interval_now() == 2.5 * rec.progress_interval
        assert await rec.scrape(NS, "j")                  # the first progress: still at once
        await rec.reconcile(NS, "j")
        rec._last_write[key] -= 2 * rec.progress_interval  # past the configured interval, not the stretched one
        assert not await rec.scrape(NS, "j")
        rec._last_write[key] -= 0.5 * rec.progress_interval
        assert await rec.scrape(NS, "j")
        await rec.reconcile(NS, "j")
        for obj in others:                                # they are up
            rec.jobs.upsert({**obj, "status": {"phase": "Running", "attempt": 0}}, notify=False)
        assert sorted(rec.tally()) == sorted([key] + [(NS, o["metadata"]["name"]) for o in others])
        assert rec.coming_up == 0
        rec._last_write[key] -= rec.progress_interval
        assert await rec.scrape(NS, "j")
        await rec.reconcile(NS, "j")
        await rec.shutdown()
    run(main())
    assert len([c for c in k8s.calls if c[0] == "patch_status"]) == 3


def test_finished_job_is_not_scraped_and_leaves_no_scrape_state():
    k8s = FakeK8s()
    mon = SteppingMonitor()
    rec = reconciler(k8s, monitor=mon)
    key = (NS, "j")

    async def main():
        await start_running(k8s, rec)
        assert await rec.scrape(NS, "j")
        assert rec.metrics.registry.get_sample_value("ddpjob_operator_job_step", {"namespace": NS, "ddpjob": "j"}) == 1
        set_phase(rec, k8s, "Succeeded", code=0)
        await rec.reconcile(NS, "j")
        assert k8s.jobs["j"]["status"]["phase"] == "Succeeded"
        k8s.calls.clear()
        observed = mon.step
        assert not await rec.scrape(NS, "j")
        await rec.reconcile(NS, "j")
        await rec.shutdown()
        return observed
    observed = run(main())
    assert mon.step == observed and k8s.calls == []
    # The last scrape's progress went out with the transition.
    assert k8s.jobs["j"]["status"]["progress"]["step"] == observed
    assert key not in rec._reports and key not in rec._scrape_every
    assert rec.metrics.registry.get_sample_value("ddpjob_operator_job_step", {"namespace": NS, "ddpjob": "j"}) is None


def test_service_deleted_while_running_is_created_again_on_the_restart_pass():
    k8s = FakeK8s()
    rec = reconciler(k8s)

    async def main():
        await start_running(k8s, rec)
        del k8s.objects[("Service", "j")]        # someone deleted the headless Service
        set_phase(rec, k8s, "Failed", name="j-1", code=1)
        await rec.reconcile(NS, "j")
        await next_group_pass(k8s, rec)
    run(main())
    assert ("Service", "j") in k8s.objects, k8s.calls
    assert sorted(c[1] for c in k8s.calls if c[0] == "create") == ["Pod", "Pod", "Service"]


def test_pod_name_taken_by_an_object_the_job_does_not_own_is_named_in_the_status():
    k8s = FakeK8s()
    k8s.objects[("Pod", "j-0")] = {"kind": "Pod", "metadata": {"name": "j-0", "namespace": NS, "uid": "foreign"}}
    rec = reconciler(k8s)

    first_pass(k8s, rec)
    assert "pod j-0 exists and is not owned by this DDPJob" in name_conflict(k8s)
    assert ("event", "FailedCreatePod") in k8s.calls


@pytest.mark.parametrize("owned, cluster_ip, message", [
    (False, "None", "service j exists and is not owned by this DDPJob"),
    (False, "10.96.0.7", "service j exists and is not owned by this DDPJob"),
    (True, "10.96.0.7", "service j is not headless (clusterIP 10.96.0.7)"),
])
def test_service_name_taken_by_another_service_is_named_and_no_pod_is_created(owned, cluster_ip, message):
    k8s = FakeK8s()
    rec = reconciler(k8s)

    async def main():
        job = k8s.add_job(make_manifest(nodes=2))
        owners = [{"uid": job["metadata"]["uid"]}] if owned else []
        k8s.objects[("Service", "j")] = {"kind": "Service", "metadata": {"name": "j", "namespace": NS,
                                         "ownerReferences": owners}, "spec": {"clusterIP": cluster_ip}}
        rec.job_event(job)
        await rec.reconcile(NS, "j")
        await rec.shutdown()
    run(main())
    got = name_conflict(k8s)
    assert message in got and "create service(s) j" in got
    # Pods would rendezvous at a MASTER_ADDR that does not resolve: none is made until it is fixed.
    assert not [c for c in k8s.calls if c[:2] == ("create", "Pod")]


def test_a_foreign_service_deleted_between_our_post_and_its_read_back_is_posted_again():
    # Its 409 answered our POST, then its owner deleted it before our read: ours is made before any
    # pod (pods made without it would rendezvous at a MASTER_ADDR that never resolves).
    class Vanishing(FakeK8s):
        async def get_child(self, kind, namespace, name, *, job, api_version="v1"):
            if kind == "Service":
                self.objects.pop(("Service", name), None)   # deleted just now
            return await super().get_child(kind, namespace, name, job=job, api_version=api_version)

    k8s = Vanishing()
    k8s.objects[("Service", "j")] = {"kind": "Service", "metadata": {"name": "j", "namespace": NS, "uid": "x"},
                                     "spec": {"clusterIP": "10.0.0.1"}}
    rec = reconciler(k8s)
    first_pass(k8s, rec)
    assert [c[:2] for c in k8s.calls if c[0] in ("create", "get_child")] == [
        ("create", "Service"), ("get_child", "Service"), ("create", "Service"), ("create", "Pod"), ("create", "Pod")]
    assert k8s.objects[("Service", "j")]["spec"]["clusterIP"] == "None"


def test_our_own_headless_service_found_by_a_409_is_used():
    # An operator restart: the Service exists and is this job's; pods are created as usual.
    k8s = FakeK8s()
    rec = reconciler(k8s)

    async def main():
        job = k8s.add_job(make_manifest(nodes=2))
        svc = render_service(from_manifest(job))
        k8s.objects[("Service", "j")] = svc
        rec.job_event(job)
        await rec.reconcile(NS, "j")
        await rec.shutdown()
    run(main())
    assert len([c for c in k8s.calls if c[:2] == ("create", "Pod")]) == 2
    assert k8s.jobs["j"]["status"].get("reason") != "FailedCreatePod"


@pytest.mark.parametrize("created, cap, want", [
    (0, 64, 1),      # the first create alone: a refused template costs one request
    (1, 64, 2),
    (3, 64, 4),      # one more per success: 1, 2, 4, 8, ... per round trip
    (7, 64, 8),
    (63, 64, 64),
    (500, 64, 64),
    (5, 1, 1),       # DDPJOB_DEBUG_CREATE_DELAY: one pod at a time
])
def test_slow_start_opens_one_more_create_per_success_up_to_the_cap(created, cap, want):
    from ddpjob_operator.app.children import slow_start

    assert slow_start(created, cap=cap) == want


class SlottedK8s(FakeK8s):
    """Creates take a turn in the facade's real FairSlots, as cluster/k8s's do, and hold it across
    two loop turns; `order` records which job's create got a slot, `waited` how many others got one
    while it waited for its own, `peak` each job's most in flight."""

    def __init__(self, slots: int) -> None:
        super().__init__()
        from ddpjob_operator.cluster.fairqueue import FairSlots

        self.slots = FairSlots(slots)
        self.order: list[str] = []
        self.waited: dict[str, list[int]] = {}
        self.busy: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.starts: dict[str, list[tuple[int, int]]] = {}   # (in flight, creates done) as each starts
        self.refuse_pods = False    # every pod create answers 422

    async def create(self, obj):
        job = obj["metadata"]["labels"].get(labels.JOB_NAME) or obj["metadata"]["name"]
        asked = len(self.order)
        async with self.slots.slot(job):
            self.waited.setdefault(job, []).append(len(self.order) - asked)
            self.order.append(job)
            self.busy[job] = self.busy.get(job, 0) + 1
            self.peak[job] = max(self.peak.get(job, 0), self.busy[job])
            self.starts.setdefault(job, []).append((self.busy[job], self.finished.get(job, 0)))
            try:
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                if self.refuse_pods and obj["kind"] == "Pod":
                    self.calls.append(("create", "Pod", obj["metadata"]["name"]))
                    raise ApiException(status=422, reason="Invalid")
                return await super().create(obj)
            finally:
                self.busy[job] -= 1
                self.finished[job] = self.finished.get(job, 0) + 1


def test_pods_are_rendered_when_their_create_may_go_out_at_most_in_flight_waiting(monkeypatch):
    """Many jobs created at once through few request slots: a pod is rendered only when it takes a
    render slot (children.Children._renders), so rendered pods that wait for a request slot never
    number more than IN_FLIGHT (rendered up front, each job's window of pods waited rendered)."""
    from ddpjob_operator.app import children
    from ddpjob_operator.cluster.k8s import IN_FLIGHT

    k8s = SlottedK8s(slots=2)
    rec = reconciler(k8s, queue=True)
    waiting, peak = [0], [0]
    render = children.render_pod

    def counted(*args, **kwargs):
        waiting[0] += 1
        peak[0] = max(peak[0], waiting[0])
        return render(*args, **kwargs)
    monkeypatch.setattr(children, "render_pod", counted)
    create = k8s.create

    async def sent(obj):
        if obj["kind"] == "Pod":
            async with k8s.slots.slot("sent"):   # counted once its request holds a slot
                pass
            waiting[0] -= 1
        return await create(obj)
    k8s.create = sent  # type: ignore[method-assign]
    jobs, nodes = 2 * IN_FLIGHT, 4

    async def main():
        for j in range(jobs):
            rec.job_event(k8s.add_job(make_manifest(f"j{j}", nodes=nodes)))
        await until(lambda: all(len(created(k8s, f"j{j}")) == nodes for j in range(jobs)), desc="every job's pods")
        await rec.shutdown()
    run(main())
    assert 0 < peak[0] <= IN_FLIGHT, peak[0]


def create_big_and_small(slots: int) -> SlottedK8s:
    """A big job's group created through `slots` request slots; a small job arrives as the big
    one's IN_FLIGHT-th pod create starts."""
    from ddpjob_operator.cluster.k8s import IN_FLIGHT

    k8s = SlottedK8s(slots=slots)
    rec = reconciler(k8s, queue=True)
    big = 2 * IN_FLIGHT + 5
    calls = []
    create_pods = rec.children.create_pods

    async def record(job, pods):
        calls.append(job.name)
        if calls.count("big") == IN_FLIGHT and job.name == "big":
            rec.job_event(k8s.add_job(make_manifest("s", nodes=2)))
        return await create_pods(job, pods)
    rec.children.create_pods = record  # type: ignore[method-assign]

    async def main():
        rec.job_event(k8s.add_job(make_manifest("big", nodes=big)))
        await until(lambda: len(created(k8s, "big")) == big and len(created(k8s, "s")) == 2, desc="both jobs' pods")
        await rec.shutdown()
    run(main())
    assert len(set(c[2] for c in k8s.calls if c[:2] == ("create", "Pod"))) == big + 2  # nothing twice
    return k8s


def created(k8s: FakeK8s, job: str) -> list[int]:
    """Indexes in the call record of this job's pod creates."""
    return [i for i, c in enumerate(k8s.calls) if c[:2] == ("create", "Pod") and c[2].startswith(f"{job}-")]


def test_a_large_group_is_created_in_one_pass_with_slow_start_and_one_status_write():
    from ddpjob_operator.app.children import slow_start
    from ddpjob_operator.cluster.k8s import IN_FLIGHT

    k8s = create_big_and_small(IN_FLIGHT)
    starts = k8s.starts["big"][1:]   # after the Service's create
    # The first pod create alone, then never more in flight than one more per create done, up to
    # IN_FLIGHT, which the group reaches ...
    assert starts[0] == (1, 1) and starts[1][0] == 1, starts[:3]
    assert all(busy <= slow_start(done - 1) for busy, done in starts), starts
    assert k8s.peak["big"] == IN_FLIGHT
    # ... in one pass, after one status write (the attempt, before any pod) and none in between.
    writes = [i for i, c in enumerate(k8s.calls) if c[:2] == ("patch_status", "big")]
    assert len(writes) == 1 and writes[0] < min(created(k8s, "big"))
    # The Service is read back once per attempt, not once per batch.
    assert not [c for c in k8s.calls if c[:2] == ("get_child", "Service")]


def test_another_job_is_not_queued_behind_a_large_groups_creates():
    # Fewer slots than the big job has creates in flight: the small job, arriving meanwhile, gets
    # its Service and pods made in turn with the big job's requests (FairSlots), not behind them.
    from ddpjob_operator.cluster.k8s import IN_FLIGHT

    slots = 8
    k8s = create_big_and_small(slots)
    assert k8s.peak["big"] == slots
    # Each of its requests (the Service's create, two pods') saw at most the slots already handed
    # out when it asked and one more of the big job's get a slot first, while many of those queued.
    assert len(k8s.waited["s"]) == 3 and max(k8s.waited["s"]) <= slots + 1, k8s.waited["s"]
    assert max(k8s.waited["big"]) > IN_FLIGHT // 2
    assert max(created(k8s, "s")) < max(created(k8s, "big"))


def test_a_refused_template_costs_one_pod_create():
    # The first batch is one pod: a template the API server refuses fails the job after one request.
    k8s = SlottedK8s(slots=4)
    k8s.refuse_pods = True
    rec = reconciler(k8s)

    async def main():
        rec.job_event(k8s.add_job(make_manifest(nodes=16)))
        await rec.reconcile(NS, "j")
        await rec.shutdown()
    run(main())
    assert [c for c in k8s.calls if c[:2] == ("create", "Pod")] == [("create", "Pod", "j-0")]
    status = k8s.jobs["j"]["status"]
    assert status["phase"] == "Failed" and status["reason"] == "FailedCreatePod", status


def suspend(k8s: FakeK8s, rec: Reconciler, name: str) -> None:
    """The user sets spec.suspend (a new generation); the watch brings it."""
    obj = k8s.jobs[name]
    obj["spec"]["suspend"] = True
    obj["metadata"]["generation"] += 1
    k8s._bump(obj)
    rec.job_event(copy.deepcopy(obj))


@pytest.mark.parametrize("change", [
    lambda k8s, rec, name: rec.job_deleted(k8s.jobs.pop(name)),
    suspend,
], ids=["deleted", "edited"])
def test_a_job_deleted_or_edited_mid_creation_stops_its_creation(change):
    k8s = SlottedK8s(slots=4)
    rec = reconciler(k8s)
    create_pods = rec.children.create_pods

    async def record(job, pods):
        made = await create_pods(job, pods)
        change(k8s, rec, job.name)   # as the first create (alone in flight) is done
        return made
    rec.children.create_pods = record  # type: ignore[method-assign]

    async def main():
        rec.job_event(k8s.add_job(make_manifest(nodes=16)))
        await rec.reconcile(NS, "j")
        await rec.shutdown()
    run(main())
    assert len([c for c in k8s.calls if c[:2] == ("create", "Pod")]) == 1   # no more after the change
