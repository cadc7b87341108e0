#!/usr/bin/env python3
"""Operator cost at scale on the local control plane: the DDPJob operator vs Kubeflow's
training-operator v1.9.4 (PyTorchJob) at upstream defaults and tuned, in one run.

Scenarios (the same pod counts for every controller): 1 job x 64 nodes, 100 jobs x 8 nodes.
Each controller runs alone, freshly started for each scenario, serving only that scenario's
namespace; runs are interleaved (ours, default, tuned, ours, ...) when --repeat > 1.
Measured per run:
- seconds from the first create request until all pods exist / all are Running (kwok), from a
  label-free watch of the namespace (no polling LISTs that would load the API server);
- requests the controller sent per job, counted client-side by each controller itself:
  ours `ddpjob_operator_api_requests_total` (every request of our K8s facade: creates, deletes,
  status writes, events, our informers' lists and watches; kopf's own DDPJob list/watch is not
  counted, one of each per namespace), the peer client-go's `rest_client_requests_total` (every
  request, watches included). Server-side counting by user agent needs an audit log, which the
  local control plane does not write;
- API requests per minute and controller CPU-s per minute for the 100 jobs at rest (all Running),
  over --idle-seconds;
- controller CPU-s (utime+stime from /proc) for the scenario, RSS idle and after.
Pods land on extra fake nodes this script adds (and removes). Any operator here scrapes only a
closed loopback port (kwok pod IPs are fictitious). Prints medians [min-max] and our/tuned ratios;
writes bench/results/operator_scale.json. Not a test: nothing here asserts timings.

    .venv/bin/python bench/operator_scale.py [--scenarios 1x64,100x8] [--repeat 1] [--idle-seconds 60]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kubernetes import client  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

import kubeflow_peer  # noqa: E402
from ddpjob_operator.cluster.k8s import K8s  # noqa: E402
from tests.support.cluster import (create_namespace, delete_namespace, ensure_cluster,  # noqa: E402
                                   wait_crd_established, wait_for)

BENCH_LABEL = "kwok-bench"
BENCH_NODES = 4
PODS_PER_NODE = 250
TIMEOUT = 400
CLK_TCK = os.sysconf("SC_CLK_TCK")
VARIANTS = ("ddpjob", "pytorchjob-default", "pytorchjob-tuned")
ALL_VARIANTS = VARIANTS + ("ddpjob-before",)
# Bench pods only go to the bench nodes (taint + selector), away from concurrent test traffic.
PLACEMENT = {"nodeSelector": {"type": BENCH_LABEL},
             "tolerations": [{"key": "ddpjob.dev/bench", "operator": "Exists", "effect": "NoSchedule"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_nodes(core, *, create: bool) -> None:
    """Extra fake nodes (kwok manages nodes annotated kwok.x-k8s.io/node=fake)."""
    for i in range(BENCH_NODES):
        name = f"{BENCH_LABEL}-{i}"
        if not create:
            try:
                core.delete_node(name)
            except ApiException:
                pass
            continue
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                             "labels": {"type": BENCH_LABEL, "kubernetes.io/hostname": name}},
                "spec": {"taints": [{"key": "ddpjob.dev/bench", "value": "true", "effect": "NoSchedule"}]},
                "status": {"allocatable": {"cpu": "1000", "memory": "4Ti", "pods": str(PODS_PER_NODE)},
                           "capacity": {"cpu": "1000", "memory": "4Ti", "pods": str(PODS_PER_NODE)}}}
        try:
            core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
    if create:
        def ready() -> bool:
            nodes = core.list_node(label_selector=f"type={BENCH_LABEL}").items
            return len(nodes) == BENCH_NODES and all(
                any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or [])) for n in nodes)
        wait_for(ready, timeout=60, desc="bench nodes Ready")


def ddpjob(name: str, nodes: int) -> dict:
    # Up to PODS_PER_NODE pods of one job share a bench node, as the PyTorchJob peer's do.
    return {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
            "spec": {"image": "bench/trainer:1", "nodes": nodes, "scheduling": {**PLACEMENT, "onePodPerNode": False}}}


class PodTracker:
    """Watches a namespace's pods from a thread; records when `total` exist and are Running."""

    def __init__(self, k8s: K8s, ns: str, total: int, t0: float) -> None:
        self.k8s, self.path, self.total, self.t0 = k8s, f"/api/v1/namespaces/{ns}/pods", total, t0
        self.phases: dict[str, str] = {}
        self.exist_at: float | None = None
        self.running_at: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _see(self, etype: str, pod: dict) -> None:
        name = pod["metadata"]["name"]
        if etype == "DELETED":
            self.phases.pop(name, None)
            return
        self.phases[name] = (pod.get("status") or {}).get("phase") or "Pending"
        now = time.monotonic() - self.t0
        if self.exist_at is None and len(self.phases) >= self.total:
            self.exist_at = now
        if sum(ph in ("Running", "Succeeded") for ph in self.phases.values()) >= self.total:
            self.running_at = now
            self.done.set()

    def _run(self) -> None:
        items, rv = self.k8s.list_objects(self.path)
        for pod in items:
            self._see("ADDED", pod)
        while not self.done.is_set():
            for ev in self.k8s.watch(self.path, None, resource_version=rv, timeout=60):
                obj = ev.get("object") or {}
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    self._see(ev["type"], obj)
                if self.done.is_set():
                    return

    def wait(self) -> dict:
        self.done.wait(TIMEOUT)
        return {"all_pods_exist_s": _r(self.exist_at), "all_pods_running_s": _r(self.running_at)}


def _r(x: float | None, n: int = 2) -> float | None:
    return None if x is None else round(x, n)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


class Ours:
    """`ddpjob operator` serving one namespace, scraping only a closed loopback port; with
    `source`, the operator package from that directory (an older revision, for before/after)."""

    def __init__(self, cluster, ns: str, log_path: Path, *, source: Path | None = None) -> None:
        self.metrics_port, self.health_port = free_port(), free_port()
        env = cluster.env()
        if source is not None:
            env["PYTHONPATH"] = str(source / "operator")
        cmd = [sys.executable, "-m", "ddpjob_cli", "operator", "-n", ns, "--peering", "",
               "--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port),
               "--scrape-interval", "15", "--log-level", "WARNING",
               # kwok pod IPs are fictitious: scrape a closed loopback port instead (fails at once).
               "--scrape-url-template", f"http://127.0.0.1:{free_port()}/metrics"]
        self.log = open(log_path, "w")  # noqa: SIM115  (the child's for its lifetime)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd="/")
        self.pid = self.proc.pid

    def wait_ready(self) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        wait_for(healthy, timeout=60, desc="operator healthy")

    def requests(self) -> dict[str, float]:
        return kubeflow_peer.counter(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                     "ddpjob_operator_api_requests_total", "verb", "resource")

    def stop(self) -> None:
        kubeflow_peer.stop_process(self.proc)
        self.log.close()


_SERVER_RESOURCES = {"ddpjobs", "pytorchjobs", "services", "events", "pods"}


def server_requests(cluster) -> dict[str, float]:
    """The API server's apiserver_request_total for what controllers write or read, watches, pod
    status and binding (kwok, scheduler) excluded. Cluster-wide: concurrent test runs add noise."""
    text = cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels, value = line.rsplit(" ", 1)
        lab = dict(part.split("=", 1) for part in labels[len("apiserver_request_total{"):-1].split('",')
                   if "=" in part)
        lab = {k: v.strip('"') for k, v in lab.items()}
        if lab.get("verb") in ("WATCH", "CONNECT") or lab.get("resource") not in _SERVER_RESOURCES:
            continue
        if lab.get("subresource") and lab.get("resource") == "pods":
            continue
        key = f"{lab.get('verb')} {lab.get('resource')}" + (f"/{lab['subresource']}" if lab.get("subresource") else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def settle(ctrl, *, quiet: float = 3.0, limit: float = 30.0) -> dict[str, float]:
    """Wait until the controller sends nothing for `quiet` s (status writes trail the pods)."""
    last, since, deadline = ctrl.requests(), time.monotonic(), time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = ctrl.requests()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return last


def run_one(cluster, api, k8s: K8s, variant: str, jobs: int, nodes: int, *, idle_seconds: float,
            webhook_port: int, logs: Path, before_source: Path | None) -> dict:
    ns = create_namespace(api, prefix=f"bench-{variant[:3]}{'t' if variant.endswith('tuned') else ''}-")
    log_path = logs / f"{variant}-{jobs}x{nodes}.log"
    if variant.startswith("ddpjob"):
        ctrl = Ours(cluster, ns, log_path, source=before_source if variant == "ddpjob-before" else None)
    else:
        ctrl = kubeflow_peer.Peer(cluster, namespace=ns, tuned=variant.endswith("tuned"),
                                  metrics_port=free_port(), probe_port=free_port(),
                                  webhook_port=webhook_port, log_path=log_path)
    custom = client.CustomObjectsApi(api)
    try:
        ctrl.wait_ready()
        time.sleep(2)
        rss_idle, before, cpu0 = rss_mib(ctrl.pid), ctrl.requests(), cpu_seconds(ctrl.pid)
        server0 = server_requests(cluster)
        t0 = time.monotonic()
        tracker = PodTracker(k8s, ns, jobs * nodes, t0)
        for j in range(jobs):
            if variant.startswith("ddpjob"):
                custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", ddpjob(f"b{j}", nodes))
            else:
                custom.create_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs",
                                                       kubeflow_peer.pytorchjob(f"b{j}", nodes, PLACEMENT))
        times = tracker.wait()
        after = settle(ctrl) if before else (time.sleep(5) or {})
        cpu1 = cpu_seconds(ctrl.pid)
        delta = _delta(after, before)
        server = _delta(server_requests(cluster), server0)
        # The job creations are the bench's own requests, and the tracker's one pod LIST.
        server_ctrl = sum(v for k, v in server.items() if k not in ("POST ddpjobs", "POST pytorchjobs")) - 1
        res = {"variant": variant, "jobs": jobs, "nodes_per_job": nodes, **times,
               "requests": sum(delta.values()) if before else None,
               "requests_per_job": round(sum(delta.values()) / jobs, 1) if before else None,
               "request_breakdown": delta, "server_requests_per_job": round(server_ctrl / jobs, 1),
               "server_request_breakdown": server, "cpu_s": round(cpu1 - cpu0, 2),
               "rss_idle_mib": rss_idle, "rss_after_mib": rss_mib(ctrl.pid)}
        if idle_seconds > 0 and times["all_pods_running_s"] is not None:
            r0, c0, s0 = ctrl.requests(), cpu_seconds(ctrl.pid), server_requests(cluster)
            time.sleep(idle_seconds)
            idle = _delta(ctrl.requests(), r0)
            server_idle = _delta(server_requests(cluster), s0)
            res["idle_requests_per_min"] = round(sum(idle.values()) * 60 / idle_seconds, 1) if r0 else None
            res["idle_request_breakdown"] = idle
            res["idle_server_requests_per_min"] = round(sum(server_idle.values()) * 60 / idle_seconds, 1)
            res["idle_server_request_breakdown"] = server_idle
            res["idle_cpu_s_per_min"] = round((cpu_seconds(ctrl.pid) - c0) * 60 / idle_seconds, 3)
        return res
    finally:
        ctrl.stop()
        delete_namespace(api, ns, wait=True, timeout=300)


def summarize(values: list) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": round(statistics.median(vals), 3), "min": min(vals), "max": max(vals), "n": len(vals)}


ROWS = [  # (label, scenario, key)
    ("apply -> all pods created (s)", None, "all_pods_exist_s"),
    ("apply -> all Running (s)", None, "all_pods_running_s"),
    ("requests per job", None, "requests_per_job"),
    ("requests per job (server-side)", None, "server_requests_per_job"),
    ("controller CPU-s", None, "cpu_s"),
    ("RSS idle (MiB)", None, "rss_idle_mib"),
    ("RSS after (MiB)", None, "rss_after_mib"),
    ("at rest: API requests/min", "idle", "idle_requests_per_min"),
    ("at rest: requests/min (server)", "idle", "idle_server_requests_per_min"),
    ("at rest: CPU-s/min", "idle", "idle_cpu_s_per_min"),
]


def fmt(s: dict | None) -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:g}"
    return f"{s['median']:g} [{s['min']:g}-{s['max']:g}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="1x64,100x8", help="comma list of JOBSxNODES")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(ALL_VARIANTS)}")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="git revision whose operator runs as variant ddpjob-before (added to the variants)")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved runs per scenario and variant")
    ap.add_argument("--idle-seconds", type=float, default=60.0,
                    help="at-rest window after the largest scenario (0 = skip)")
    ap.add_argument("--out", default=str(REPO / "bench/results/operator_scale.json"))
    args = ap.parse_args()
    scenarios = [tuple(int(x) for x in s.split("x")) for s in args.scenarios.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(ALL_VARIANTS)
    if unknown:
        ap.error(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ALL_VARIANTS)}")
    before_source = None
    if args.before:
        before_source = Path(tempfile.mkdtemp(prefix="ddpjob-before-"))
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.before, "operator"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before_source)], input=archive, check=True)
        if "ddpjob-before" not in variants:
            variants.insert(0, "ddpjob-before")
    largest = max(scenarios, key=lambda s: s[0] * s[1])

    cluster = ensure_cluster()
    api = cluster.api()
    core = client.CoreV1Api(api)
    k8s = K8s(api=cluster.api())
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                    str(REPO / "charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml"))
    wait_crd_established(cluster, "ddpjobs.ddpjob.dev")
    webhook_port = free_port()
    if any(v.startswith("pytorchjob") for v in variants):
        kubeflow_peer.ensure_binary()
        kubeflow_peer.install(cluster, webhook_port=webhook_port)
    bench_nodes(core, create=True)
    logs = Path(tempfile.mkdtemp(prefix="operator-scale-"))
    runs: list[dict] = []
    try:
        for rep in range(args.repeat):
            for jobs, nodes in scenarios:
                for variant in variants:
                    idle = args.idle_seconds if (jobs, nodes) == largest else 0
                    res = run_one(cluster, api, k8s, variant, jobs, nodes, idle_seconds=idle,
                                  webhook_port=webhook_port, logs=logs, before_source=before_source)
                    res["repeat"] = rep
                    runs.append(res)
                    print(f"{variant:19s} {jobs:3d}x{nodes:<2d}: created {res['all_pods_exist_s']}s, running "
                          f"{res['all_pods_running_s']}s, {res['requests_per_job']} req/job "
                          f"({res['server_requests_per_job']} server-side), CPU {res['cpu_s']}s, "
                          f"RSS {res['rss_idle_mib']}/{res['rss_after_mib']} MiB"
                          + (f", at rest {res['idle_requests_per_min']} req/min {res['idle_cpu_s_per_min']} CPU-s/min"
                             if "idle_requests_per_min" in res else ""), flush=True)
    finally:
        bench_nodes(core, create=False)
        if any(v.startswith("pytorchjob") for v in variants):
            kubeflow_peer.uninstall(cluster)
        k8s.close()

    table: dict = {}
    lines = [f"{'':34s}" + "".join(f"{v:>26s}" for v in variants) + f"{'ours/tuned':>12s}"]
    for jobs, nodes in scenarios:
        for label, only, key in ROWS:
            if only == "idle" and (jobs, nodes) != largest:
                continue
            cells = {v: summarize([r.get(key) for r in runs if r["variant"] == v
                                   and (r["jobs"], r["nodes_per_job"]) == (jobs, nodes)]) for v in variants}
            ours, tuned = cells.get("ddpjob"), cells.get("pytorchjob-tuned")
            ratio = (round(ours["median"] / tuned["median"], 2)
                     if ours and tuned and tuned["median"] else None)
            table[f"{jobs}x{nodes} {label}"] = {**cells, "ratio_ours_tuned": ratio}
            lines.append(f"{f'{jobs}x{nodes} {label}':34s}" + "".join(f"{fmt(cells[v]):>26s}" for v in variants)
                         + f"{(ratio if ratio is not None else '-'):>12}")
    print("\n".join(lines))
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_avg_at_end": os.getloadavg()},
           "peer": f"kubeflow training-operator {kubeflow_peer.VERSION} (PyTorchJob); tuned = "
                   + " ".join(kubeflow_peer.TUNED_FLAGS),
           "request_counting": "client-side, each controller's own counter (see the module docstring)",
           "table": table, "runs": runs, "logs": str(logs),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out} (controller logs: {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
