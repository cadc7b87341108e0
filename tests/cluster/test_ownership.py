"""Children the operator relies on are checked, not assumed: a deleted headless Service is back
before the next group starts (its pods' rendezvous resolves through it)."""
from __future__ import annotations

from tests.cluster.conftest import wait_for
from tests.cluster.test_operator import crd, k8s, running, start_operator  # noqa: F401  (fixtures)
from tests.support.cluster import set_pod_exit


def name_conflict(k8s, name: str) -> str:
    """Wait for the job to say a name it needs is taken (Pending, FailedCreatePod NameConflict)."""
    status = k8s.wait_status(name, lambda s: s.get("reason") == "FailedCreatePod", "FailedCreatePod")
    cond = next(c for c in status["conditions"] if c["type"] == "FailedCreatePod")
    assert cond["reason"] == "NameConflict" and status["phase"] == "Pending", status
    return cond["message"]


def test_deleted_service_is_created_again_when_the_group_restarts(start_operator, k8s):
    start_operator()
    job = k8s.apply("svc", nodes=2)
    k8s.wait_status("svc", running(2), "Running 2/2")
    k8s.core.delete_namespaced_service("svc", k8s.ns)
    wait_for(lambda: not [s for s in k8s.core.list_namespaced_service(k8s.ns).items if s.metadata.name == "svc"],
             timeout=30, desc="Service svc deleted")
    set_pod_exit(k8s.core.api_client, k8s.ns, "svc-1", 1)
    k8s.wait_status("svc", lambda s: s.get("restarts") == 1 and running(2)(s), "restarted once")
    svc = k8s.core.read_namespaced_service("svc", k8s.ns)
    assert svc.spec.cluster_ip == "None"
    assert [o.uid for o in svc.metadata.owner_references] == [job["metadata"]["uid"]]


def test_pod_name_taken_by_someone_else_is_named_in_the_job(start_operator, k8s):
    k8s.core.create_namespaced_pod(k8s.ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "taken-0"},
        "spec": {"containers": [{"name": "c", "image": "reg/other:1"}],
                 # Never scheduled: no node matches, so nothing runs it.
                 "nodeSelector": {"ddpjob.dev/test-no-such-node": "x"}}})
    start_operator()
    k8s.apply("taken", nodes=2)
    assert "pod taken-0 exists and is not owned by this DDPJob" in name_conflict(k8s, "taken")


def test_service_name_taken_by_a_plain_service_is_named_and_the_job_starts_once_it_is_gone(start_operator, k8s):
    # Like a job named `kubernetes` in `default`: a ClusterIP Service of that name already exists.
    k8s.core.create_namespaced_service(k8s.ns, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "squat"},
        "spec": {"selector": {"app": "other"}, "ports": [{"port": 80}]}})
    start_operator()
    k8s.apply("squat", nodes=2)
    assert "service squat exists and is not owned by this DDPJob" in name_conflict(k8s, "squat")
    assert not [p for p in k8s.core.list_namespaced_pod(k8s.ns).items if p.metadata.name.startswith("squat-")]
    k8s.core.delete_namespaced_service("squat", k8s.ns)
    k8s.wait_status("squat", running(2), "Running 2/2 once the foreign Service is gone", timeout=90)
    svc = k8s.core.read_namespaced_service("squat", k8s.ns)
    assert svc.spec.cluster_ip == "None"
