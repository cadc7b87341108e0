"""The local control plane itself: fake GPU nodes, scheduling, GC and the kwok test Stages."""
from __future__ import annotations

import subprocess

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.support.cluster import (
    CLUSTER_UP,
    FAKE_NODE_PREFIX,
    REPO_ROOT,
    GPU_RESOURCE,
    RUNTIME_CLASS,
    evict_pod,
    set_pod_exit,
    wait_for,
)


def _pod(name: str, *, gpus: int = 1, labels: dict | None = None, owner: dict | None = None) -> dict:
    """A GPU pod manifest like the operator's (runtime class nvidia, restartPolicy Never)."""
    meta: dict = {"name": name, "labels": labels or {"app": name}}
    if owner:
        meta["ownerReferences"] = [owner]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "runtimeClassName": RUNTIME_CLASS,
            "restartPolicy": "Never",
            "containers": [{
                "name": "trainer",
                "image": "example.invalid/trainer:test",
                "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
            }],
        },
    }


def _phase(core: client.CoreV1Api, ns: str, name: str) -> str:
    return core.read_namespaced_pod(name, ns).status.phase


def _running(core: client.CoreV1Api, ns: str, name: str):
    """The pod once Running with a podIP (else None)."""
    pod = core.read_namespaced_pod(name, ns)
    return pod if pod.status.phase == "Running" and pod.status.pod_ip else None


def _gone(core: client.CoreV1Api, ns: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, ns)
        return False
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise


@pytest.fixture
def core(api) -> client.CoreV1Api:
    return client.CoreV1Api(api)


def test_fake_gpu_nodes_are_ready(core):
    nodes = core.list_node(label_selector="type=kwok").items
    assert len(nodes) >= 4, [n.metadata.name for n in nodes]
    for node in nodes:
        assert node.metadata.name.startswith(FAKE_NODE_PREFIX)
        ready = {c.type: c.status for c in node.status.conditions}.get("Ready")
        assert ready == "True", (node.metadata.name, node.status.conditions)
        assert node.status.allocatable[GPU_RESOURCE] == "8"
        assert node.metadata.labels["nvidia.com/gpu.product"]
        assert node.metadata.labels["nvidia.com/gpu.count"] == "8"


def test_nvidia_runtime_class_exists(api):
    rc = client.NodeV1Api(api).read_runtime_class(RUNTIME_CLASS)
    assert rc.handler == "nvidia"


def test_gpu_pod_is_scheduled_and_runs(core, namespace):
    core.create_namespaced_pod(namespace, _pod("gpu-1"))
    pod = wait_for(lambda: _running(core, namespace, "gpu-1"), timeout=30, desc="pod gpu-1 Running")
    assert pod.spec.node_name.startswith(FAKE_NODE_PREFIX)
    assert pod.spec.runtime_class_name == RUNTIME_CLASS
    assert pod.status.container_statuses[0].state.running is not None
    # The ServiceAccount admission plugin mounted the namespace's default account's token.
    assert pod.spec.service_account_name == "default"


def test_pod_asking_too_many_gpus_stays_pending(core, namespace):
    core.create_namespaced_pod(namespace, _pod("greedy", gpus=99))

    def failed_scheduling():
        events = core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=greedy,reason=FailedScheduling").items
        return events[0] if events else None

    event = wait_for(failed_scheduling, timeout=30, desc="FailedScheduling event for pod greedy")
    assert GPU_RESOURCE in event.message, event.message
    pod = core.read_namespaced_pod("greedy", namespace)
    assert pod.status.phase == "Pending" and not pod.spec.node_name


def test_pod_owned_by_configmap_is_garbage_collected(core, namespace):
    cm = core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "owner"}, "data": {"k": "v"}})
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": cm.metadata.uid,
             "controller": True, "blockOwnerDeletion": True}
    core.create_namespaced_pod(namespace, _pod("owned", owner=owner))
    wait_for(lambda: _running(core, namespace, "owned"), timeout=30, desc="pod owned Running")
    core.delete_namespaced_config_map("owner", namespace)
    wait_for(lambda: _gone(core, namespace, "owned"), timeout=60,
             desc="pod owned garbage-collected after its ConfigMap owner was deleted")


def test_deleted_pod_goes_away(core, namespace):
    core.create_namespaced_pod(namespace, _pod("doomed"))
    wait_for(lambda: _running(core, namespace, "doomed"), timeout=30, desc="pod doomed Running")
    core.delete_namespaced_pod("doomed", namespace)  # default 30 s grace: kwok's pod-delete finishes it
    wait_for(lambda: _gone(core, namespace, "doomed"), timeout=20, desc="pod doomed deleted")


@pytest.mark.parametrize(("code", "phase", "reason"), [(0, "Succeeded", "Completed"),
                                                       (3, "Failed", "Error"),
                                                       (78, "Failed", "Error")])
def test_exit_code_annotation_terminates_pod(core, namespace, api, code, phase, reason):
    core.create_namespaced_pod(namespace, _pod("exiting"))
    wait_for(lambda: _running(core, namespace, "exiting"), timeout=30, desc="pod exiting Running")
    set_pod_exit(api, namespace, "exiting", code)
    wait_for(lambda: _phase(core, namespace, "exiting") == phase, timeout=30,
             desc=f"pod exiting phase {phase} after exit code {code}")
    term = core.read_namespaced_pod("exiting", namespace).status.container_statuses[0].state.terminated
    assert term is not None and term.exit_code == code and term.reason == reason


def test_evict_annotation_fails_pod_as_evicted(core, namespace, api):
    core.create_namespaced_pod(namespace, _pod("victim"))
    wait_for(lambda: _running(core, namespace, "victim"), timeout=30, desc="pod victim Running")
    evict_pod(api, namespace, "victim")
    wait_for(lambda: _phase(core, namespace, "victim") == "Failed", timeout=30, desc="pod victim Failed")
    pod = core.read_namespaced_pod("victim", namespace)
    assert pod.status.reason == "Evicted"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 137


def test_headless_service_gets_endpoints_of_running_pods(core, api, namespace):
    core.create_namespaced_pod(namespace, _pod("rank-0", labels={"job": "j"}))
    pod = wait_for(lambda: _running(core, namespace, "rank-0"), timeout=30, desc="pod rank-0 Running")
    core.create_namespaced_service(namespace, {
        "metadata": {"name": "j"},
        "spec": {"clusterIP": "None", "selector": {"job": "j"},
                 "ports": [{"name": "c10d", "port": 29500}]}})
    discovery = client.DiscoveryV1Api(api)

    def addresses():
        slices = discovery.list_namespaced_endpoint_slice(
            namespace, label_selector="kubernetes.io/service-name=j").items
        return sorted(a for s in slices for e in (s.endpoints or []) for a in e.addresses)

    assert wait_for(addresses, timeout=30, desc="EndpointSlice of service j") == [pod.status.pod_ip]


def test_cluster_up_is_idempotent_when_healthy(cluster):
    before = cluster.server()
    proc = subprocess.run(["bash", str(CLUSTER_UP)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "already running and healthy" in proc.stderr, proc.stderr
    assert cluster.server() == before


def test_wait_for_reports_desc_and_last_value():
    calls = []

    def never():
        calls.append(1)
        return None

    with pytest.raises(AssertionError, match=r"waiting for the thing; last value: None"):
        wait_for(never, timeout=0.3, desc="the thing", interval=0.05)
    assert len(calls) > 1

    def boom():
        raise ValueError("nope")

    with pytest.raises(AssertionError, match=r"last exception: ValueError\('nope'\)"):
        wait_for(boom, timeout=0.2, desc="boom", interval=0.05)
    assert wait_for(lambda: "ok", timeout=1, desc="ok") == "ok"
