"""A real Prometheus scraping the real operator while it runs jobs on the control plane:
every query of the operator dashboard returns data, DDPJobFailed fires for a real failure, and
DDPJobPendingTooLong's series is there for an unschedulable job only, with the operator up."""
from __future__ import annotations

import datetime as dt

import pytest
from kubernetes import client

from tests.e2e.test_prometheus import Prometheus, dashboard_targets, ensure_prometheus, rules
from tests.support.cluster import REPO_ROOT, set_pod_exit, wait_crd_established, wait_for

CRD = REPO_ROOT / "charts" / "ddpjob-operator" / "crds" / "ddpjobs.ddpjob.dev.yaml"


def job(name: str, **spec) -> dict:
    return {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
            "spec": {"image": "reg/trainer:1", "nodes": 1, "gpusPerNode": 0, **spec}}


@pytest.fixture
def operator_and_prometheus(cluster, namespace, kit, tmp_path):
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    wait_crd_established(cluster, "ddpjobs.ddpjob.dev")
    op = kit.start_operator(cluster.kubeconfig, tmp_path / "operator.log", "-n", namespace, "--peering", "")
    prom = Prometheus(ensure_prometheus()[0], tmp_path / "prom",
                      targets={"ddpjob-operator": [f"127.0.0.1:{op.metrics_port}"]})
    try:
        yield op, prom
    finally:
        prom.stop()
        op.stop()
        print(f"--- operator log ---\n{op.text()[-4000:]}")


def test_operator_dashboard_queries_return_data(operator_and_prometheus, api, namespace):
    op, prom = operator_and_prometheus
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)

    def create(body):
        custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", namespace, "ddpjobs", body)

    def phase(name):
        return (custom.get_namespaced_custom_object("ddpjob.dev", "v1alpha1", namespace, "ddpjobs", name)
                .get("status") or {}).get("phase")

    def running_pod(name):
        pods = core.list_namespaced_pod(namespace, label_selector=f"ddpjob.dev/job-name={name}").items
        live = [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        return live[0].metadata.name if live else None

    create(job("keep"))                                   # stays Running: poked below for passes
    create(job("stuck", scheduling={"nodeSelector": {"ddpjob.dev/test-no-such-node": "true"}}))   # stays Pending
    create(job("ok"))
    create(job("bad", failurePolicy={"maxRestarts": 1}))
    for name in ("keep", "ok", "bad"):
        wait_for(lambda: phase(name) == "Running", timeout=60, desc=f"{name} Running")
    set_pod_exit(api, namespace, wait_for(lambda: running_pod("ok"), timeout=30, desc="ok's pod"), 0)
    wait_for(lambda: phase("ok") == "Succeeded", timeout=60, desc="ok Succeeded")
    first = wait_for(lambda: running_pod("bad"), timeout=30, desc="bad's pod")
    set_pod_exit(api, namespace, first, 1)                # group restart (budget 1)
    second = wait_for(lambda: (lambda p: p if p and phase("bad") == "Running" and
                               core.read_namespaced_pod(p, namespace).metadata.labels.get("ddpjob.dev/attempt") == "1"
                               else None)(running_pod("bad")), timeout=90, desc="bad restarted (attempt 1)")
    set_pod_exit(api, namespace, second, 1)               # budget exhausted -> Failed
    wait_for(lambda: phase("bad") == "Failed", timeout=60, desc="bad Failed")

    def scraped():
        return (prom.series("ddpjob_operator_jobs_failed_total") and prom.series("ddpjob_operator_jobs_restarted_total")
                and prom.series('ddpjob_operator_jobs{phase="Failed"} == 1')
                and prom.series("ddpjob_operator_jobs_succeeded_total >= 1"))
    wait_for(scraped, timeout=60, interval=1, desc="the operator's counters in Prometheus")

    # The rate panels need passes within their last minute. A job at rest costs none, and those
    # above may all have come and gone before Prometheus's first good scrape of a loaded operator
    # (rehearsal 10: the rate stayed empty): each poll first gives `keep` a new annotation, a
    # change of the job that the operator makes a pass over.
    pokes = iter(range(1_000_000))

    def poked(q: str) -> list:
        custom.patch_namespaced_custom_object("ddpjob.dev", "v1alpha1", namespace, "ddpjobs", "keep",
                                              {"metadata": {"annotations": {"test.ddpjob.dev/poke": str(next(pokes))}}})
        return prom.series(q)
    wait_for(lambda: poked("sum(rate(ddpjob_operator_reconcile_seconds_count[1m])) > 0"), timeout=60,
             interval=1, desc="reconcile rate in Prometheus")

    for title, expr in dashboard_targets("ddpjob-operator.json"):
        q = expr.replace("$__rate_interval", "1m").replace("$__range", "10m")
        got = wait_for(lambda: poked(q), timeout=30, interval=1, desc=f"panel {title!r}: data for {q}")
        assert all(s["value"][1] != "NaN" for s in got), (title, got)

    failed = next(r for r in rules() if r.get("alert") == "DDPJobFailed")
    fired = prom.series(failed["expr"])
    assert fired and fired[0]["metric"].get("reason"), fired

    # DDPJobPendingTooLong's series: the Pending job only, from its status.startTime; the operator is up.
    def alert_expr(name: str) -> str:
        return next(r["expr"] for r in rules() if r.get("alert") == name)
    since = wait_for(lambda: prom.series('ddpjob_operator_job_pending_since_timestamp_seconds'), timeout=30,
                     interval=1, desc="the pending-since gauge in Prometheus")
    assert {s["metric"]["ddpjob"] for s in since} == {"stuck"}, since
    status = custom.get_namespaced_custom_object("ddpjob.dev", "v1alpha1", namespace, "ddpjobs", "stuck")["status"]
    started = dt.datetime.fromisoformat(status["startTime"].replace("Z", "+00:00")).timestamp()
    assert status["phase"] == "Pending" and float(since[0]["value"][1]) == started, (status, since)
    pending = prom.series(alert_expr("DDPJobPendingTooLong"))
    assert [s["metric"]["ddpjob"] for s in pending] == ["stuck"] and float(pending[0]["value"][1]) > 0, pending
    assert prom.series(alert_expr("DDPJobOperatorDown")) == []
    assert prom.series(alert_expr("DDPJobReconcileErrors")) == []
