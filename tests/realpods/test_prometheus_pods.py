"""Debian's Prometheus on loopback scraping real training pods the way the chart's monitors would:
`kubernetes_sd_configs` (role pod) with the PodMonitor's selector, port and relabelings rendered by
`helm template` (tests/realpods/promkit.py), plus the in-cluster operator through its
ServiceMonitor's selector. One examples/digits.yaml job feeds every job-dashboard query (evaluated
at a moment while it trained); a one-node job frozen on purpose after a few steps, with a small
spec.hangTimeoutSeconds, makes the chart's DDPJobStalled alert fire."""
from __future__ import annotations

import time
import uuid

import pytest

from tests.e2e.test_prometheus import (
    GPU_METRICS,
    RULES,
    Prometheus,
    dashboard_targets,
    ensure_prometheus,
    rules,
    substitute,
)
from tests.realpods.conftest import (
    apply_docs,
    diagnose,
    example_docs,
    helm_install_operator,
    job_status,
    pod_nodes,
    real_nodes,
    shared_checkpoint_pv,
)
from tests.realpods.promkit import (
    PodDiscovery,
    assert_only_real_pod_targets,
    chart_scrape_configs,
    has_kubernetes_sd,
    query_at,
    targets_report,
)
from tests.support.cluster import create_namespace, delete_namespace, wait_for

# The first test carries the module's setup: images (when code changed), a Helm install and a job
# trained to step 55 on a shared machine; each wait inside has its own deadline.
pytestmark = pytest.mark.timeout(1800)

JOB, FROZEN = "digits", "frozen"
HANG_TIMEOUT = 5       # spec.hangTimeoutSeconds of the frozen job: the alert's threshold, via the operator
FREEZE_AT_STEP = 3
SCRAPE_INTERVAL = "2s"
# Sized for one pod beside another test's job on a 2-CPU real node (the example asks a whole CPU).
SMALL_REQUESTS = {"cpu": "100m", "memory": "512Mi"}


def _stalled_alert() -> dict:
    return next(r for r in rules() if r.get("alert") == "DDPJobStalled")


def _parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]]


def _digits_docs() -> list[dict]:
    docs = example_docs("digits.yaml")
    for d in docs:
        if d.get("kind") == "DDPJob":
            d["spec"]["resources"]["requests"].update(SMALL_REQUESTS)
    return docs


def _frozen_docs() -> list[dict]:
    """The digits job on one node, no checkpoints, its only rank frozen (alive, serving metrics,
    never stepping again) a few steps in (DDPJOB_DEBUG_FREEZE_RANK): what a hung collective looks like."""
    job = next(d for d in example_docs("digits.yaml") if d.get("kind") == "DDPJob")
    spec = job["spec"]
    job["metadata"]["name"] = FROZEN
    spec["nodes"] = 1
    spec["trainer"].pop("checkpoint", None)
    spec.pop("volumes", None)
    spec.pop("volumeMounts", None)
    spec["resources"]["requests"].update(SMALL_REQUESTS)
    spec["hangTimeoutSeconds"] = HANG_TIMEOUT
    spec["failurePolicy"] = {**(spec.get("failurePolicy") or {}), "restartOnHang": False}  # stays frozen: the alert's case
    spec["env"] = [*(spec.get("env") or []), {"name": "DDPJOB_DEBUG_FREEZE_RANK", "value": f"0:{FREEZE_AT_STEP}"}]
    return [job]


@pytest.fixture(scope="module")
def stack(real_cluster, tmp_path_factory):
    """An operator release of our own watching our namespace, both jobs applied, and Prometheus
    discovering their pods (and the operator pod) through the chart-derived scrape configs."""
    api = real_cluster.api()
    ns = create_namespace(api, prefix="real-prom-")
    op_ns, release = f"ddpjob-op-{uuid.uuid4().hex[:6]}", f"op{uuid.uuid4().hex[:6]}"
    work = tmp_path_factory.mktemp("promreal")
    prom = pv = discovery = None
    try:
        helm_install_operator(real_cluster, namespace=op_ns, watch=[ns], name=release)
        claim = next(d["metadata"]["name"] for d in _digits_docs() if d.get("kind") == "PersistentVolumeClaim")
        shared_checkpoint_pv(real_cluster, claim=claim, namespace=ns, tmp=work)
        pv = f"{ns}-{claim}"
        apply_docs(real_cluster, _digits_docs(), ns)
        apply_docs(real_cluster, _frozen_docs(), ns)
        prom_bin, promtool = ensure_prometheus()
        if not has_kubernetes_sd(promtool, work):
            print(f"{prom_bin} has no kubernetes_sd_configs (Debian's build): http_sd from the API's pods instead")
            discovery = PodDiscovery(api)
        configs = chart_scrape_configs(release=release, operator_namespace=op_ns, job_namespaces=[ns],
                                       kubeconfig=real_cluster.kubeconfig, interval=SCRAPE_INTERVAL,
                                       discovery=discovery)
        prom = Prometheus(prom_bin, work / "prom", targets={}, rule_files=[RULES], scrape_configs=configs)
        yield {"ns": ns, "op_ns": op_ns, "prom": prom, "configs": configs}
    finally:
        if prom is not None:
            prom.stop()
        if discovery is not None:
            discovery.stop()
        real_cluster.helm("uninstall", release, "-n", op_ns, "--wait", "--timeout", "60s", check=False, timeout=90)
        for name in (ns, op_ns):
            delete_namespace(api, name)
        if pv:
            real_cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)
        api.close()


def _wait(real_cluster, stack, fn, *, timeout: float, desc: str):
    """wait_for, printing what a person would look at when it times out."""
    try:
        return wait_for(fn, timeout=timeout, interval=1, desc=desc)
    except AssertionError:
        print(diagnose(real_cluster, stack["ns"]))
        print(real_cluster.kubectl("get", "pods", "-n", stack["op_ns"], "-o", "wide", check=False).stdout)
        print(targets_report(stack["prom"]))
        raise


@pytest.fixture(scope="module")
def running_moment(real_cluster, stack) -> float:
    """A unix time at which the digits job was Running, both ranks scraped past an evaluation and a
    checkpoint, and the rules over two scrapes of a moving job (own step time) had evaluated."""
    prom, ns = stack["prom"], stack["ns"]
    sel = f'ddpjob="{JOB}", namespace="{ns}"'

    def enough():
        if job_status(real_cluster, ns, JOB).get("phase") in ("Succeeded", "Failed"):
            raise AssertionError(f"{JOB} finished before Prometheus saw enough of it")
        ranks = prom.series(f"ddpjob_trainer_step{{{sel}}} >= 55")
        evals = prom.series(f"ddpjob_trainer_eval_accuracy{{{sel}}} > 0")
        ckpt = prom.series(f"ddpjob_trainer_checkpoint_seconds{{{sel}}} > 0")
        own = prom.series(f"ddpjob:own_step_seconds:2m{{{sel}}}")
        return len(ranks) == 2 and len(evals) == 2 and ckpt and len(own) == 2
    _wait(real_cluster, stack, enough, timeout=900,
          desc=f"{JOB}: both ranks past step 55 with an evaluation and a checkpoint, scraped from the pods")
    at = time.time()
    assert job_status(real_cluster, ns, JOB).get("phase") == "Running"
    return at


def test_prometheus_discovers_the_training_pods_with_the_podmonitor_relabeling(real_cluster, stack, running_moment):
    prom, ns = stack["prom"], stack["ns"]
    assert_only_real_pod_targets(prom)
    got = query_at(prom, f'ddpjob_trainer_step{{ddpjob="{JOB}", namespace="{ns}"}}', running_moment)
    # The PodMonitor's relabelings: namespace, ddpjob, node_rank, pod and node from the pod's metadata.
    seen = {(s["metric"]["pod"], s["metric"]["node"], s["metric"]["rank"]) for s in got}
    where = pod_nodes(real_cluster, ns, JOB)
    assert seen == {(f"{JOB}-0", where[f"{JOB}-0"], "0"), (f"{JOB}-1", where[f"{JOB}-1"], "1")}, seen
    assert {n for _, n, _ in seen} <= set(real_nodes(real_cluster)), seen
    assert {s["metric"]["job"] for s in got} == {c["job_name"] for c in stack["configs"][:1]}, got
    # The operator pod, found through the ServiceMonitor's selector, exports the job's timeout.
    assert prom.series(f'ddpjob_operator_job_hang_timeout_seconds{{ddpjob="{FROZEN}", namespace="{ns}"}}'
                       f" == {HANG_TIMEOUT}"), targets_report(prom)


def _job_panels():
    for title, expr in dashboard_targets("ddpjob-job.json"):
        # No GPU here; the GPU panels are fed by a fake CUDA module in tests/e2e/test_prometheus.py.
        gpu_only = any(m in expr for m in GPU_METRICS)
        marks = [pytest.mark.skip(reason="CPU job: no GPU series (tests/e2e/test_prometheus.py feeds them)")] \
            if gpu_only else []
        yield pytest.param(title, expr, marks=marks, id=f"{title}:{expr[:40]}")


@pytest.mark.parametrize("title,expr", list(_job_panels()))
def test_job_dashboard_query_returns_data_while_the_job_trains(stack, running_moment, title, expr):
    q = substitute(expr, job=JOB, namespace=stack["ns"])
    got = query_at(stack["prom"], q, running_moment)
    assert got, f"panel {title!r}: no data at {running_moment} for {q}\n{targets_report(stack['prom'])}"
    assert all(s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in got), f"panel {title!r}: {got}"


@pytest.mark.parametrize("rule", [r["record"] for r in rules() if "record" in r])
def test_recording_rule_has_data_for_the_job(stack, running_moment, rule):
    got = query_at(stack["prom"], f'{rule}{{ddpjob="{JOB}", namespace="{stack["ns"]}"}}', running_moment)
    assert got, f"recording rule {rule} has no data at {running_moment}"


def test_stalled_alert_fires_for_the_frozen_job_only(real_cluster, stack):
    prom, ns = stack["prom"], stack["ns"]
    alert = _stalled_alert()
    # The rule's own pending time, not edited: a job frozen for HANG_TIMEOUT s fires `for` later.
    wait_s = HANG_TIMEOUT + _parse_duration(alert["for"])
    sel = f'ddpjob="{FROZEN}", namespace="{ns}"'
    # The job's own threshold reached the rule through the operator's metric (else it would be 600 s).
    threshold = _wait(real_cluster, stack, lambda: prom.series(f"ddpjob:hang_timeout_seconds{{{sel}}}"),
                      timeout=300, desc=f"ddpjob:hang_timeout_seconds for {FROZEN}")
    assert float(threshold[0]["value"][1]) == HANG_TIMEOUT, threshold
    _wait(real_cluster, stack, lambda: prom.series(f"ddpjob_trainer_step{{{sel}}} > 0"),
          timeout=600, desc=f"{FROZEN} taking its first steps")
    firing = _wait(real_cluster, stack,
                   lambda: prom.series(f'ALERTS{{alertname="DDPJobStalled", alertstate="firing", {sel}}}'),
                   timeout=wait_s + 120, desc=f"DDPJobStalled firing for {FROZEN} (for: {alert['for']})")
    assert firing[0]["metric"]["severity"] == "critical", firing
    # It fired for a rank that is still scraped and whose step has not moved for the whole pending
    # time; the training job next to it was never stalled.
    assert prom.series(f"changes(ddpjob_trainer_step{{{sel}}}[{alert['for']}]) == 0"), \
        prom.series(f"ddpjob_trainer_step{{{sel}}}[{alert['for']}]")
    assert not prom.series(f'count_over_time(ALERTS{{alertname="DDPJobStalled", ddpjob="{JOB}"}}[1h])')
    assert job_status(real_cluster, ns, FROZEN).get("phase") == "Running"
