"""Gang scheduling of DDPJobs on the local control plane, by scheduler-plugins' Coscheduling
(built from its Go module and run by hack/cluster-up.sh as a second scheduler).

The issue's scene: 4 fake nodes of 8 GPUs, two DDPJobs of 3 nodes x 8 GPUs applied together.
Without gang scheduling both end Pending 2/3 holding 16 GPUs each for good; with it one runs and
the other waits holding nothing until the first finishes.
"""
from __future__ import annotations

import time

import pytest
from kubernetes import client

from tests.cluster.conftest import wait_for
from tests.cluster.test_operator import crd, k8s, running, start_operator  # noqa: F401  (fixtures)
from tests.support.cluster import set_pod_exit

GANG = {"gang": {"scheduler": "coscheduling", "scheduleTimeoutSeconds": 10}}
# Longer than the scheduler's permit wait (hack/cluster-up.sh) and the group's timeout: a gang that
# could not be completed has released every pod it had reserved by then.
SETTLE = 25


def kwok_gpus_in_use(api) -> int:
    """GPUs that bound, unfinished pods hold on the fake nodes, in every namespace."""
    pods = client.CoreV1Api(api).list_pod_for_all_namespaces().items
    used = 0
    for p in pods:
        if not (p.spec.node_name or "").startswith("kwok-gpu-") or p.status.phase in ("Succeeded", "Failed"):
            continue
        for c in p.spec.containers:
            used += int(((c.resources and c.resources.limits) or {}).get("nvidia.com/gpu", 0))
    return used


@pytest.fixture
def free_gpus(api):
    """Earlier tests' namespaces are deleted without waiting: start with all 32 GPUs free."""
    wait_for(lambda: kwok_gpus_in_use(api) == 0, timeout=120, desc="the fake nodes' GPUs free")


def bound(k8s, job: str) -> list[str]:
    return [p.metadata.name for p in k8s.pods(job) if p.spec.node_name and p.status.phase not in ("Succeeded", "Failed")]


def gang_cond(status):
    return next((c for c in status.get("conditions") or [] if c["type"] == "GangScheduled"), None)


def test_two_gangs_that_do_not_fit_together_run_one_after_the_other(start_operator, k8s, api, free_gpus):
    start_operator()
    for name in ("ga", "gb"):
        k8s.apply(name, nodes=3, gpusPerNode=8, scheduling=GANG)
    first = wait_for(lambda: next((n for n in ("ga", "gb") if running(3)(k8s.status(n))), None),
                     timeout=90, desc="one of the two gangs Running 3/3")
    second = "gb" if first == "ga" else "ga"
    pg = k8s.custom.get_namespaced_custom_object("scheduling.x-k8s.io", "v1alpha1", k8s.ns, "podgroups", first)
    assert pg["spec"]["minMember"] == 3 and pg["spec"]["minResources"]["nvidia.com/gpu"] == "24"
    assert pg["metadata"]["ownerReferences"][0]["name"] == first
    for pod in k8s.pods(first):
        assert pod.spec.scheduler_name == "scheduler-plugins-scheduler"
        assert pod.metadata.labels["scheduling.x-k8s.io/pod-group"] == first

    # The other gang holds nothing, not for a moment past the scheduler's permit wait.
    time.sleep(SETTLE)
    for _ in range(5):
        assert bound(k8s, second) == [], f"{second} holds nodes while it cannot run whole"
        time.sleep(1)
    status = k8s.status(second)
    assert status["phase"] == "Pending", status
    cond = gang_cond(status)
    assert cond and cond["status"] == "False", status
    assert "waiting for scheduler-plugins-scheduler to place 3 pods at once (0 bound)" in cond["message"]
    assert gang_cond(k8s.status(first))["status"] == "True"

    # The first finishes: its GPUs are free and the second gang is placed, all three at once.
    for pod in k8s.pods(first):
        set_pod_exit(api, k8s.ns, pod.metadata.name, 0)
    k8s.wait_status(first, lambda s: s.get("phase") == "Succeeded", "Succeeded", timeout=60)
    k8s.wait_status(second, running(3), "Running 3/3 after the first finished", timeout=120)
    cond = gang_cond(k8s.status(second))
    assert cond["status"] == "True" and "3/3 pods placed together" in cond["message"]
    # Events follow the status write they announce.
    wait_for(lambda: ("Normal", "GangScheduled") in [e[:2] for e in k8s.events(second)], timeout=30,
             desc=f"the GangScheduled event of {second}")
