"""Gang scheduling (spec.scheduling.gang): the PodGroup, the pods that point at it, the
GangScheduled condition, and the reconcile pass that creates the group before its pods."""
from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException

from ddpjob_api.validation import validate_manifest
from ddpjob_operator.base.group import Group
from ddpjob_operator.builders import gang
from ddpjob_operator.builders.pods import render_pod
from ddpjob_operator.builders.render import render_objects
from tests.support.builders import NOW, make_job, make_manifest, make_pod
from tests.support.passes import pass_status
from tests.unit.test_reconcile import (NS, FakeK8s, name_conflict, next_group_pass, reconciler, run, set_phase,
                                      start_running)

COSCHED = {"gang": {"scheduler": "coscheduling"}}
VOLCANO = {"gang": {"scheduler": "volcano"}}


def podgroup(**spec):
    job = make_job(**spec)
    return gang.render_podgroup(job, render_pod(job, 0))


# -- the PodGroup ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec, api_version, want", [
    (dict(nodes=3, gpusPerNode=8, scheduling=COSCHED), "scheduling.x-k8s.io/v1alpha1",
     {"minMember": 3, "minResources": {"nvidia.com/gpu": "24"}}),
    (dict(nodes=2, gpusPerNode=8, resources={"requests": {"cpu": "1500m", "memory": "16Gi"}},
          scheduling={"gang": {"scheduler": "coscheduling", "scheduleTimeoutSeconds": 60}}),
     "scheduling.x-k8s.io/v1alpha1",
     {"minMember": 2, "minResources": {"cpu": "3", "memory": "32Gi", "nvidia.com/gpu": "16"},
      "scheduleTimeoutSeconds": 60}),
    # An elastic job starts with its minimum: that many pods form the gang.
    (dict(nodes=4, gpusPerNode=1, elastic={"minNodes": 2, "maxNodes": 4}, scheduling=COSCHED),
     "scheduling.x-k8s.io/v1alpha1", {"minMember": 2, "minResources": {"nvidia.com/gpu": "2"}}),
    (dict(nodes=2, gpusPerNode=0, resources={"limits": {"cpu": "250m"}},
          scheduling={"priorityClassName": "high", "gang": {"scheduler": "volcano", "queue": "research"}}),
     "scheduling.volcano.sh/v1beta1",
     {"minMember": 2, "minResources": {"cpu": "500m"}, "queue": "research", "priorityClassName": "high"}),
])
def test_podgroup_asks_for_the_whole_gang(spec, api_version, want):
    pg = podgroup(**spec)
    assert pg["apiVersion"] == api_version and pg["kind"] == "PodGroup"
    assert pg["spec"] == want
    meta = pg["metadata"]
    assert (meta["name"], meta["namespace"]) == ("j", "ns")
    # Owned by the job: garbage collection removes it with the job, and a foreign one is told apart.
    assert meta["ownerReferences"][0]["uid"] == "uid-j" and meta["ownerReferences"][0]["controller"]


def test_no_gang_no_podgroup_and_pods_as_before():
    job = make_job(nodes=2, gpusPerNode=8)
    pod = render_pod(job, 0)
    assert gang.render_podgroup(job, pod) is None
    assert "schedulerName" not in pod["spec"]
    assert not [k for k in pod["metadata"]["labels"] if k.startswith("scheduling.")]
    assert not [k for k in pod["metadata"]["annotations"] if k.startswith("scheduling.")]


def test_requests_of_init_containers_and_sidecars():
    # The scheduler reserves max(sum of containers + native sidecars, largest plain init container).
    spec = {"containers": [{"resources": {"requests": {"cpu": "1"}}}, {"resources": {"limits": {"cpu": "2"}}}],
            "initContainers": [{"resources": {"requests": {"cpu": "5", "memory": "1Gi"}}},
                               {"restartPolicy": "Always", "resources": {"requests": {"cpu": "500m"}}}]}
    got = gang.pod_requests(spec)
    assert {k: str(v) for k, v in got.items()} == {"cpu": "5", "memory": str(1 << 30)}
    spec["initContainers"][0]["resources"]["requests"]["cpu"] = "3"
    assert float(gang.pod_requests(spec)["cpu"]) == 3.5


# -- the pods --------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduling, scheduler, label, annotation", [
    (COSCHED, "scheduler-plugins-scheduler", "scheduling.x-k8s.io/pod-group", None),
    (VOLCANO, "volcano", None, "scheduling.k8s.io/group-name"),
    # Coscheduling may run under another profile name (or inside the default scheduler).
    ({**COSCHED, "schedulerName": "my-gang-scheduler"}, "my-gang-scheduler", "scheduling.x-k8s.io/pod-group", None),
])
def test_every_pod_points_at_the_group(scheduling, scheduler, label, annotation):
    job = make_job(nodes=3, scheduling=scheduling, podLabels={"scheduling.x-k8s.io/pod-group": "other"})
    for rank in range(3):
        pod = render_pod(job, rank)
        assert pod["spec"]["schedulerName"] == scheduler
        if label:  # the operator's group wins over a podLabel of the same key
            assert pod["metadata"]["labels"][label] == "j"
        if annotation:
            assert pod["metadata"]["annotations"][annotation] == "j"


def test_template_scheduler_name_wins_over_the_gang_default():
    job = make_job(scheduling=COSCHED, template={"spec": {"schedulerName": "tpl-sched"}})
    assert render_pod(job, 0)["spec"]["schedulerName"] == "tpl-sched"


def test_render_prints_the_podgroup_between_service_and_pods():
    objs = render_objects(make_manifest(stored=False, nodes=2, gpusPerNode=8, scheduling=COSCHED))
    assert [o["kind"] for o in objs] == ["Service", "PodGroup", "Pod", "Pod"]
    assert "ownerReferences" not in objs[1]["metadata"]  # no uid before the job exists


# -- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize("gang_spec, problem", [
    ({"scheduler": "kube-batch"}, "spec.scheduling.gang.scheduler"),
    ({}, "scheduler: required field is missing"),
    ({"scheduler": "volcano", "scheduleTimeoutSeconds": 30}, "scheduleTimeoutSeconds applies to scheduler coscheduling only"),
    ({"scheduler": "coscheduling", "queue": "q"}, "queue applies to scheduler volcano only"),
    ({"scheduler": "coscheduling", "scheduleTimeoutSeconds": 0}, "scheduleTimeoutSeconds"),
    ({"scheduler": "coscheduling", "minMember": 2}, "spec.scheduling.gang.minMember: unknown field"),
])
def test_bad_gang_specs_are_refused_by_name(gang_spec, problem):
    errs = validate_manifest(make_manifest(stored=False, scheduling={"gang": gang_spec}))
    assert any(problem in e for e in errs), errs


def test_good_gang_specs_pass():
    for g in ({"scheduler": "coscheduling", "scheduleTimeoutSeconds": 30}, {"scheduler": "volcano", "queue": "q"}):
        assert validate_manifest(make_manifest(stored=False, scheduling={"gang": g})) == []


# -- the GangScheduled condition -------------------------------------------------------------
def bound(pod, node="n1"):
    pod["spec"] = {"nodeName": node, "schedulerName": "scheduler-plugins-scheduler"}
    return pod


def waiting(pod, message="pod group j: waiting for 2 more pods"):
    pod["spec"] = {"schedulerName": "scheduler-plugins-scheduler"}
    pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                    "message": message}]
    return pod


def gang_condition(status):
    return next((c for c in status["conditions"] if c["type"] == "GangScheduled"), None)


def test_gang_waiting_then_placed():
    job = make_job(nodes=3, gpusPerNode=8, scheduling=COSCHED)
    pods = [bound(make_pod(0, phase="Pending")), waiting(make_pod(1, phase="Pending")),
            waiting(make_pod(2, phase="Pending"))]
    pg = {"status": {"phase": "Scheduling"}}
    status, events = pass_status(job, Group.of(pods), now=NOW, prev_status={}, podgroup=pg)
    cond = gang_condition(status)
    assert cond["status"] == "False" and cond["reason"] == "Scheduling"
    for part in ("waiting for scheduler-plugins-scheduler to place 3 pods at once (1 bound)",
                 "PodGroup j (scheduling.x-k8s.io, minMember 3)", "waiting for 2 more pods"):
        assert part in cond["message"]
    assert not [e for e in events if e[1] == "GangScheduled"]

    placed = [bound(make_pod(r, phase="Pending"), f"n{r}") for r in range(3)]
    status2, events2 = pass_status(job, Group.of(placed), now=NOW, prev_status=status)
    cond = gang_condition(status2)
    assert cond["status"] == "True" and cond["reason"] == "Scheduled"
    assert "3/3 pods placed together by scheduler-plugins-scheduler" in cond["message"]
    assert [e[1] for e in events2].count("GangScheduled") == 1
    # Said once: the next pass has nothing new to say.
    _, events3 = pass_status(job, Group.of(placed), now=NOW, prev_status=status2)
    assert not [e for e in events3 if e[1] == "GangScheduled"]


def test_no_condition_without_gang_and_none_changed_once_finished():
    plain = make_job(nodes=1)
    status, _ = pass_status(plain, Group.of([make_pod(0, phase="Pending")]), now=NOW, prev_status={})
    assert gang_condition(status) is None
    job = make_job(nodes=1, scheduling=COSCHED)
    done = make_pod(0, phase="Succeeded", exit_code=0)
    prev = {"phase": "Running", "attempt": 0, "conditions": [{"type": "GangScheduled", "status": "True",
                                                              "reason": "Scheduled", "message": "m"}]}
    status, _ = pass_status(job, Group.of([done]), now=NOW, prev_status=prev)
    assert status["phase"] == "Succeeded" and gang_condition(status)["status"] == "True"


# -- the reconcile pass ----------------------------------------------------------------------
class GangK8s(FakeK8s):
    """FakeK8s where some API groups are not served (their CRD is not installed)."""

    def __init__(self, unserved=()):
        super().__init__()
        self.unserved = set(unserved)

    async def create(self, obj):
        if obj["apiVersion"] in self.unserved:
            self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
            body = json.dumps({"kind": "Status", "reason": "NotFound", "code": 404,
                               "message": "the server could not find the requested resource"})
            raise _not_found(body)
        return await super().create(obj)


def _not_found(body):
    exc = ApiException(status=404, reason="Not Found")
    exc.body = body
    return exc


def gang_pass(k8s, rec, **spec):
    async def main():
        rec.job_event(k8s.add_job(make_manifest(nodes=2, gpusPerNode=8, **spec)))
        await rec.reconcile(NS, "j")
        await rec.shutdown()
    run(main())


def test_podgroup_is_created_before_the_pods():
    k8s = GangK8s()
    rec = reconciler(k8s)
    gang_pass(k8s, rec, scheduling=COSCHED)
    assert [c[:2] for c in k8s.writes()] == [("patch_status", "j"), ("create", "Service"), ("create", "PodGroup"),
                                             ("create", "Pod"), ("create", "Pod")]
    pg = k8s.objects[("PodGroup", "j")]
    assert pg["spec"]["minMember"] == 2 and pg["metadata"]["ownerReferences"][0]["uid"] == "uid-j"


def test_unserved_podgroup_api_keeps_the_job_pending_with_the_reason():
    k8s = GangK8s(unserved={"scheduling.volcano.sh/v1beta1"})
    rec = reconciler(k8s)
    gang_pass(k8s, rec, scheduling=VOLCANO)
    status = k8s.jobs["j"]["status"]
    assert status["phase"] == "Pending" and status["reason"] == "FailedCreatePod", status
    cond = next(c for c in status["conditions"] if c["type"] == "FailedCreatePod")
    assert "podgroup(s) j" in cond["message"]
    assert "does not serve scheduling.volcano.sh/v1beta1 PodGroups" in cond["message"]
    assert not [c for c in k8s.calls if c[:2] == ("create", "Pod")]


def test_podgroup_of_someone_else_is_named_and_no_pod_is_created():
    k8s = GangK8s()
    k8s.objects[("PodGroup", "j")] = {"kind": "PodGroup", "metadata": {"name": "j", "namespace": NS, "uid": "x"}}
    rec = reconciler(k8s)
    gang_pass(k8s, rec, scheduling=COSCHED)
    assert "podgroup j exists and is not owned by this DDPJob" in name_conflict(k8s)
    assert not [c for c in k8s.calls if c[:2] == ("create", "Pod")]


def test_deleted_podgroup_is_created_again_for_the_next_attempt():
    k8s = GangK8s()
    rec = reconciler(k8s)

    async def main():
        await start_running(k8s, rec, scheduling=COSCHED)
        del k8s.objects[("PodGroup", "j")]       # someone deleted it
        set_phase(rec, k8s, "Failed", name="j-1", code=1)
        await rec.reconcile(NS, "j")
        await next_group_pass(k8s, rec)
    run(main())
    assert ("PodGroup", "j") in k8s.objects
    assert sorted(c[1] for c in k8s.calls if c[0] == "create") == ["Pod", "Pod", "PodGroup"]


def test_podgroup_is_read_only_while_a_pod_waits_for_a_node():
    k8s = GangK8s()
    rec = reconciler(k8s)

    async def main():
        rec.job_event(k8s.add_job(make_manifest(nodes=2, scheduling=COSCHED)))
        await rec.reconcile(NS, "j")
        k8s.calls.clear()
        await rec.reconcile(NS, "j")                      # pods unbound: the group is read
        assert ("get_child", "PodGroup", "j") in k8s.calls
        for (kind, _), pod in k8s.objects.items():
            if kind == "Pod":
                pod.setdefault("spec", {})["nodeName"] = "n"
                k8s._bump(pod)
                rec.pods.upsert(dict(pod), notify=False)
        k8s.calls.clear()
        await rec.reconcile(NS, "j")                      # all bound: nothing to ask
        assert not [c for c in k8s.calls if c[:2] == ("get_child", "PodGroup")]
        await rec.shutdown()
    run(main())
    cond = gang_condition(k8s.jobs["j"]["status"])
    assert cond["status"] == "True", k8s.jobs["j"]["status"]["conditions"]


@pytest.mark.parametrize("resources, nodes, want", [
    ({"limits": {"nvidia.com/gpu": "8"}}, 128, {"nvidia.com/gpu": "1024"}),      # a count, not 1Ki
    ({"requests": {"cpu": "8"}}, 128, {"cpu": "1024"}),
    ({"requests": {"memory": "1G"}}, 2, {"memory": "2G"}),
    ({"requests": {"memory": "16Gi"}}, 3, {"memory": "48Gi"}),
    ({"requests": {"memory": "100Mi", "cpu": "100m"}}, 3, {"cpu": "300m", "memory": "300Mi"}),
])
def test_min_resources_are_written_as_people_write_them(resources, nodes, want):
    pg = podgroup(nodes=nodes, scheduling=COSCHED, resources=resources)
    assert pg["spec"]["minResources"] == want


@pytest.mark.parametrize("podgroup_obj, reason", [
    ({"status": {"phase": "Scheduling"}}, "Scheduling"),
    # Coscheduling's controller leaves a group Finished/Failed for good: a restarted gang's wait
    # must not show the old attempt's end.
    ({"status": {"phase": "Finished"}}, "WaitingForGang"),
    ({"status": {"phase": "Failed"}}, "WaitingForGang"),
    ({"metadata": {"name": "j"}}, "WaitingForGang"),        # no status yet
    (None, "WaitingForGang"),
])
def test_waiting_reason_from_the_podgroup_phase(podgroup_obj, reason):
    job = make_job(nodes=2, scheduling=COSCHED)
    group = Group.of([waiting(make_pod(0, phase="Pending")), waiting(make_pod(1, phase="Pending"))])
    state = gang.gang_state(job, group.at(0), podgroup=podgroup_obj)
    assert not state.placed and state.reason == reason
    assert ("missing or could not be read" in state.message) == (podgroup_obj is None)
