"""A node that goes away is not the job's fault: the group restarts (pod 0 is among the lost) without using the budget.

The job runs on a kwok node of its own (labelled and tainted for this test only: the fake GPU
nodes are shared). Deleting that Node object leaves its pods orphaned; the controller-manager's
PodGC marks each Failed with a DisruptionTarget condition (DeletionByPodGC), then force-deletes
it, so the operator's watch sees the pods vanish almost at once.
"""
from __future__ import annotations

import inspect
import uuid

import pytest
import yaml
from kubernetes.client.rest import ApiException

from ddpjob_operator.app import controller
from tests.cluster.conftest import wait_for
from tests.cluster.test_operator import crd, k8s, start_operator  # noqa: F401  (fixtures)

# decide() tells a lost node from a deleted pod by the pod's last state, which only the
# controller sees (its watch's DELETED event): until it hands that over, the loss is charged.
HANDS_OVER_DEPARTED = "departed" in inspect.getsource(controller)


def fake_node(name: str, tag: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"type": "kwok", "kubernetes.io/hostname": name, "ddpjob.dev/test-node": tag}},
            "spec": {"taints": [{"key": "ddpjob.dev/test-node", "value": tag, "effect": "NoSchedule"}]},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"},
                       "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110"}}}


@pytest.fixture
def own_nodes(cluster):
    tag = f"t{uuid.uuid4().hex[:8]}"  # a letter first: "1234e567" would reach the API server as a number
    made: list[str] = []

    def make(suffix: str) -> str:
        name = f"kwok-lost-{tag}-{suffix}"
        cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(fake_node(name, tag)))
        made.append(name)
        wait_for(lambda: "True" in cluster.kubectl(
            "get", "node", name, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}").stdout,
            timeout=30, desc=f"kwok node {name} Ready")
        return name

    yield tag, make
    for name in made:
        cluster.kubectl("delete", "node", name, "--ignore-not-found", "--wait=false", check=False)


def test_deleted_node_restarts_the_group_without_charging_the_budget(cluster, own_nodes, start_operator, k8s):
    tag, make_node = own_nodes
    first = make_node("a")
    start_operator()
    sched = {"nodeSelector": {"ddpjob.dev/test-node": tag},
             "tolerations": [{"key": "ddpjob.dev/test-node", "operator": "Exists", "effect": "NoSchedule"}]}
    # Both pods on the one node the test owns.
    k8s.apply("lost", nodes=2, scheduling={**sched, "onePodPerNode": False}, failurePolicy={"maxRestarts": 0})
    k8s.wait_status("lost", lambda s: s.get("phase") == "Running", "Running on the node", timeout=60)
    assert {p.spec.node_name for p in k8s.pods("lost")} == {first}

    cluster.kubectl("delete", "node", first)
    make_node("b")  # somewhere for the new group to run
    # PodGC waits out a 40 s quarantine before it believes the node is gone.
    status = k8s.wait_status("lost", lambda s: s.get("phase") == "Failed" or (
        s.get("restarts", 0) >= 1 and s.get("phase") != "Restarting"), "restarted after the node loss", timeout=180)
    assert status["phase"] != "Failed", status
    assert status["countedRestarts"] == 0 and status["reason"] != "RestartLimitExceeded"
    events = k8s.core.list_namespaced_event(k8s.ns, field_selector="involvedObject.name=lost").items
    restarts = [e.message for e in events if e.reason == "Restarting"]
    assert any("0/0 of the budget" in m and "taken away by the cluster" in m for m in restarts), restarts
    k8s.wait_status("lost", lambda s: s.get("phase") == "Running" and s.get("attempt") == status["attempt"],
                    "the new group Running", timeout=60)


def test_pods_on_a_deleted_node_are_gone_with_a_disruption_condition_first(cluster, own_nodes, api, namespace):
    """The fact the rule relies on: PodGC's last write before the force-delete names the disruption."""
    from kubernetes import client, watch

    tag, make_node = own_nodes
    node = make_node("a")
    core = client.CoreV1Api(api)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "orphan", "labels": {"t": tag}},
           "spec": {"nodeName": node, "containers": [{"name": "c", "image": "reg/x:1"}],
                    "tolerations": [{"key": "ddpjob.dev/test-node", "operator": "Exists"}]}}
    core.create_namespaced_pod(namespace, pod)
    wait_for(lambda: core.read_namespaced_pod("orphan", namespace).status.phase == "Running", timeout=30,
             desc="pod Running on the kwok node")
    rv = core.list_namespaced_pod(namespace).metadata.resource_version
    cluster.kubectl("delete", "node", node)
    last = None
    for ev in watch.Watch().stream(core.list_namespaced_pod, namespace, resource_version=rv,
                                   label_selector=f"t={tag}", timeout_seconds=150):
        last = ev["object"]
        if ev["type"] == "DELETED":
            break
    assert last is not None and last.status.phase == "Failed"
    conds = {c.type: c for c in last.status.conditions or []}
    assert conds["DisruptionTarget"].status == "True" and conds["DisruptionTarget"].reason == "DeletionByPodGC"
    with pytest.raises(ApiException):
        core.read_namespaced_pod("orphan", namespace)
