"""Prometheus scrape configs for the real-pod tier, derived from the chart's own monitors.

A cluster with prometheus-operator turns the chart's PodMonitor (trainers) and ServiceMonitor (the
operator) into `kubernetes_sd_configs` scrape jobs. The host's Debian Prometheus has no
prometheus-operator, so this module does that translation from `helm template` output: a change to
the chart's monitors changes what the test scrapes, and the two cannot drift apart.

What the translation keeps of prometheus-operator's semantics: the label selector, the named
container port, path, interval, honorLabels, the endpoint's relabelings and metricRelabelings
(camelCase keys in the CRD, snake_case in Prometheus), and dropping pods that have finished. Two
narrowings a cluster run would not have: discovery is limited to the test's namespaces, and only
addresses on the real nodes' pod bridges (10.248.0.0/16, created by this run) are kept (the
workplace's network rule), or loopback where a test's PodDiscovery maps a kwok pod to a local process.

Debian's prometheus (bookworm, 2.42.0+ds) is built without the Kubernetes service discovery
(`kubernetes_sd_configs` is "field not found"): the package drops discovery plugins whose Go
dependencies Debian does not ship. With such a binary the same scrape jobs use `http_sd_configs`
pointed at `PodDiscovery`, a loopback endpoint that lists the API server's pods with exactly the
`__meta_kubernetes_pod_*` labels role pod gives them, so the relabel_configs stay identical. A
binary that has Kubernetes discovery gets `kubernetes_sd_configs` itself.
"""
from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from tests.e2e.test_dashboards import helm_template

# hack/nodes-up.sh: node i's pods get 10.248.<i>.0/24 on bridge ddpbr<i>.
REAL_POD_CIDR = ipaddress.ip_network("10.248.0.0/16")
_REAL_POD_ADDRESS = r"10\.248\.\d{1,3}\.\d{1,3}:\d+"
# A process on this machine standing in for a kwok pod's container (PodDiscovery's `address`).
LOOPBACK_ADDRESS = r"127\.0\.0\.1:\d+"

# PodMonitor/ServiceMonitor relabeling fields (monitoring.coreos.com/v1 RelabelConfig) -> Prometheus.
_RELABEL_KEYS = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
                 "regex": "regex", "replacement": "replacement", "action": "action", "modulus": "modulus"}


def _label(name: str) -> str:
    """A Kubernetes label name as kubernetes_sd spells it in __meta_* labels."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def relabel_config(r: dict, *, where: str) -> dict:
    """One CRD RelabelConfig as a Prometheus relabel_config; an unknown field is an error naming it."""
    unknown = set(r) - set(_RELABEL_KEYS)
    if unknown:
        raise ValueError(f"{where}: relabeling field(s) {sorted(unknown)} have no Prometheus translation here")
    out = {_RELABEL_KEYS[k]: v for k, v in r.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def _selector_rules(selector: dict, *, where: str) -> list[dict]:
    """A metav1.LabelSelector as keep/drop rules on the pod's labels (what prometheus-operator emits)."""
    rules = [{"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{_label(k)}"], "regex": re.escape(v)}
             for k, v in (selector.get("matchLabels") or {}).items()]
    for e in selector.get("matchExpressions") or []:
        key, op, values = _label(e["key"]), e["operator"], e.get("values") or []
        present, value = f"__meta_kubernetes_pod_labelpresent_{key}", f"__meta_kubernetes_pod_label_{key}"
        if op == "Exists":
            rules.append({"action": "keep", "source_labels": [present], "regex": "true"})
        elif op == "DoesNotExist":
            rules.append({"action": "drop", "source_labels": [present], "regex": "true"})
        elif op in ("In", "NotIn"):
            rules.append({"action": "keep" if op == "In" else "drop", "source_labels": [value],
                          "regex": "|".join(map(re.escape, values))})
        else:
            raise ValueError(f"{where}: selector operator {op!r} has no translation here")
    return rules


def has_kubernetes_sd(promtool: str, workdir: Path) -> bool:
    """Whether this Prometheus build knows `kubernetes_sd_configs` (its promtool parses the config)."""
    cfg = workdir / "k8s-sd-probe.yml"
    cfg.write_text(yaml.safe_dump({"scrape_configs": [
        {"job_name": "probe", "kubernetes_sd_configs": [{"role": "pod", "api_server": "https://127.0.0.1:1"}]}]}))
    out = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True, timeout=60)
    return out.returncode == 0


def pod_targets(pod, address=None) -> list[dict]:
    """What kubernetes_sd role pod discovers for one pod (a V1Pod): one target per declared container
    port, labelled with the pod's and the container's `__meta_kubernetes_pod_*` labels. `address`
    (pod, container port) -> "host:port" replaces the pod's IP (a kwok pod's is fictitious)."""
    meta, spec, status = pod.metadata, pod.spec, pod.status
    if not status.pod_ip:
        return []  # role pod skips pods without an address
    ready = next((c.status for c in status.conditions or [] if c.type == "Ready"), "unknown")
    base = {"__meta_kubernetes_namespace": meta.namespace, "__meta_kubernetes_pod_name": meta.name,
            "__meta_kubernetes_pod_ip": status.pod_ip, "__meta_kubernetes_pod_uid": meta.uid,
            "__meta_kubernetes_pod_node_name": spec.node_name or "", "__meta_kubernetes_pod_host_ip": status.host_ip or "",
            "__meta_kubernetes_pod_phase": status.phase or "", "__meta_kubernetes_pod_ready": ready.lower()}
    for kind, items in (("label", meta.labels), ("annotation", meta.annotations)):
        for k, v in (items or {}).items():
            base[f"__meta_kubernetes_pod_{kind}_{_label(k)}"] = v
            base[f"__meta_kubernetes_pod_{kind}present_{_label(k)}"] = "true"
    out = []
    for c in spec.containers:
        for p in c.ports or []:
            target = address(pod, p.container_port) if address else f"{status.pod_ip}:{p.container_port}"
            out.append({"targets": [target], "labels": {
                **base, "__meta_kubernetes_pod_container_name": c.name,
                "__meta_kubernetes_pod_container_image": c.image or "",
                "__meta_kubernetes_pod_container_port_name": p.name or "",
                "__meta_kubernetes_pod_container_port_number": str(p.container_port),
                "__meta_kubernetes_pod_container_port_protocol": p.protocol or "TCP",
                "__meta_kubernetes_pod_container_init": "false"}})
    return out


class PodDiscovery:
    """Loopback http_sd endpoint: GET /<namespace> lists that namespace's pods as role pod would
    (`address` as in pod_targets)."""

    def __init__(self, api, address=None):
        from kubernetes import client

        core = client.CoreV1Api(api)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # http.server's name
                ns = self.path.strip("/")
                groups = [g for pod in core.list_namespaced_pod(ns).items for g in pod_targets(pod, address)]
                body = json.dumps(groups).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # Prometheus asks every refresh: keep the test log quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _sd_configs(*, namespaces: list[str], kubeconfig: Path, discovery: PodDiscovery | None, interval: str) -> dict:
    if discovery is None:
        return {"kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig),
                                           "namespaces": {"names": list(namespaces)}}]}
    return {"http_sd_configs": [{"url": f"{discovery.url}/{ns}", "refresh_interval": interval} for ns in namespaces]}


def _endpoint_job(*, job_name: str, selector: dict, endpoint: dict, namespaces: list[str],
                  kubeconfig: Path, discovery: PodDiscovery | None, address_regex: str, where: str) -> dict:
    interval = endpoint.get("interval") or "15s"
    relabel = [
        # Pods that finished keep their IP for a while; prometheus-operator never scrapes them.
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        *_selector_rules(selector, where=where),
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
         "regex": re.escape(endpoint["port"])},
        # The network rule: nothing but this run's pod bridges (or loopback stand-ins), whatever the cluster holds.
        {"action": "keep", "source_labels": ["__address__"], "regex": address_regex},
        *[relabel_config(r, where=where) for r in endpoint.get("relabelings") or []],
    ]
    return {
        "job_name": job_name,
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "metrics_path": endpoint.get("path") or "/metrics",
        "scrape_interval": interval,
        "scrape_timeout": interval,
        **_sd_configs(namespaces=namespaces, kubeconfig=kubeconfig, discovery=discovery, interval=interval),
        "relabel_configs": relabel,
        "metric_relabel_configs": [relabel_config(r, where=where) for r in endpoint.get("metricRelabelings") or []],
    }


def chart_scrape_configs(*, release: str, operator_namespace: str, job_namespaces: list[str],
                         kubeconfig: Path, interval: str, discovery: PodDiscovery | None = None,
                         address_regex: str = _REAL_POD_ADDRESS) -> list[dict]:
    """Scrape jobs for the chart's PodMonitor (training pods in `job_namespaces`) and ServiceMonitor
    (the operator of release `release`, whose selector is the Service's, i.e. the operator pods'
    labels), rendered with `helm template` and the monitors switched on at `interval`. Discovery is
`kubernetes_sd_configs` unless `discovery` (a PodDiscovery) stands in for it; only addresses matching
    `address_regex` are scraped (this run's pod bridges unless a test's discovery maps to loopback)."""
    docs = helm_template("monitoring.podMonitor.enabled=true", "monitoring.serviceMonitor.enabled=true",
                         f"monitoring.podMonitor.interval={interval}",
                         f"monitoring.serviceMonitor.interval={interval}")
    pm = next(d for d in docs if d["kind"] == "PodMonitor")
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    # `helm template` (tests/e2e/test_dashboards.helm_template) names its release "t"; ours is `release`.
    sm_selector = {"matchLabels": {**sm["spec"]["selector"]["matchLabels"], "app.kubernetes.io/instance": release}}
    jobs = [_endpoint_job(job_name=f"podMonitor/{pm['metadata']['name']}/{i}", selector=pm["spec"]["selector"],
                          endpoint=ep, namespaces=job_namespaces, kubeconfig=kubeconfig, discovery=discovery,
                          address_regex=address_regex, where=f"PodMonitor {pm['metadata']['name']}")
            for i, ep in enumerate(pm["spec"]["podMetricsEndpoints"])]
    jobs += [_endpoint_job(job_name=f"serviceMonitor/{sm['metadata']['name']}/{i}", selector=sm_selector,
                           endpoint=ep, namespaces=[operator_namespace], kubeconfig=kubeconfig, discovery=discovery,
                           address_regex=address_regex, where=f"ServiceMonitor {sm['metadata']['name']}")
             for i, ep in enumerate(sm["spec"]["endpoints"])]
    return jobs


def query_at(prom, expr: str, at: float) -> list[dict]:
    """Instant query evaluated at unix time `at` (the dashboard as it looked then)."""
    body = prom.api("query", query=expr, time=f"{at:.3f}")
    assert body.get("status") == "success", f"query failed: {expr}\n{body.get('error')}"
    return body["data"]["result"]


def active_targets(prom) -> list[dict]:
    return prom.api("targets", state="active")["data"]["activeTargets"]


def assert_only_real_pod_targets(prom) -> None:
    """Every target Prometheus scrapes is on this run's pod bridges (never kwok's or anyone's)."""
    for t in active_targets(prom):
        host = urlsplit(t["scrapeUrl"]).hostname or ""
        assert ipaddress.ip_address(host) in REAL_POD_CIDR, f"target outside {REAL_POD_CIDR}: {t['scrapeUrl']}"


def targets_report(prom) -> str:
    """The targets page as JSON (active: labels, health, last error), for failure messages."""
    short = [{k: t.get(k) for k in ("scrapePool", "scrapeUrl", "health", "lastError", "labels")}
             for t in active_targets(prom)]
    return "--- prometheus targets ---\n" + json.dumps(short, indent=1)
