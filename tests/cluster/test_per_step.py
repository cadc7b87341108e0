"""A per-step job (spec.faultTolerance) against the real API server, scheduler and GC, on kwok's
nodes: its torchft Lighthouse pod and Service, the Lighthouse made again when deleted, and a lost
training pod replaced alone (restartHistory mode perStep) while the others keep theirs."""
from __future__ import annotations

from ddpjob_api import contract, labels
from tests.cluster.conftest import wait_for
from tests.cluster.test_operator import crd, endpoint_pods, k8s, running, start_operator  # noqa: F401  (fixtures)

FT = {"mode": "perStep", "minReplicas": 1}


def training_pods(k8s, name):
    """(pod, phase) of the job's training pods not being deleted, as `ddpjob` lists them."""
    pods = k8s.core.list_namespaced_pod(k8s.ns, label_selector=labels.training_selector(name)).items
    return sorted((p.metadata.name, p.status.phase) for p in pods if p.metadata.deletion_timestamp is None)


def lighthouse(k8s, name):
    """The job's Lighthouse pod once it runs (None before, and while one is being deleted)."""
    pods = k8s.core.list_namespaced_pod(
        k8s.ns, label_selector=f"{labels.JOB_NAME}={name},{labels.ROLE}={labels.ROLE_LIGHTHOUSE}").items
    up = [p for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None]
    return up[0] if len(up) == 1 and len(pods) == 1 else None


def test_a_per_step_job_keeps_its_lighthouse_and_replaces_a_lost_pod_alone(start_operator, k8s):
    start_operator()
    k8s.apply("ft", nodes=2, faultTolerance=FT)
    k8s.wait_status("ft", running(2), "Running 2/2")
    uid = k8s.job("ft")["metadata"]["uid"]

    # The Lighthouse: its own pod and headless Service, owned by the job, none of its nodes.
    lh = wait_for(lambda: lighthouse(k8s, "ft"), timeout=30, desc="the Lighthouse pod running")
    assert lh.metadata.name == "ft-ft" and lh.metadata.owner_references[0].uid == uid
    assert lh.spec.containers[0].command[:3] == ["python", "-m", "ddpjob_trainer.lighthouse"]
    assert lh.spec.restart_policy == "Always"
    svc = k8s.core.read_namespaced_service("ft-ft", k8s.ns)
    assert svc.spec.cluster_ip == "None"  # headless
    assert [p.port for p in svc.spec.ports] == [contract.FT_LIGHTHOUSE_PORT, contract.FT_LIGHTHOUSE_ID_PORT]
    assert svc.metadata.owner_references[0].uid == uid
    wait_for(lambda: endpoint_pods(k8s.core.api_client, k8s.ns, "ft-ft") == ["ft-ft"], timeout=30,
             desc="the Lighthouse Service's endpoint")
    # The headless Service lists the training pods only.
    wait_for(lambda: endpoint_pods(k8s.core.api_client, k8s.ns, "ft") == ["ft-0", "ft-1"], timeout=30,
             desc=f"the headless Service's endpoints ({endpoint_pods(k8s.core.api_client, k8s.ns, 'ft')})")
    assert training_pods(k8s, "ft") == [("ft-0", "Running"), ("ft-1", "Running")]
    k8s.wait_status("ft", lambda s: any(c["type"] == "LighthouseReady" and c["status"] == "True"
                                        for c in s.get("conditions") or []), "LighthouseReady")

    # A deleted Lighthouse is made again; the training pods keep theirs, nothing restarts.
    uids = {p.metadata.name: p.metadata.uid for p in k8s.pods("ft")}
    k8s.core.delete_namespaced_pod("ft-ft", k8s.ns, grace_period_seconds=0)
    wait_for(lambda: (p := lighthouse(k8s, "ft")) is not None and p.metadata.uid != uids["ft-ft"], timeout=30,
             desc="a new Lighthouse pod running")
    assert {p.metadata.name: p.metadata.uid for p in k8s.pods("ft") if p.metadata.name != "ft-ft"} == {
        n: uids[n] for n in ("ft-0", "ft-1")}
    assert k8s.status("ft")["restarts"] == 0

    # Training pod 1 deleted: replaced alone, in the same attempt; pod 0 keeps its pod.
    k8s.core.delete_namespaced_pod("ft-1", k8s.ns, grace_period_seconds=0)
    status = k8s.wait_status("ft", lambda s: s.get("restarts") == 1 and running(2)(s), "rank 1 replaced")
    assert status["attempt"] == 0, status
    (entry,) = [e for e in status["restartHistory"] if e["kind"] == "Replace"]
    assert (entry["rank"], entry["pod"], entry["newPod"], entry["reason"], entry["mode"]) == (
        1, "ft-1", "ft-1-r1", "PodDeleted", "perStep"), entry
    wait_for(lambda: training_pods(k8s, "ft") == [("ft-0", "Running"), ("ft-1-r1", "Running")], timeout=30,
             desc=f"rank 1 replaced alone ({training_pods(k8s, 'ft')})")
    assert k8s.core.read_namespaced_pod("ft-0", k8s.ns).metadata.uid == uids["ft-0"]
    assert lighthouse(k8s, "ft") is not None
