"""Kueue (make cluster-up; DDPJOB_KUEUE=0 starts none) holds whole pod groups back until their quota is free,
through its plain-pod group integration, with pods owned by a DDPJob as the operator's are.

What the operator would put on each pod of one group (one attempt of one DDPJob):
- label kueue.x-k8s.io/queue-name: the LocalQueue;
- label kueue.x-k8s.io/pod-group-name: a name of its own per attempt (it is the Workload's name;
  pods given a finished group's name are deleted or never admitted, see the last test);
- annotation kueue.x-k8s.io/pod-group-total-count: the number of pods;
- annotation kueue.x-k8s.io/retriable-in-group: "false": else a group whose pods failed or were
  deleted waits for replacements in the same group, holding its quota and keeping its pods (with
  Kueue's finalizer) forever.
The namespace must carry the label that hack/cluster-up.sh gave Kueue (.cache/cluster/kueue.env).
"""
from __future__ import annotations

import time
import uuid

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster.test_crd import install_crd, manifest
from tests.support.cluster import (
    CLUSTER_DIR,
    GPU_RESOURCE,
    RUNTIME_CLASS,
    create_namespace,
    delete_namespace,
    set_pod_exit,
    wait_for,
)

KUEUE = ("kueue.x-k8s.io", "v1beta2")
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
FINALIZER = "kueue.x-k8s.io/managed"
GATES = {"kueue.x-k8s.io/admission", "kueue.x-k8s.io/topology"}
WAIT = 30


def kueue_env() -> dict[str, str]:
    path = CLUSTER_DIR / "kueue.env"
    if not path.exists():
        pytest.skip("the cluster runs without Kueue (started with DDPJOB_KUEUE=0)")
    return dict(line.split("=", 1) for line in path.read_text().split())


def kueue_namespace(api) -> str:
    """A namespace whose pods Kueue manages (the label hack/cluster-up.sh gave Kueue)."""
    env = kueue_env()
    return create_namespace(api, prefix="kueue-", labels={env["KUEUE_NAMESPACE_LABEL"]: "true"})


def make_queues(api, ns: str, *, gpus: int = 32) -> str:
    """A ResourceFlavor and a ClusterQueue of `gpus` GPUs (4 kwok nodes x 8 by default), named
    like the namespace (one set per test), for that namespace only, and LocalQueue `gpus` in it."""
    custom = client.CustomObjectsApi(api)
    name = ns
    custom.create_cluster_custom_object(*KUEUE, "resourceflavors", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name}})
    custom.create_cluster_custom_object(*KUEUE, "clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "resourceGroups": [{
                "coveredResources": ["cpu", "memory", GPU_RESOURCE],
                "flavors": [{"name": name, "resources": [
                    {"name": "cpu", "nominalQuota": "256"},
                    {"name": "memory", "nominalQuota": "2Ti"},
                    {"name": GPU_RESOURCE, "nominalQuota": str(gpus)}]}]}]}})
    custom.create_namespaced_custom_object(*KUEUE, ns, "localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "gpus"},
        "spec": {"clusterQueue": name}})
    return name


def delete_queues(api, name: str) -> None:
    custom = client.CustomObjectsApi(api)
    for plural in ("clusterqueues", "resourceflavors"):
        try:
            custom.delete_cluster_custom_object(*KUEUE, plural, name)
        except ApiException as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def kq(cluster, api):
    """A Kueue-managed namespace with a LocalQueue on a ClusterQueue of 32 GPUs (4 kwok nodes x 8),
    and a DDPJob (no operator runs) to own the pods."""
    install_crd(cluster)
    ns = kueue_namespace(api)
    custom = client.CustomObjectsApi(api)
    name = make_queues(api, ns)
    job = custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", manifest("train", nodes=3))

    class KQ:
        core = client.CoreV1Api(api)
        namespace = ns

        def group(self, group: str, count: int = 3, prefix: str | None = None) -> list[str]:
            names = [f"{prefix or group}-{i}" for i in range(count)]
            for pod in names:
                self.core.create_namespaced_pod(ns, {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {
                        "name": pod,
                        "labels": {QUEUE_LABEL: "gpus", GROUP_LABEL: group},
                        "annotations": {TOTAL_ANNOTATION: str(count), RETRIABLE_ANNOTATION: "false"},
                        "ownerReferences": [{
                            "apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "name": "train",
                            "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]},
                    "spec": {
                        "runtimeClassName": RUNTIME_CLASS, "restartPolicy": "Never",
                        "containers": [{"name": "trainer", "image": "example.invalid/trainer:test",
                                        "resources": {"limits": {GPU_RESOURCE: "8"}}}]}})
            return names

        def pods(self, group: str) -> list[client.V1Pod]:
            return self.core.list_namespaced_pod(ns, label_selector=f"{GROUP_LABEL}={group}").items

        def workload(self, group: str) -> dict | None:
            try:
                return custom.get_namespaced_custom_object(*KUEUE, ns, "workloads", group)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        def condition(self, group: str, kind: str) -> str | None:
            wl = self.workload(group) or {}
            return next((c["status"] for c in wl.get("status", {}).get("conditions", []) if c["type"] == kind), None)

        def running(self, group: str, count: int = 3) -> bool:
            pods = self.pods(group)
            return len(pods) == count and all(
                p.spec.node_name and not p.spec.scheduling_gates and p.status.phase == "Running" for p in pods)

        def gated(self, group: str, count: int = 3) -> bool:
            pods = self.pods(group)
            return len(pods) == count and all(
                not p.spec.node_name and {g.name for g in p.spec.scheduling_gates or []} >= GATES for p in pods)

        def gone(self, group: str) -> bool:
            return not self.pods(group) and self.workload(group) is None

        def gpus_in_use(self) -> str:
            cq = custom.get_cluster_custom_object(*KUEUE, "clusterqueues", name)
            usage = cq.get("status", {}).get("flavorsUsage", [{}])[0].get("resources", [])
            return next((r["total"] for r in usage if r["name"] == GPU_RESOURCE), "0")

        def wait_gpus(self, total: str) -> None:
            """The ClusterQueue's status reports admitted usage a moment after the admission."""
            wait_for(lambda: self.gpus_in_use() == total, timeout=WAIT, desc=f"{total} GPUs in use in the ClusterQueue")

    yield KQ()
    delete_namespace(api, ns)
    delete_queues(api, name)


def group_name() -> str:
    return f"train-{uuid.uuid4().hex[:6]}"


def test_second_group_waits_gated_until_the_first_is_deleted(kq):
    first, second = group_name(), group_name()
    kq.group(first)
    wait_for(lambda: kq.running(first), timeout=WAIT, desc=f"group {first}: 3 pods ungated, bound, Running")
    assert kq.condition(first, "Admitted") == "True"
    pod = kq.pods(first)[0]
    assert pod.metadata.finalizers == [FINALIZER]
    assert pod.metadata.labels[FINALIZER] == "true"
    # The DDPJob stays the pods' only owner: Kueue's Workload is owned by the pods instead.
    assert [o.kind for o in pod.metadata.owner_references] == ["DDPJob"]
    assert {o["kind"] for o in kq.workload(first)["metadata"]["ownerReferences"]} == {"Pod"}
    kq.wait_gpus("24")

    kq.group(second)
    wait_for(lambda: kq.condition(second, "QuotaReserved") == "False", timeout=WAIT,
             desc=f"group {second}: Workload pending for quota")
    time.sleep(2)  # a few scheduling rounds: still held back, and all of it
    assert kq.gated(second), [(p.metadata.name, p.spec.node_name, p.spec.scheduling_gates) for p in kq.pods(second)]
    assert "insufficient unused quota for nvidia.com/gpu" in next(
        c["message"] for c in kq.workload(second)["status"]["conditions"] if c["type"] == "QuotaReserved")

    # A restart deletes the whole group: the pods stop (Failed), Kueue lets them and the Workload go.
    for pod in kq.pods(first):
        kq.core.delete_namespaced_pod(pod.metadata.name, kq.namespace)
    wait_for(lambda: kq.gone(first), timeout=WAIT, desc=f"group {first}: pods and Workload gone")
    wait_for(lambda: kq.running(second), timeout=WAIT, desc=f"group {second}: admitted, 3 pods Running")
    kq.wait_gpus("24")


def test_gated_group_deleted_before_admission_leaves_nothing(kq):
    big, waiting = group_name(), group_name()
    kq.group(big, count=4)
    wait_for(lambda: kq.running(big, 4), timeout=WAIT, desc=f"group {big}: 4 pods Running")
    kq.group(waiting)
    wait_for(lambda: kq.gated(waiting), timeout=WAIT, desc=f"group {waiting}: 3 pods gated")
    for pod in kq.pods(waiting):
        kq.core.delete_namespaced_pod(pod.metadata.name, kq.namespace)
    wait_for(lambda: kq.gone(waiting), timeout=WAIT, desc=f"group {waiting}: pods and Workload gone")
    assert kq.running(big, 4)


def test_succeeded_group_frees_its_quota_and_keeps_its_pods(kq):
    group = group_name()
    kq.group(group, count=4)
    wait_for(lambda: kq.running(group, 4), timeout=WAIT, desc=f"group {group}: 4 pods Running")
    kq.wait_gpus("32")
    for pod in kq.pods(group):
        set_pod_exit(kq.core.api_client, kq.namespace, pod.metadata.name, 0)
    wait_for(lambda: kq.condition(group, "Finished") == "True", timeout=WAIT, desc=f"group {group}: Finished")
    kq.wait_gpus("0")
    pods = kq.pods(group)
    assert [p.status.phase for p in pods] == ["Succeeded"] * 4
    assert all(not p.metadata.finalizers for p in pods)


def test_failed_pod_finishes_an_unretriable_group(kq):
    group = group_name()
    kq.group(group)
    wait_for(lambda: kq.running(group), timeout=WAIT, desc=f"group {group}: 3 pods Running")
    kq.wait_gpus("24")
    set_pod_exit(kq.core.api_client, kq.namespace, f"{group}-1", 1)
    # The others still run (the operator would delete them): the quota stays theirs until then.
    wait_for(lambda: kq.core.read_namespaced_pod(f"{group}-1", kq.namespace).status.phase == "Failed",
             timeout=WAIT, desc=f"pod {group}-1 Failed")
    time.sleep(2)
    assert kq.gpus_in_use() == "24" and kq.condition(group, "Finished") != "True"
    for name in (f"{group}-0", f"{group}-2"):
        kq.core.delete_namespaced_pod(name, kq.namespace)
    kq.wait_gpus("0")
    wait_for(lambda: kq.condition(group, "Finished") == "True", timeout=WAIT, desc=f"group {group}: Finished")
    wait_for(lambda: [p.metadata.name for p in kq.pods(group)] == [f"{group}-1"], timeout=WAIT,
             desc=f"group {group}: the deleted pods gone")
    assert not kq.pods(group)[0].metadata.finalizers
    # The Workload is the pods' (owner references): it goes with the last of them.
    kq.core.delete_namespaced_pod(f"{group}-1", kq.namespace)
    wait_for(lambda: kq.gone(group), timeout=WAIT, desc=f"group {group}: pods and Workload gone")


def test_a_finished_groups_name_is_not_reusable(kq):
    """Why each attempt needs a group name of its own: Kueue takes new pods under a finished group's
    name for excess pods of that group, and deletes them or leaves them gated."""
    group = group_name()
    kq.group(group)
    wait_for(lambda: kq.running(group), timeout=WAIT, desc=f"group {group}: 3 pods Running")
    for pod in kq.pods(group):
        set_pod_exit(kq.core.api_client, kq.namespace, pod.metadata.name, 0)
    wait_for(lambda: kq.condition(group, "Finished") == "True", timeout=WAIT, desc=f"group {group}: Finished")
    again = kq.group(group, prefix=f"{group}-again")
    wait_for(lambda: len(kq.pods(group)) <= 3, timeout=WAIT, desc=f"group {group}: Kueue deleting the pods beyond 3")
    time.sleep(2)
    left = [p for p in kq.pods(group) if p.metadata.name in again]
    assert all(not p.spec.node_name and p.spec.scheduling_gates for p in left), \
        [(p.metadata.name, p.spec.node_name, p.spec.scheduling_gates) for p in left]
