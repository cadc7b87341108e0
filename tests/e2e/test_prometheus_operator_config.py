"""The program that reads the chart's monitors reads them: a real prometheus-operator (built by
`hack/build.sh prometheus-operator`, version in hack/versions.env) runs against the control plane,
is given the chart's PodMonitor, ServiceMonitor and PrometheusRule (`helm template`, monitoring
on) and a Prometheus object, and writes that Prometheus's configuration. Asserted on what it
wrote: the trainers' scrape job takes namespace, ddpjob and node_rank from the pod's metadata with
honor_labels off (the last rule that writes each label reads a __meta_kubernetes_ label), the
chart's relabelings are there as tests/realpods/promkit.py translates them (so the real-pod tier's
translation cannot drift from the real one), the operator's own Service is scraped, the rule file
holds the chart's groups and alerts unchanged, and the host's Prometheus loads that rule file.

The Prometheus object has no replicas (no pods to run: the configuration Secret and rule
ConfigMap are what is checked) and names the host Prometheus's version, so the configuration is
the one prometheus-operator would give that binary. That binary (Debian's) has no Kubernetes
discovery, so the scrape configuration itself is checked here rather than loaded;
tests/e2e/test_monitor_labels.py runs the same relabelings in a real Prometheus. The
monitoring.coreos.com CRDs stay installed afterward: no other test minds them, and a rerun's apply
is then quick.
"""
from __future__ import annotations

import base64
import gzip
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.e2e.test_dashboards import helm_template
from tests.e2e.test_prometheus import Prometheus, ensure_prometheus
from tests.e2e.test_prometheus import _stop as stop
from tests.realpods.promkit import relabel_config
from tests.support.cluster import REPO_ROOT, wait_crd_established, wait_for

MONITORING = ("monitoring.podMonitor.enabled=true", "monitoring.serviceMonitor.enabled=true",
              "monitoring.prometheusRule.enabled=true")
PROMETHEUS = "p"
META = "__meta_kubernetes_"


def prometheus_operator_dir() -> Path:
    """Where hack/build.sh caches the pinned prometheus-operator and its CRDs."""
    versions = dict(line.split("=", 1) for line in (REPO_ROOT / "hack" / "versions.env").read_text().splitlines()
                    if re.match(r"^[A-Z_]+=", line))
    cache = Path(os.environ.get("DDPJOB_CACHE") or Path.home() / ".cache" / "ddpjob")
    return cache / "bin" / f"prometheus-operator-{versions['PROMETHEUS_OPERATOR_VERSION']}"


def client_files(kubeconfig: Path, into: Path) -> tuple[str, list[str]]:
    """(API server URL, prometheus-operator's TLS flags) for the kubeconfig's identity: it takes
    no kubeconfig, only an address and certificate files."""
    cfg = yaml.safe_load(kubeconfig.read_text())
    ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == cfg["current-context"])
    cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
    user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
    flags = []
    for flag, where, key in (("--ca-file", cluster, "certificate-authority"), ("--cert-file", user, "client-certificate"),
                             ("--key-file", user, "client-key")):
        if f"{key}-data" in where:
            path = into / f"{key}.pem"
            path.write_bytes(base64.b64decode(where[f"{key}-data"]))
            path.chmod(0o600)
        else:
            path = Path(where[key]) if Path(where[key]).is_absolute() else kubeconfig.parent / where[key]
        flags.append(f"{flag}={path}")
    return cluster["server"], flags


def prometheus_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    return "v" + re.search(r"version (\d+\.\d+\.\d+)", out.stdout + out.stderr).group(1)


def last_writer(relabel_configs: list[dict], label: str) -> dict:
    """The relabel rule that decides `label` (the last one that writes it)."""
    writers = [r for r in relabel_configs if r.get("target_label") == label]
    assert writers, f"no relabel rule writes {label}: {relabel_configs}"
    return writers[-1]


@pytest.fixture(scope="module")
def prometheus_operator() -> Path:
    """The pinned prometheus-operator's folder, built when missing. `make test` builds it beside the
    tiers (hack/test.sh: off the set-up's critical path), so this may wait for that build (its lock)."""
    build = subprocess.run([str(REPO_ROOT / "hack" / "build.sh"), "prometheus-operator"], capture_output=True,
                           text=True, timeout=1800)
    assert build.returncode == 0, f"hack/build.sh prometheus-operator failed:\n{build.stderr[-3000:]}"
    op_dir = prometheus_operator_dir()
    assert (op_dir / "prometheus-operator").exists(), (op_dir, build.stderr[-2000:])
    return op_dir


@pytest.fixture
def rendered(cluster, api, namespace, tmp_path, prometheus_operator):
    """(the chart's monitoring objects, prometheus.yaml, {rule file: text}) as prometheus-operator wrote them."""
    op_dir = prometheus_operator
    prom_bin, _ = ensure_prometheus()
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(op_dir / "crds"), timeout=120)
    for plural in ("prometheuses", "podmonitors", "servicemonitors", "prometheusrules"):
        wait_crd_established(cluster, f"{plural}.monitoring.coreos.com")

    objects = {d["kind"]: d for d in helm_template(*MONITORING)
               if d["kind"] in ("PodMonitor", "ServiceMonitor", "PrometheusRule")}
    assert set(objects) == {"PodMonitor", "ServiceMonitor", "PrometheusRule"}, set(objects)
    custom = client.CustomObjectsApi(api)
    for obj in objects.values():
        obj["metadata"]["namespace"] = namespace
        custom.create_namespaced_custom_object("monitoring.coreos.com", "v1", namespace,
                                               obj["kind"].lower() + "s", obj)
    everything = {"matchLabels": {}}
    custom.create_namespaced_custom_object("monitoring.coreos.com", "v1", namespace, "prometheuses", {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus",
        "metadata": {"name": PROMETHEUS, "namespace": namespace},
        "spec": {"replicas": 0, "version": prometheus_version(prom_bin),
                 "podMonitorSelector": everything, "serviceMonitorSelector": everything, "ruleSelector": everything}})

    server, tls = client_files(Path(cluster.kubeconfig), tmp_path)
    log_path = tmp_path / "prometheus-operator.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(op_dir / "prometheus-operator"), f"--apiserver={server}", *tls,
                                 f"--namespaces={namespace}", "--web.listen-address=127.0.0.1:0"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    core = client.CoreV1Api(api)

    def read(kind: str, name: str):
        if proc.poll() is not None:
            raise AssertionError(f"prometheus-operator exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            return getattr(core, f"read_namespaced_{kind}")(name, namespace)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    try:
        # Written once every selected monitor and rule is in: its annotations name what it holds.
        secret = wait_for(lambda: read("secret", f"prometheus-{PROMETHEUS}"), timeout=90,
                          desc=f"prometheus-operator's config Secret\n{log_path.read_text()[-3000:]}")
        config = yaml.safe_load(gzip.decompress(base64.b64decode(secret.data["prometheus.yaml.gz"])))
        rule_cm = wait_for(lambda: read("config_map", f"prometheus-{PROMETHEUS}-rulefiles-0"), timeout=60,
                           desc=f"prometheus-operator's rule ConfigMap\n{log_path.read_text()[-3000:]}")
        yield objects, config, dict(rule_cm.data)
    finally:
        stop(proc)


def test_prometheus_operator_turns_the_chart_monitors_into_prometheus_config(rendered, namespace, tmp_path):
    objects, config, rule_files = rendered
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    pm, sm = objects["PodMonitor"], objects["ServiceMonitor"]

    trainers = jobs.get(f"podMonitor/{namespace}/{pm['metadata']['name']}/0")
    assert trainers is not None, sorted(jobs)
    assert trainers["honor_labels"] is False, trainers
    assert trainers.get("kubernetes_sd_configs") and trainers["kubernetes_sd_configs"][0]["role"] == "pod", trainers
    relabel = trainers["relabel_configs"]
    # Whose series these are comes from the pod's metadata, whatever the pod reports.
    for label in ("namespace", "ddpjob", "node_rank", "pod"):
        rule = last_writer(relabel, label)
        assert rule.get("action", "replace") == "replace" and rule["source_labels"], rule
        assert all(s.startswith(META) for s in rule["source_labels"]), (label, rule)
    # The chart's relabelings, in order, as promkit translates them for the real-pod tier (its
    # keys: the operator spells out action: replace where the chart leaves the default).
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    ours = [relabel_config(r, where="PodMonitor") for r in endpoint["relabelings"]]
    starts = [i for i in range(len(relabel) - len(ours) + 1)
              if [{k: r.get(k) for k in o} for r, o in zip(relabel[i:], ours)] == ours]
    assert starts, f"the chart's relabelings {ours} are not in {relabel}"
    assert trainers["metric_relabel_configs"][-1] == {
        "action": "labeldrop", "regex": endpoint["metricRelabelings"][0]["regex"]}, trainers["metric_relabel_configs"]
    # Training pods only (the chart's selector), their named port, in every namespace.
    (expr,) = pm["spec"]["selector"]["matchExpressions"]
    assert (expr["operator"], expr["key"]) == ("Exists", "ddpjob.dev/job-name"), expr
    assert {"action": "keep", "source_labels": [f"{META}pod_labelpresent_ddpjob_dev_job_name"], "regex": "true"} \
        in relabel, relabel
    assert {"action": "keep", "source_labels": [f"{META}pod_container_port_name"], "regex": endpoint["port"]} \
        in relabel, relabel
    assert "namespaces" not in trainers["kubernetes_sd_configs"][0], trainers

    # The operator's own Service: its release's, in its namespace; its labels trusted (servicemonitor.yaml).
    operator = jobs.get(f"serviceMonitor/{namespace}/{sm['metadata']['name']}/0")
    assert operator is not None, sorted(jobs)
    assert operator["honor_labels"] is True, operator
    assert operator["kubernetes_sd_configs"][0]["namespaces"]["names"] == sm["spec"]["namespaceSelector"]["matchNames"]
    for key, value in sm["spec"]["selector"]["matchLabels"].items():
        label = re.sub(r"[^a-zA-Z0-9_]", "_", key)
        assert {"action": "keep", "regex": f"({value});true", "source_labels": [
            f"{META}service_label_{label}", f"{META}service_labelpresent_{label}"]} in operator["relabel_configs"], key

    # The rule file holds the chart's groups unchanged, and a real Prometheus loads it.
    (name, text), = rule_files.items()
    assert yaml.safe_load(text)["groups"] == objects["PrometheusRule"]["spec"]["groups"]
    path = tmp_path / name
    path.write_text(text)
    prom = Prometheus(ensure_prometheus()[0], tmp_path / "prom", targets={}, rule_files=[path])
    try:
        loaded = prom.api("rules")["data"]["groups"]
    finally:
        prom.stop()
    want = {(g["name"], r.get("alert") or r.get("record")) for g in objects["PrometheusRule"]["spec"]["groups"]
            for r in g["rules"]}
    assert {(g["name"], r["name"]) for g in loaded for r in g["rules"]} == want
    assert any(r.get("alert") for g in objects["PrometheusRule"]["spec"]["groups"] for r in g["rules"])
