"""Gang scheduling by the cluster's second scheduler (scheduler-plugins' Coscheduling, started by
hack/cluster-up.sh), without the operator: PodGroups and labelled pods made by hand.

The gangs get kwok nodes of their own (tainted and selected for this test only), so the shared
fake GPU nodes neither take their places nor lose theirs to them: 4 nodes x 8 GPUs, two gangs of
3 pods x 8 GPUs. One gang fits; the fourth node is free, which is what would tempt a scheduler
that places pods one by one into binding part of the second gang.
"""
from __future__ import annotations

import time
import uuid

import pytest
import yaml
from kubernetes import client

from tests.support.cluster import (
    GPU_RESOURCE,
    POD_GROUP_LABEL,
    SECOND_SCHEDULER as SCHEDULER,
    create_namespace,
    delete_namespace,
    wait_for,
)

PODGROUP_API = ("scheduling.x-k8s.io", "v1alpha1", "podgroups")
GANG = 3
# The PodGroup's own limit on how long members reserved on nodes wait for the rest (it overrides
# the scheduler's permitWaitingTimeSeconds); the losing gang is watched for longer than that.
SCHEDULE_TIMEOUT = 10
WATCH_LOSER = 2 * SCHEDULE_TIMEOUT
# The loser's bound on being placed once the winner's pods are gone: SCHEDULE_TIMEOUT, then the
# scheduler's flush of its unschedulable pool (period 30 s, pods older than 10 s), then slack.
LOSER_BINDS = SCHEDULE_TIMEOUT + 30 + 10 + 60


def gang_node(name: str, tag: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"kubernetes.io/hostname": name, "ddpjob.dev/test-node": tag}},
            "spec": {"taints": [{"key": "ddpjob.dev/test-node", "value": tag, "effect": "NoSchedule"}]},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", GPU_RESOURCE: "8"},
                       "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110", GPU_RESOURCE: "8"}}}


@pytest.fixture
def gang_nodes(cluster):
    """Four Ready kwok nodes with 8 GPUs each that only this test's pods tolerate; yields their tag."""
    tag = f"t{uuid.uuid4().hex[:8]}"  # a letter first: "1234e567" would reach the API server as a number
    names = [f"kwok-gang-{tag}-{i}" for i in range(4)]
    try:
        cluster.kubectl("create", "-f", "-",
                        input=yaml.safe_dump_all(gang_node(n, tag) for n in names))

        def all_ready() -> bool:
            out = cluster.kubectl("get", "nodes", "-l", f"ddpjob.dev/test-node={tag}", "-o",
                                  "jsonpath={.items[*].status.conditions[?(@.type=='Ready')].status}").stdout
            return out.split().count("True") == len(names)
        wait_for(all_ready, timeout=30, desc=f"kwok nodes {names} Ready")
        yield tag
    finally:
        cluster.kubectl("delete", "node", *names, "--ignore-not-found", "--wait=false", check=False)


@pytest.fixture
def gang_ns(cluster, api, gang_nodes):
    """A namespace deleted, and waited for, at the end: while gang_nodes still exist, since only
    kwok removes a deleted pod at once, and only from the nodes it manages."""
    name = create_namespace(api, prefix="gang-")
    yield name
    delete_namespace(api, name, wait=True)


def pod(name: str, tag: str, group: str | None) -> dict:
    labels = {POD_GROUP_LABEL: group} if group else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels},
            "spec": {"schedulerName": SCHEDULER,
                     "restartPolicy": "Never",
                     "nodeSelector": {"ddpjob.dev/test-node": tag},
                     "tolerations": [{"key": "ddpjob.dev/test-node", "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "trainer", "image": "example.invalid/trainer:test",
                                     "resources": {"limits": {GPU_RESOURCE: "8"}}}]}}


def pod_group(name: str) -> dict:
    return {"apiVersion": "/".join(PODGROUP_API[:2]), "kind": "PodGroup",
            "metadata": {"name": name},
            "spec": {"minMember": GANG, "scheduleTimeoutSeconds": SCHEDULE_TIMEOUT}}


def test_one_gang_binds_whole_and_the_other_not_at_all_until_it_fits(api, gang_ns, gang_nodes):
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    ns, tag = gang_ns, gang_nodes
    groups = ["gang-a", "gang-b"]
    for g in groups:
        custom.create_namespaced_custom_object(*PODGROUP_API[:2], ns, PODGROUP_API[2], pod_group(g))
    # Interleaved, so that a scheduler placing pods one at a time would start both gangs.
    for i in range(GANG):
        for g in groups:
            core.create_namespaced_pod(ns, pod(f"{g}-{i}", tag, g))

    def bound() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {g: [] for g in groups}
        for p in core.list_namespaced_pod(ns, label_selector=POD_GROUP_LABEL).items:
            if p.spec.node_name:
                out[p.metadata.labels[POD_GROUP_LABEL]].append(p.metadata.name)
        return out

    def one_gang_whole() -> str | None:
        b = bound()
        whole = [g for g in groups if len(b[g]) == GANG]
        return whole[0] if whole else None
    winner = wait_for(one_gang_whole, timeout=60, interval=0.5,
                      desc=f"one gang with all {GANG} pods bound by {SCHEDULER}")
    loser = next(g for g in groups if g != winner)

    def status(g: str) -> dict:
        pg = custom.get_namespaced_custom_object(*PODGROUP_API[:2], ns, PODGROUP_API[2], g)
        return pg.get("status") or {}

    def phases_are(want: dict[str, tuple[str, int | None]]):
        """Each group's (phase, running pods) as scheduler-plugins' controller reports them; None:
        any count."""
        seen = {g: (status(g).get("phase"), status(g).get("running", 0)) for g in want}
        return all(seen[g][0] == p and n in (None, seen[g][1]) for g, (p, n) in want.items()) or None

    wait_for(lambda: phases_are({winner: ("Running", GANG), loser: ("Scheduling", 0)}), timeout=30,
             desc=f"PodGroup status: {winner} Running, {loser} Scheduling")
    # Long enough for the loser's members that wait in Permit on the free node to time out: none
    # may have been bound meanwhile, and none after.
    end = time.monotonic() + WATCH_LOSER
    while time.monotonic() < end:
        b = bound()
        assert b[loser] == [], f"{loser} partly bound while {winner} holds the nodes: {b}"
        assert len(b[winner]) == GANG, b
        time.sleep(0.5)

    core.delete_collection_namespaced_pod(ns, label_selector=f"{POD_GROUP_LABEL}={winner}", grace_period_seconds=0)
    # Coscheduling requeues a member it turned away itself (at Permit) on a pod added or a PodGroup
    # changed, not on the winner's pods deleted: if the deletion lands while one of the loser's pods
    # waits at Permit, the loser is left for the scheduler's leftover flush (every 30 s, pods
    # unschedulable for over 10 s: hack/cluster-up.sh), after SCHEDULE_TIMEOUT at most.
    try:
        wait_for(lambda: len(bound()[loser]) == GANG, timeout=LOSER_BINDS, interval=0.5,
                 desc=f"all {GANG} pods of {loser} bound once {winner}'s pods are gone")
    except AssertionError as exc:  # with the scheduler's last word on each pod, for the next reader
        said = {p.metadata.name: [(c.reason, c.message) for c in p.status.conditions or [] if c.type == "PodScheduled"]
                for p in core.list_namespaced_pod(ns, label_selector=f"{POD_GROUP_LABEL}={loser}").items}
        raise AssertionError(f"{exc}; PodScheduled: {said}; {loser}: {status(loser)}") from None
    nodes = {core.read_namespaced_pod(f"{loser}-{i}", ns).spec.node_name for i in range(GANG)}
    assert len(nodes) == GANG and all(n.startswith(f"kwok-gang-{tag}-") for n in nodes), nodes
    # A group with fewer pods than minMember goes back to Pending. Its running count is left at the
    # last non-zero value: the controller's merge patch drops a 0 (omitempty).
    wait_for(lambda: phases_are({loser: ("Running", GANG), winner: ("Pending", None)}), timeout=30,
             desc=f"PodGroup status: {loser} Running, {winner} Pending")


def test_pod_without_a_group_is_scheduled_alone(api, gang_ns, gang_nodes):
    """Coscheduling lets a pod that names no PodGroup through, as the default scheduler would."""
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(gang_ns, pod("solo", gang_nodes, None))
    wait_for(lambda: core.read_namespaced_pod("solo", gang_ns).spec.node_name, timeout=30,
             desc=f"pod solo bound by {SCHEDULER}")
