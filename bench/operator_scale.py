#!/usr/bin/env python3
"""Operator cost at scale on the local control plane: the DDPJob operator vs Kubeflow's
training-operator v1.9.4 (PyTorchJob) at upstream defaults and tuned, in one run.

Scenarios (the same pod counts for every controller): 1 job x 64 nodes, 100 jobs x 8 nodes, and
(bounded: --scenarios 1000x10, 5000x10) 10,000 and 50,000 pods. Each controller runs alone, freshly started for each run,
serving only that run's namespace. Every cell is --repeat runs (default 3), interleaved: each repeat
runs every scenario with every variant, the variants' order rotating from one repeat to the next.
Variant `floor` has no controller: the script creates the very pods our operator would (render_pod),
FLOOR_IN_FLIGHT at a time, so its times are what this machine's control plane allows any controller.
Measured per run:
- seconds from the first create request until all pods exist / all are Running (kwok), from a
  label-free watch of the namespace (no polling LISTs that would load the API server);
- requests the controller sent, counted client-side by each controller itself (not the API
  server's total, which counts everyone's requests): ours `ddpjob_operator_api_requests_total`
  (every request of our K8s facade: creates, deletes, status writes, events, our informers' lists
  and watches; kopf's own DDPJob list/watch is not counted, one of each per namespace), the peer
  client-go's `rest_client_requests_total` (every request, watches included);
- controller CPU-s (utime+stime from /proc) and RSS (idle before, after);
- at rest (--rest scenarios, default 100x8; --ranks-per-pod ranks behind each pod's endpoint), over --idle-seconds each: (a) every job Running with
  its ranks' metrics served on loopback by this script (an exposition whose steps advance, so
  our operator scrapes, computes progress and writes status at its progress interval; kwok pod
  addresses are fictitious and never contacted), (b) every job finished (kwok ends the pods with
  exit code 0): requests/min, status writes per job per minute, CPU-s/min.
The load average is recorded before and after each run; a run that saw a 1-minute load above
--max-load (default: the CPU count) is flagged `loaded`, and the table says how many were.
Cells are medians [min-max] over the repeats; ours/tuned is the geometric mean of the per-repeat
ratios with its 95 % interval (bench/stats.py). Writes bench/results/operator_scale.json.
Not a test: nothing here asserts timings.

    .venv/bin/python bench/operator_scale.py [--scenarios 1x64,100x8] [--repeat 3] [--idle-seconds 60]
"""
from __future__ import annotations

import argparse
import http.server
import math
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import urllib3  # noqa: E402
from kubernetes import client  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

import goprof  # noqa: E402
import kubeflow_peer  # noqa: E402
import pyspy  # noqa: E402
import stats  # noqa: E402
from provenance import Provenance  # noqa: E402
from ddpjob_api.spec import from_manifest  # noqa: E402
from ddpjob_api import labels  # noqa: E402
from ddpjob_api.contract import STAGES  # noqa: E402
from ddpjob_operator.builders.pods import render_pod  # noqa: E402
from ddpjob_operator.builders.service import render_service  # noqa: E402
from ddpjob_operator.cluster.k8s import K8s  # noqa: E402
from ddpjob_trainer.telemetry import STEP_BUCKETS  # noqa: E402
from tests.support.cluster import (create_namespace, delete_namespace, ensure_cluster,  # noqa: E402
                                   set_pod_exit, wait_crd_established, wait_for)

BENCH_LABEL = "kwok-bench"
PODS_PER_NODE = 500
# Default seconds for one scenario's pods to be Running (--running-timeout). 400 s cut two of
# ours' six runs at 1,000 jobs of 10 on a slower machine (6202dc2), and one of three after 5529768
# (9,467 Running); a run cut short has no all-Running time, so no ratio.
TIMEOUT = 600
MAX_PODS = 50_000        # the largest scenario this script runs (only on its own kwok nodes: 100 of them)
FINISH_TIMEOUT = 300
CLK_TCK = os.sysconf("SC_CLK_TCK")
VARIANTS = ("ddpjob", "pytorchjob-default", "pytorchjob-tuned")
# "floor": no controller. This script creates our very pods itself (render_pod, no owner),
# FLOOR_IN_FLIGHT at a time, as fast as the control plane takes them: what this machine's API
# server, scheduler and kwok allow any controller.
# "floor-svc": the floor's pods and one headless Service per job beside them, as our operator makes
# them (render_service); "floor-nssvc": one headless Service per namespace selecting every pod of
# the run (the cheaper DNS arrangement: `<job>-<rank>.<that service>.<ns>.svc`). Their control
# plane CPU against the floor's is what a job's Service costs kube-controller-manager.
ALL_VARIANTS = VARIANTS + ("ddpjob-before", "floor", "floor-svc", "floor-nssvc")
FLOOR_IN_FLIGHT = 64
NS_SERVICE = "ddpjob-pods"
# A bench namespace names a tenant profile no chart defines: the default (baseline) tenant policy of
# a chart that a test installs meanwhile on the shared control plane binds only namespaces without
# one, and would refuse the bench's tolerations.
BENCH_NAMESPACE_LABELS = {"ddpjob.dev/tenant-profile": "bench-none"}
# Bench pods only go to the bench nodes (taint + selector), away from concurrent test traffic.
PLACEMENT = {"nodeSelector": {"type": BENCH_LABEL},
             "tolerations": [{"key": "ddpjob.dev/bench", "operator": "Exists", "effect": "NoSchedule"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_nodes(core, count: int, *, create: bool) -> None:
    """Extra fake nodes (kwok manages nodes annotated kwok.x-k8s.io/node=fake). Refuses to create
    them over existing ones: another bench is running on this cluster, and its cleanup would delete
    this run's nodes under it (its pods then Pending for good), or one was killed before its own."""
    if create:
        left = core.list_node(label_selector=f"type={BENCH_LABEL}", limit=1).items
        if left:
            raise RuntimeError(f"bench nodes exist ({left[0].metadata.name}, ...): another bench is running on this "
                               f"cluster, or one stopped before its cleanup (then: kubectl delete node -l type={BENCH_LABEL})")
    for i in range(count):
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
            return len(nodes) == count and all(
                any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or [])) for n in nodes)
        wait_for(ready, timeout=60, desc="bench nodes Ready")


class WriteTracker:
    """Watches a namespace's DDPJobs from a thread and sorts each job's status writes: those up to
    and including the one that makes it Running (what the job cost to come up: the goal of at most
    2) and those after it (a Running job's progress at its interval, what `at_rest` measures). The
    client-side counter counts the same writes without telling whose or when: in the window until
    every pod runs, jobs that ran early had written their first progress, and more."""

    def __init__(self, k8s: K8s, ns: str) -> None:
        self.k8s, self.path = k8s, f"/apis/ddpjob.dev/v1alpha1/namespaces/{ns}/ddpjobs"
        self.status: dict[str, dict] = {}
        self.coming_up: dict[str, int] = {}
        self.after: dict[str, int] = {}
        self.running: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _see(self, job: dict) -> None:
        name, status = job["metadata"]["name"], job.get("status") or {}
        if status == self.status.get(name, {}):
            return  # metadata or spec: not a status write
        self.status[name] = status
        book = self.after if name in self.running else self.coming_up
        book[name] = book.get(name, 0) + 1
        if status.get("phase") == "Running":
            self.running.add(name)

    def _run(self) -> None:
        _, rv = self.k8s.list_objects(self.path)  # before the first job is submitted
        while not self.stop.is_set():
            for ev in self.k8s.watch(self.path, None, resource_version=rv, timeout=30):
                obj = ev.get("object") or {}
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                if ev.get("type") == "MODIFIED":
                    self._see(obj)
                if self.stop.is_set():
                    return

    def result(self, jobs: int) -> dict:
        self.stop.set()
        ups = [self.coming_up.get(name, 0) for name in self.status]
        return {"status_writes_coming_up_per_job": round(sum(ups) / jobs, 2),
                "status_writes_coming_up_max": max(ups, default=0),
                "status_writes_after_running_per_job": round(sum(self.after.values()) / jobs, 2),
                "jobs_seen_running": len(self.running)}


def ddpjob(name: str, nodes: int) -> dict:
    # Up to PODS_PER_NODE pods of one job share a bench node, as the PyTorchJob peer's do.
    return {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
            "spec": {"image": "bench/trainer:1", "nodes": nodes, "scheduling": {**PLACEMENT, "onePodPerNode": False}}}


class PodTracker:
    """Watches a namespace's pods from a thread; records when `total` exist and are Running."""

    def __init__(self, k8s: K8s, ns: str, total: int, t0: float) -> None:
        self.k8s, self.path, self.total, self.t0 = k8s, f"/api/v1/namespaces/{ns}/pods", total, t0
        self.phases: dict[str, str] = {}
        # When each pod was first seen, first seen bound to a node, first seen Running: which step of
        # the come-up a slower run loses (the scheduler binds at its client's 50 requests/s).
        self.seen: dict[str, list[float | None]] = {}
        self.unschedulable: set[str] = set()
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
        status = pod.get("status") or {}
        self.phases[name] = phase = status.get("phase") or "Pending"
        now = time.monotonic() - self.t0
        seen = self.seen.setdefault(name, [now, None, None])
        if seen[1] is None and (pod.get("spec") or {}).get("nodeName"):
            seen[1] = now
        if seen[2] is None and phase in ("Running", "Succeeded"):
            seen[2] = now
        if any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in status.get("conditions") or ()):
            self.unschedulable.add(name)
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

    def wait(self, timeout: float = TIMEOUT) -> dict:
        self.done.wait(timeout)
        out: dict = {"all_pods_exist_s": _r(self.exist_at), "all_pods_running_s": _r(self.running_at),
                     "come_up": self.come_up(), "pods_ever_unschedulable": len(self.unschedulable)}
        if self.running_at is None:  # how far it got
            phases = list(self.phases.values())
            out["at_timeout"] = {"seconds": timeout, "pods": len(phases),
                                 "running": sum(ph in ("Running", "Succeeded") for ph in phases)}
        return out

    COME_UP_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)

    def come_up(self) -> dict:
        """Seconds until each fraction of the pods existed, was bound, was Running; and the rate (pods/s)
        of each step between 10 % and 90 % of the pods."""
        out: dict = {}
        for step, label in enumerate(("created", "scheduled", "running")):
            times = sorted(t[step] for t in self.seen.values() if t[step] is not None)
            at = {f: times[math.ceil(f * self.total) - 1] if len(times) >= math.ceil(f * self.total) else None
                  for f in self.COME_UP_FRACTIONS}
            out[label] = {f"p{round(f * 100)}_s": _r(t) for f, t in at.items()}
            if at[0.1] is not None and at[0.9] is not None and at[0.9] > at[0.1]:
                out[label]["per_s_p10_p90"] = _r(0.8 * self.total / (at[0.9] - at[0.1]), 1)
        return out


class FakeRanks:
    """The ranks' metrics endpoints, served on loopback by this script: our operator's scrape URL
    template points here (`/{namespace}/{job}/{pod's node rank}`), never at a kwok pod's address.
    Each pod serves `ranks_per_pod` ranks with a trainer's series (the step-time histogram's buckets
    and every stage's line included, as the real exposition has: docs/health.md). Steps advance
    with time, so every scrape finds new progress, as a training job's does. HTTP/1.1 keep-alive."""

    def __init__(self, ranks_per_pod: int = 1) -> None:
        t0 = time.time()
        per_pod = ranks_per_pod

        def rank_lines(job: str, ns: str, node: int, local: int, now: float) -> str:
            rank = node * per_pod + local
            step = int((now - t0) * 2)
            lab = f'ddpjob="{job}",namespace="{ns}",rank="{rank}",local_rank="{local}",node_rank="{node}"'
            lines = [f"ddpjob_trainer_{k}{{{lab}}} {v}\n" for k, v in (
                ("step", step), ("step_started", step + 1), ("epoch", step // 100), ("total_steps", 10_000_000),
                ("loss", 1 / (1 + step)), ("samples_total", 32 * step), ("data_wait_seconds_total", 0.01 * step),
                ("step_seconds_sum", 0.5 * step), ("step_seconds_count", step), ("restart_count", 0),
                ("last_step_timestamp_seconds", now), ("first_step_timestamp_seconds", t0),
                ("stage_start_timestamp_seconds", t0))]
            lines += [f'ddpjob_trainer_step_seconds_bucket{{{lab},le="{le}"}} {step if le != 0.25 else 0}\n'
                      for le in STEP_BUCKETS] + [f'ddpjob_trainer_step_seconds_bucket{{{lab},le="+Inf"}} {step}\n']
            lines += [f'ddpjob_trainer_stage{{{lab},stage="{st}"}} {int(st == "training")}\n' for st in STAGES]
            return "".join(lines)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                ns, job, node = (parts + ["", "", "0"])[:3]
                now = time.time()
                data = "".join(rank_lines(job, ns, int(node), local, now) for local in range(per_pod)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a scraper closing its kept-alive connection (operator exit) is no news

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def template(self) -> str:
        return f"http://127.0.0.1:{self.port}/{{namespace}}/{{job}}/{{rank}}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _r(x: float | None, n: int = 2) -> float | None:
    return None if x is None else round(x, n)


def cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def control_plane_cpu(cluster) -> dict[str, float]:
    """CPU-s so far of this cluster's kube-apiserver, kube-controller-manager, etcd, kube-scheduler and
    kwok (their command lines name its state directory; every process of a kind summed: a stale standby counts too)."""
    state = f"{Path(cluster.kubeconfig).resolve().parent}/"
    out: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not any(a.startswith(state) for a in argv):
            continue
        if Path(argv[0]).name == "kube-scheduler" and "--config" in argv:
            continue  # the second scheduler (scheduler-plugins'), not kube-scheduler
        kind = {"kube-apiserver": "apiserver", "kube-controller-manager": "controller_manager",
                "etcd": "etcd", "kube-scheduler": "scheduler", "kwok": "kwok"}.get(Path(argv[0]).name)
        if kind:
            try:
                out[kind] = out.get(kind, 0.0) + cpu_seconds(int(proc.name))
            except OSError:
                pass
    return out


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


# The packages an operator process imports (`python -m ddpjob_cli operator`); a revision from before
# the API's own package (api/) simply has none.
OPERATOR_PACKAGES = ("operator", "api", "cli", "trainer")


def operator_at(rev: str) -> Path:
    """The packages the operator runs from at git revision `rev` (OPERATOR_PACKAGES that it has),
    exported into a new temporary directory (for Ours(source=...): the operator before a change,
    run beside the one after it, with the CLI and API of its own revision, not of this tree)."""
    source = Path(tempfile.mkdtemp(prefix="ddpjob-before-"))
    tree = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", rev], capture_output=True, text=True,
                          check=True).stdout.split()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, *[p for p in OPERATOR_PACKAGES if p in tree]],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    return source


class Ours:
    """`ddpjob operator` serving one namespace, scraping only loopback (`scrape_url`); with
    `source`, the operator package from that directory (an older revision, for before/after;
    default this checkout's).
    Its progress interval is the operator's default. `wrapper`: a script (and its arguments) that
    runs the operator's module itself (bench/pymem.py); `extra_env`: variables set for it alone
    (an allocator setting under test)."""

    def __init__(self, cluster, ns: str, log_path: Path, *, scrape_url: str, source: Path | None = None,
                 wrapper: tuple[str, ...] = (), extra_env: dict[str, str] | None = None) -> None:
        self.metrics_port, self.health_port = free_port(), free_port()
        env = {**cluster.env(), **(extra_env or {})}
        # This checkout's packages by default, not whatever the interpreter has installed: a
        # worktree's bench run with the main checkout's editable venv measured the main checkout.
        source = source or REPO
        env["PYTHONPATH"] = os.pathsep.join(str(source / p) for p in OPERATOR_PACKAGES if (source / p).is_dir())
        cmd = [sys.executable, *wrapper, "-m", "ddpjob_cli", "operator", "-n", ns, "--peering", "",
               "--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port),
               "--scrape-interval", "15", "--log-level", "WARNING",
               # kwok pod IPs are fictitious: scrape loopback (FakeRanks, or a closed port) instead.
               "--scrape-url-template", scrape_url]
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

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def requests(self) -> dict[str, float]:
        return kubeflow_peer.counter(self.metrics_url, "ddpjob_operator_api_requests_total", "verb", "resource")

    def passes(self) -> float:
        """Reconcile passes run so far (every job's, with their writes or none)."""
        return kubeflow_peer.counter(self.metrics_url, "ddpjob_operator_reconcile_seconds_count").get("", 0.0)

    def stop(self) -> None:
        kubeflow_peer.stop_process(self.proc)
        self.log.close()


class Floor:
    """The floor variant's stand-in for a controller: a thread that creates every pod of the
    run's jobs, FLOOR_IN_FLIGHT requests in flight. No process of its own: no CPU or RSS."""

    pid = None

    def __init__(self, api, ns: str) -> None:
        self.core, self.ns, self.created = client.CoreV1Api(api), ns, 0
        self.lock = threading.Lock()  # the count is bumped from FLOOR_IN_FLIGHT threads
        self.thread: threading.Thread | None = None

    def wait_ready(self) -> None:
        pass

    def start(self, jobs: int, nodes: int, *, services: str = "") -> None:
        """Create the pods; with `services` "job" each job's headless Service first (as our
        operator does), with "namespace" one Service for all, the pods' subdomain pointing at it."""
        specs = [from_manifest({**ddpjob(f"b{j}", nodes), "metadata": {"name": f"b{j}", "namespace": self.ns}})
                 for j in range(jobs)]
        objs: list[dict] = []
        if services == "namespace":
            svc = render_service(specs[0])
            svc["metadata"] = {"name": NS_SERVICE, "namespace": self.ns}
            svc["spec"]["selector"] = {labels.MANAGED_BY: labels.MANAGER}
            objs.append(svc)
        for spec in specs:
            if services == "job":
                objs.append(render_service(spec))
            for rank in range(nodes):
                pod = render_pod(spec, rank)
                if services == "namespace":
                    pod["spec"]["subdomain"] = NS_SERVICE
                objs.append(pod)

        def create_all() -> None:
            def one(obj: dict) -> None:
                if obj["kind"] == "Service":
                    self.core.create_namespaced_service(self.ns, obj)
                else:
                    self.core.create_namespaced_pod(self.ns, obj)
                with self.lock:
                    self.created += 1
            if objs and objs[0]["metadata"]["name"] == NS_SERVICE:
                one(objs.pop(0))
            with ThreadPoolExecutor(FLOOR_IN_FLIGHT) as pool:
                list(pool.map(one, objs))
        self.thread = threading.Thread(target=create_all, daemon=True)
        self.thread.start()

    def requests(self) -> dict[str, float]:
        return {"POST pods/services": float(self.created)}

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.join()


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def settle(ctrl, *, quiet: float = 6.0, limit: float = 45.0) -> dict[str, float]:
    """Wait until the controller sends nothing for `quiet` s (status writes trail the pods: ours
    coalesces node counts for 5 s)."""
    last, since, deadline = ctrl.requests(), time.monotonic(), time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = ctrl.requests()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return last


def finished(custom, ns: str, variant: str, jobs: int) -> bool:
    """Every job of the run has ended (ours: status.phase; the peer: a Succeeded/Failed condition)."""
    if variant.startswith("ddpjob"):
        items = custom.list_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs")["items"]
        done = [o for o in items if (o.get("status") or {}).get("phase") in ("Succeeded", "Failed")]
    else:
        items = custom.list_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs")["items"]
        done = [o for o in items if any(c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True"
                                        for c in (o.get("status") or {}).get("conditions") or [])]
    return len(done) >= jobs


def at_rest(ctrl, seconds: float, jobs: int) -> dict:
    """The controller's requests, status writes and CPU over `seconds` of nothing happening."""
    r0, c0 = ctrl.requests(), cpu_seconds(ctrl.pid)
    time.sleep(seconds)
    delta = _delta(ctrl.requests(), r0)
    per_min = 60 / seconds
    # Ours counts by verb and resource, the peer (client-go) by method only.
    writes = sum(v for k, v in delta.items() if k in ("PATCH ddpjobs/status", "PUT", "PATCH"))
    return {"requests_per_min": round(sum(delta.values()) * per_min, 1), "breakdown": delta,
            "writes_per_job_per_min": round(writes * per_min / jobs, 3),
            "cpu_s_per_min": round((cpu_seconds(ctrl.pid) - c0) * per_min, 3)}


def clear_pods(core, ns: str, *, timeout: float = 900) -> None:
    """Every pod of the namespace deleted at once (no controller is left to recreate them): a
    namespace deletion alone takes the 10,000-pod row's pods one graceful deletion at a time, past
    any timeout. The API server cuts a collection delete at its 60 s request timeout and goes on
    deleting; a cut one is sent again until no pod is left."""
    deadline = time.monotonic() + timeout
    while core.list_namespaced_pod(ns, limit=1).items:
        try:
            core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status not in (500, 503, 504) or time.monotonic() > deadline:
                raise
        except urllib3.exceptions.HTTPError:  # at 50,000 pods the server dropped the connection instead
            if time.monotonic() > deadline:
                raise


def run_one(cluster, api, k8s: K8s, variant: str, jobs: int, nodes: int, *, idle_seconds: float,
            finished_seconds: float, webhook_port: int, logs: Path, before_source: Path | None,
            ranks: FakeRanks, max_load: float, running_timeout: float = TIMEOUT,
            profile: Path | None = None, api_profile: Path | None = None, tag: str = "",
            submit_in_flight: int = FLOOR_IN_FLIGHT) -> dict:
    ns = create_namespace(api, prefix=f"bench-{variant[:3]}{'t' if variant.endswith('tuned') else ''}-",
                          labels=BENCH_NAMESPACE_LABELS)
    log_path = logs / f"{variant}-{jobs}x{nodes}-{ns}.log"
    load_before = os.getloadavg()
    ctrl: Ours | Floor | kubeflow_peer.Peer
    if variant.startswith("ddpjob"):
        ctrl = Ours(cluster, ns, log_path, scrape_url=ranks.template,
                    source=before_source if variant == "ddpjob-before" else None)
    elif variant.startswith("floor"):
        ctrl = Floor(api, ns)
        idle_seconds = 0  # nothing to keep at rest
    else:
        ctrl = kubeflow_peer.Peer(cluster, namespace=ns, tuned=variant.endswith("tuned"),
                                  metrics_port=free_port(), probe_port=free_port(),
                                  webhook_port=webhook_port, log_path=log_path)
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    res: dict = {"variant": variant, "jobs": jobs, "nodes_per_job": nodes}
    try:
        ctrl.wait_ready()
        time.sleep(2)
        rss_idle, before, cpu0 = rss_mib(ctrl.pid), ctrl.requests(), cpu_seconds(ctrl.pid)
        passes0 = ctrl.passes() if isinstance(ctrl, Ours) else None
        plane = control_plane_cpu(cluster)
        sampler = _sampler(ctrl, profile, f"{variant}-{jobs}x{nodes}{tag}-create")
        recorder = (goprof.Recorder(api, api_profile / f"{variant}-{jobs}x{nodes}{tag}-apiserver")
                    if api_profile is not None else None)
        writes = WriteTracker(k8s, ns) if variant.startswith("ddpjob") else None
        t0 = time.monotonic()
        tracker = PodTracker(k8s, ns, jobs * nodes, t0)
        if isinstance(ctrl, Floor):
            ctrl.start(jobs, nodes, services={"floor-svc": "job", "floor-nssvc": "namespace"}.get(variant, ""))
        else:
            def submit(j: int) -> None:
                if variant.startswith("ddpjob"):
                    custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", ddpjob(f"b{j}", nodes))
                else:
                    custom.create_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs",
                                                           kubeflow_peer.pytorchjob(f"b{j}", nodes, PLACEMENT))
            # The jobs go in as the floor's pods do, `submit_in_flight` creates at once: one at a
            # time, 1,000 DDPJob creates on a loaded API server were part of what "created" measured.
            with ThreadPoolExecutor(max(1, submit_in_flight)) as pool:
                list(pool.map(submit, range(jobs)))
            res["jobs_submitted_s"] = _r(time.monotonic() - t0)
        times = tracker.wait(running_timeout)
        if recorder is not None:
            # From the first create until all Running, in CHUNK s: the window ends up to CHUNK s later.
            files = recorder.stop()
            res["apiserver_profile"] = (str(goprof.summarize(files, recorder.prefix.with_suffix(".txt")))
                                        if files else recorder.error)
        delta = _delta(settle(ctrl), before)
        if passes0 is not None:
            res["passes_per_job"] = round((ctrl.passes() - passes0) / jobs, 2)
        if writes is not None:
            res.update(writes.result(jobs))
            # What a job cost to come up: its pods, Service and Events, and its status writes until
            # Running (the later ones are its training's progress, not its creation's).
            made = sum(v for k, v in delta.items() if k.startswith("POST "))
            res["requests_coming_up_per_job"] = round(made / jobs + res["status_writes_coming_up_per_job"], 2)
        res.update({f"{k}_cpu_s": round(v - plane.get(k, 0.0), 2) for k, v in control_plane_cpu(cluster).items()})
        res["endpointslices"] = len(client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(ns).items)
        if sampler is not None:
            res["profile_create"] = _summarize(sampler)
        res.update({**times, "requests": sum(delta.values()), "requests_per_job": round(sum(delta.values()) / jobs, 1),
                    "request_breakdown": delta,
                    "cpu_s": None if ctrl.pid is None else round(cpu_seconds(ctrl.pid) - cpu0, 2),
                    "rss_idle_mib": rss_idle, "rss_after_mib": rss_mib(ctrl.pid)})
        if idle_seconds > 0 and times["all_pods_running_s"] is not None:
            sampler = _sampler(ctrl, profile, f"{variant}-{jobs}x{nodes}{tag}-rest")
            res["rest_running"] = at_rest(ctrl, idle_seconds, jobs)
            if sampler is not None:
                res["profile_rest"] = _summarize(sampler)
        if idle_seconds > 0 and finished_seconds > 0 and times["all_pods_running_s"] is not None:
            pods = [p.metadata.name for p in core.list_namespaced_pod(ns).items]
            with ThreadPoolExecutor(8) as pool:   # kwok ends each pod with exit code 0
                list(pool.map(lambda name: set_pod_exit(api, ns, name, 0), pods))
            try:
                wait_for(lambda: finished(custom, ns, variant, jobs), timeout=FINISH_TIMEOUT, interval=2,
                         desc=f"{jobs} {variant} jobs finished")
            except Exception as exc:  # noqa: BLE001  (recorded; the run's other numbers stand)
                res["rest_finished_error"] = str(exc)[:300]
            else:
                settle(ctrl)
                res["rest_finished"] = at_rest(ctrl, finished_seconds, jobs)
    finally:
        ctrl.stop()
        load_after = os.getloadavg()
        res.update({"load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in load_after],
                    "loaded": max(load_before[0], load_after[0]) > max_load})
        clear_pods(core, ns)
        delete_namespace(api, ns, wait=True, timeout=600)
    return res


def _sampler(ctrl, profile: Path | None, name: str) -> pyspy.Sampler | None:
    """py-spy on our operator's process (--profile), into `profile`/`name`.raw."""
    if profile is None or not isinstance(ctrl, Ours):
        return None
    return pyspy.Sampler(ctrl.pid, profile / f"{name}.raw")


def _summarize(sampler: pyspy.Sampler) -> str | None:
    """Stop `sampler`; write its top frames beside its samples (.txt); the summary's path."""
    raw = sampler.stop()
    if raw is None:
        return None
    text = raw.with_suffix(".txt")
    text.write_text(pyspy.render(pyspy.top_frames(raw), title=raw.stem))
    return str(text)


ROWS = [  # (label, key, rest only)
    ("apply -> all jobs submitted (s)", "jobs_submitted_s", False),
    ("apply -> all pods created (s)", "all_pods_exist_s", False),
    ("apply -> all Running (s)", "all_pods_running_s", False),
    ("requests per job", "requests_per_job", False),
    ("requests per job to come up (pods, Service, Events, writes until Running)", "requests_coming_up_per_job", False),
    ("status writes per job until Running", "status_writes_coming_up_per_job", False),
    ("status writes per job after Running, in the window", "status_writes_after_running_per_job", False),
    ("controller CPU-s", "cpu_s", False),
    ("kube-controller-manager CPU-s", "controller_manager_cpu_s", False),
    ("kube-apiserver CPU-s", "apiserver_cpu_s", False),
    ("EndpointSlices", "endpointslices", False),
    ("RSS idle (MiB)", "rss_idle_mib", False),
    ("RSS after (MiB)", "rss_after_mib", False),
    ("at rest, Running+scraped: requests/min", "rest_running.requests_per_min", True),
    ("at rest, Running+scraped: status writes/job/min", "rest_running.writes_per_job_per_min", True),
    ("at rest, Running+scraped: CPU-s/min", "rest_running.cpu_s_per_min", True),
    ("at rest, finished: requests/min", "rest_finished.requests_per_min", True),
    ("at rest, finished: CPU-s/min", "rest_finished.cpu_s_per_min", True),
]


def value(run: dict, key: str):
    for part in key.split("."):
        run = run.get(part) if isinstance(run, dict) else None  # type: ignore[assignment]
    return run


def summarize(values: list) -> dict | None:
    """Median and range over the repeats (the range is the interval a few repeats can give)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": round(statistics.median(vals), 3), "min": min(vals), "max": max(vals), "n": len(vals)}


def paired_ratio(ours: list, tuned: list) -> dict | None:
    """ours/tuned per repeat -> geometric mean and its 95 % interval (median ratio for one pair)."""
    ratios = [a / b for a, b in zip(ours, tuned) if a is not None and b and a > 0]
    if not ratios:
        return None
    if len(ratios) < 2:
        return {"ratio": round(ratios[0], 3), "pairs": 1}
    ci = stats.ratio_interval(ratios)
    return {k: (round(v, 3) if isinstance(v, float) and math.isfinite(v) else v) for k, v in ci.items()}


def fmt(s: dict | None) -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:g}"
    return f"{s['median']:g} [{s['min']:g}-{s['max']:g}]"


def fmt_ratio(r: dict | None) -> str:
    if r is None:
        return "-"
    if "low" not in r:
        return f"{r['ratio']:g}"
    return f"{r['ratio']:.2f} [{r['low']:.2f}-{r['high']:.2f}]"


def report(args, prov: Provenance, runs: list[dict], scenarios, rest, variants, load_start, logs: Path) -> list[str]:
    """The table of the runs so far, written to --out: after every run, so that a bench that dies
    (a 10,000-pod namespace deletion that times out) keeps what it measured."""
    table: dict = {}
    width = 28
    # floor-svc: the floor with the Services ours make, what a controller that gives each job's pods
    # DNS names cannot do without.
    peers = {"pytorchjob-tuned": "ratio_ours_tuned", "floor": "ratio_ours_floor", "floor-svc": "ratio_ours_floor_svc"}
    peers = {v: key for v, key in peers.items() if v in variants} or {"pytorchjob-tuned": "ratio_ours_tuned"}
    lines = [f"{'':52s}" + "".join(f"{v:>{width}s}" for v in variants)
             + "".join(f"{'ours/' + v.removeprefix('pytorchjob-') + ' [95% CI]':>24s}" for v in peers)]
    for jobs, nodes in scenarios:
        for label, key, rest_only in ROWS:
            if rest_only and (jobs, nodes) not in rest:
                continue
            mine = [r for r in runs if (r["jobs"], r["nodes_per_job"]) == (jobs, nodes)]
            cells = {v: summarize([value(r, key) for r in mine if r["variant"] == v]) for v in variants}
            ratios = {name: paired_ratio([value(r, key) for r in mine if r["variant"] == "ddpjob"],
                                         [value(r, key) for r in mine if r["variant"] == v]) for v, name in peers.items()}
            table[f"{jobs}x{nodes} {label}"] = {**cells, **ratios}
            lines.append(f"{f'{jobs}x{nodes} {label}':52s}" + "".join(f"{fmt(cells[v]):>{width}s}" for v in variants)
                         + "".join(f"{fmt_ratio(r):>24s}" for r in ratios.values()))
    loaded = sum(1 for r in runs if r.get("loaded"))
    lines.append(f"{loaded} of {len(runs)} runs on a loaded machine (1-min load > {args.max_load:g}); "
                 f"load at start {tuple(round(x, 2) for x in load_start)}, at end "
                 f"{tuple(round(x, 2) for x in os.getloadavg())}")
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_avg_at_start": load_start, "load_avg_at_end": os.getloadavg(),
                       "max_load": args.max_load, "loaded_runs": loaded, "runs": len(runs)},
           "ranks_per_pod": args.ranks_per_pod,
           "peer": f"kubeflow training-operator {kubeflow_peer.VERSION} (PyTorchJob); tuned = "
                   + " ".join(kubeflow_peer.TUNED_FLAGS),
           "request_counting": "client-side, each controller's own counter (see the module docstring)",
           "table": table, "runs": runs, "logs": str(logs),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    prov.write(out)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="1x64,100x8", help=f"comma list of JOBSxNODES (at most {MAX_PODS:,} pods each)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(ALL_VARIANTS)}")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="git revision whose operator runs as variant ddpjob-before (added to the variants)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs per scenario and variant")
    ap.add_argument("--rest", default="100x8", help="comma list of the scenarios (JOBSxNODES) whose jobs are also "
                                                     "measured at rest")
    ap.add_argument("--ranks-per-pod", type=int, default=1,
                    help="ranks each pod's metrics endpoint serves (8: a pod of 8 GPUs; 1x32 is then 256 ranks)")
    ap.add_argument("--idle-seconds", type=float, default=60.0,
                    help="the at-rest window of Running jobs (0 = skip both windows); a multiple of the "
                         "operator's 30 s progress interval, or a window sees 0 or 2x its writes")
    ap.add_argument("--finished-seconds", type=float, default=None,
                    help="the at-rest window of finished jobs (default: --idle-seconds; 0 = skip)")
    ap.add_argument("--max-load", type=float, default=float(os.cpu_count() or 1),
                    help="1-minute load average above which a run is flagged loaded")
    ap.add_argument("--running-timeout", type=float, default=TIMEOUT,
                    help="seconds a run waits for all its pods Running before it reports none")
    ap.add_argument("--submit-in-flight", type=int, default=FLOOR_IN_FLIGHT,
                    help="job creates the script sends at once (the floor's pods: FLOOR_IN_FLIGHT); 1 = one after "
                         "another, as this bench did before")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="py-spy our operator during each creation and at-rest window: collapsed stacks "
                         "(DIR/<run>.raw) and their top frames (DIR/<run>.txt, bench/pyspy.py)")
    ap.add_argument("--apiserver-profile", type=Path, default=None, metavar="DIR",
                    help="kube-apiserver's CPU profile from each run's first create until all Running "
                         "(bench/goprof.py; the plane started with DDPJOB_API_PROFILING=true): "
                         "DIR/<run>-apiserver-N.pb.gz and its top functions (DIR/<run>-apiserver.txt)")
    ap.add_argument("--out", default=str(REPO / "bench/results/operator_scale.json"))
    args = ap.parse_args()
    # What a run measures: the operator (and the trainer modules it imports), the control plane
    # hack/ starts, the CRD it applies, and this bench.
    prov = Provenance("api", "operator", "trainer", "bench", "hack", "charts", out=args.out)
    scenarios = [tuple(int(x) for x in s.split("x")) for s in args.scenarios.split(",")]
    too_big = [f"{j}x{n}" for j, n in scenarios if j * n > MAX_PODS]
    if too_big:
        ap.error(f"--scenarios: {', '.join(too_big)} over {MAX_PODS} pods")
    rest = {tuple(int(x) for x in r.split("x")) for r in args.rest.split(",") if r}
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(ALL_VARIANTS)
    if unknown:
        ap.error(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ALL_VARIANTS)}")
    before_source = None
    if args.before:
        before_source = operator_at(args.before)
        if "ddpjob-before" not in variants:
            variants.insert(0, "ddpjob-before")
    # One node more than the pods fill: room for a restarted job's new pods beside its kept failed one.
    node_count = math.ceil(max(j * n for j, n in scenarios) / PODS_PER_NODE) + 1

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
    bench_nodes(core, node_count, create=True)
    ranks = FakeRanks(args.ranks_per_pod)
    logs = Path(tempfile.mkdtemp(prefix="operator-scale-"))
    runs: list[dict] = []
    load_start = os.getloadavg()
    try:
        for rep in range(args.repeat):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for jobs, nodes in scenarios:
                for variant in order:
                    idle = args.idle_seconds if (jobs, nodes) in rest else 0
                    finished_s = args.idle_seconds if args.finished_seconds is None else args.finished_seconds
                    res = run_one(cluster, api, k8s, variant, jobs, nodes, idle_seconds=idle, finished_seconds=finished_s,
                                  webhook_port=webhook_port, logs=logs, before_source=before_source,
                                  ranks=ranks, max_load=args.max_load, running_timeout=args.running_timeout,
                                  profile=args.profile, api_profile=args.apiserver_profile, tag=f"-rep{rep}", submit_in_flight=args.submit_in_flight)
                    res["repeat"] = rep
                    runs.append(res)
                    rr, rf = res.get("rest_running") or {}, res.get("rest_finished") or {}
                    print(f"{variant:19s} {jobs:4d}x{nodes:<2d} rep {rep}: created {res['all_pods_exist_s']}s, "
                          f"running {res['all_pods_running_s']}s, {res['requests_per_job']} req/job, "
                          f"come-up {res.get('come_up')}, unschedulable {res.get('pods_ever_unschedulable')}, "
                          f"{res.get('passes_per_job')} passes/job, "
                          f"CPU {res['cpu_s']}s, RSS {res['rss_idle_mib']}/{res['rss_after_mib']} MiB, "
                          f"load {res['load_avg_before'][0]}->{res['load_avg_after'][0]}"
                          + (" LOADED" if res["loaded"] else "")
                          + (f"; at rest running {rr.get('requests_per_min')} req/min "
                             f"{rr.get('writes_per_job_per_min')} writes/job/min {rr.get('cpu_s_per_min')} CPU-s/min"
                             if rr else "")
                          + (f"; finished {rf.get('requests_per_min')} req/min {rf.get('cpu_s_per_min')} CPU-s/min"
                             if rf else ""), flush=True)
                    report(args, prov, runs, scenarios, rest, variants, load_start, logs)
    finally:
        ranks.close()
        bench_nodes(core, node_count, create=False)
        if any(v.startswith("pytorchjob") for v in variants):
            kubeflow_peer.uninstall(cluster)
        k8s.close()

    print("\n".join(report(args, prov, runs, scenarios, rest, variants, load_start, logs)))
    print(f"wrote {args.out} (controller logs: {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
