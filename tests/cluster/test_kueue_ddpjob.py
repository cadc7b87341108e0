"""DDPJobs queued by Kueue, with the operator running: the issue's scene with a ClusterQueue of 32
GPUs. Two DDPJobs of 3 nodes x 8 GPUs labelled with a LocalQueue: one is admitted and runs, the
other waits (Admitted=False, Queued) with every pod gated and none bound, and is admitted when
the first finishes."""
from __future__ import annotations

import pytest

from ddpjob_operator.builders import kueue
from tests.cluster.test_kueue import delete_queues, kueue_namespace, make_queues
from tests.cluster.test_operator import crd, k8s, running, start_operator  # noqa: F401  (fixtures)
from tests.support.cluster import delete_namespace, set_pod_exit, wait_for


@pytest.fixture
def namespace(cluster, api):
    """Overrides the per-test namespace of the operator fixtures: one Kueue manages, with
    LocalQueue `gpus` on a 32-GPU ClusterQueue."""
    ns = kueue_namespace(api)
    name = make_queues(api, ns, gpus=32)
    yield ns
    delete_namespace(api, ns)
    delete_queues(api, name)


def admitted(status):
    return next((c for c in status.get("conditions") or [] if c["type"] == "Admitted"), None)


def test_second_job_waits_in_the_queue_holding_nothing_then_runs(start_operator, k8s, api):
    start_operator()
    for name in ("qa", "qb"):
        body = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob",
                "metadata": {"name": name, "labels": {kueue.QUEUE_LABEL: "gpus"}},
                "spec": {"image": "reg/trainer:1", "nodes": 3, "gpusPerNode": 8}}
        k8s.custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", k8s.ns, "ddpjobs", body)
    first = wait_for(lambda: next((n for n in ("qa", "qb") if running(3)(k8s.status(n))), None),
                     timeout=90, desc="one of the two queued jobs Running 3/3")
    second = "qb" if first == "qa" else "qa"
    cond = admitted(k8s.status(first))
    assert cond and cond["status"] == "True" and cond["reason"] == "Admitted", k8s.status(first)

    status = k8s.wait_status(second, lambda s: (admitted(s) or {}).get("reason") == "Queued", "Queued",
                             timeout=60)
    assert status["phase"] == "Pending"
    assert "waiting in Kueue LocalQueue gpus for quota for all 3 pods: 3 gated" in admitted(status)["message"]
    pods = k8s.pods(second)
    assert len(pods) == 3 and not [p.metadata.name for p in pods if p.spec.node_name], "a queued job holds a node"
    for p in pods:
        assert kueue.ADMISSION_GATE in {g.name for g in p.spec.scheduling_gates or []}
        assert p.metadata.labels[kueue.GROUP_LABEL].startswith(f"{second}-")

    for pod in k8s.pods(first):
        set_pod_exit(api, k8s.ns, pod.metadata.name, 0)
    k8s.wait_status(first, lambda s: s.get("phase") == "Succeeded", "Succeeded", timeout=60)
    status = k8s.wait_status(second, running(3), "Running 3/3 once admitted", timeout=120)
    assert admitted(status)["status"] == "True"
    # Events follow the status write they announce (a pass writes the status, then posts them).
    wait_for(lambda: ("Normal", "Admitted") in [e[:2] for e in k8s.events(second)], timeout=30,
             desc=f"the Admitted event of {second}")


def test_a_restarted_job_queues_again_as_a_new_group(start_operator, k8s, api):
    start_operator()
    body = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob",
            "metadata": {"name": "qr", "labels": {kueue.QUEUE_LABEL: "gpus"}},
            "spec": {"image": "reg/trainer:1", "nodes": 2, "gpusPerNode": 8}}
    k8s.custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", k8s.ns, "ddpjobs", body)
    k8s.wait_status("qr", running(2), "Running 2/2", timeout=90)
    old = {p.metadata.labels[kueue.GROUP_LABEL] for p in k8s.pods("qr")}
    set_pod_exit(api, k8s.ns, "qr-1", 1)  # a rank fails: the operator restarts the whole group
    status = k8s.wait_status("qr", lambda s: s.get("attempt") == 1 and running(2)(s), "attempt 1 Running 2/2",
                             timeout=120)
    new = {p.metadata.labels[kueue.GROUP_LABEL] for p in k8s.pods("qr") if p.metadata.labels["ddpjob.dev/attempt"] == "1"}
    assert len(old) == len(new) == 1 and old != new, (old, new)
    assert admitted(status)["status"] == "True" and status["restarts"] == 1
