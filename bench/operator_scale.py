#!/usr/bin/env python3
"""Operator scale on the local control plane: DDPJob operator vs the built-in Job controller.

Scenarios (same pod counts for both): 1 job x 64 nodes, 100 jobs x 8 nodes. For each:
seconds from the create request until all pods exist and until all are Running (kwok), API
requests per job (delta of apiserver_request_total from `kubectl get --raw /metrics`, WATCH
excluded; the breakdown is in the JSON) and the operator's memory. Pods land on extra fake
nodes that this script adds (and removes) so 800 pods fit. Prints our/its ratios; writes JSON
to bench/results/operator_scale.json. Not a test: nothing here asserts timings.

    .venv/bin/python bench/operator_scale.py [--scenarios 1x64,100x8]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kubernetes import client  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

from tests.support.cluster import create_namespace, delete_namespace, ensure_cluster, wait_for  # noqa: E402

BENCH_LABEL = "kwok-bench"
BENCH_NODES = 4
PODS_PER_NODE = 250
TIMEOUT = 300
# Resources that the two controllers touch; requests for them (minus watches) are "per job".
_LINE = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_counts(cluster) -> collections.Counter:
    """apiserver_request_total by (resource, subresource, verb), watches excluded."""
    text = cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    out: collections.Counter = collections.Counter()
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        lab = dict(_LABEL.findall(m.group("labels")))
        if lab.get("verb") == "WATCH":
            continue
        out[(lab.get("resource", ""), lab.get("subresource", ""), lab.get("verb", ""))] += float(m.group("value"))
    return out


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


# Bench pods only go to the bench nodes (taint + selector), away from concurrent test traffic.
PLACEMENT = {"nodeSelector": {"type": BENCH_LABEL},
             "tolerations": [{"key": "ddpjob.dev/bench", "operator": "Exists", "effect": "NoSchedule"}]}


def ddpjob(name: str, nodes: int) -> dict:
    return {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
            "spec": {"image": "bench/trainer:1", "nodes": nodes, "scheduling": PLACEMENT}}


def indexed_job(name: str, nodes: int) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"completions": nodes, "parallelism": nodes, "completionMode": "Indexed",
                     "backoffLimit": 0,
                     "template": {"metadata": {"labels": {"bench": "job"}},
                                  "spec": {"restartPolicy": "Never", **PLACEMENT,
                                           "containers": [{"name": "trainer", "image": "bench/trainer:1"}]}}}}


def watch_pods(core, ns: str, total: int, t0: float) -> dict:
    """Poll (raw JSON) until `total` pods exist and all have started; seconds since t0."""
    exist_at = running_at = None
    polls = 0
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        resp = core.list_namespaced_pod(ns, _preload_content=False)
        raw = resp.read() or resp.data
        items = json.loads(raw)["items"]
        polls += 1
        now = time.monotonic()
        if exist_at is None and len(items) >= total:
            exist_at = now - t0
        started = sum(1 for p in items if (p.get("status") or {}).get("phase") in ("Running", "Succeeded"))
        if started >= total:
            running_at = now - t0
            if exist_at is None:
                exist_at = running_at
            break
        time.sleep(0.1)
    return {"all_pods_exist_s": exist_at, "all_pods_running_s": running_at, "polls": polls}


def rss_mb(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return {"rss_mb": round(fields.get("VmRSS", 0), 1), "peak_rss_mb": round(fields.get("VmHWM", 0), 1)}


def run_scenario(cluster, api, kind: str, jobs: int, nodes: int, ns: str) -> dict:
    core, custom, batch = client.CoreV1Api(api), client.CustomObjectsApi(api), client.BatchV1Api(api)
    before = request_counts(cluster)
    t0 = time.monotonic()
    for j in range(jobs):
        name = f"b{j}"
        if kind == "ddpjob":
            custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", ddpjob(name, nodes))
        else:
            batch.create_namespaced_job(ns, indexed_job(name, nodes))
    create_s = time.monotonic() - t0
    times = watch_pods(core, ns, jobs * nodes, t0)
    time.sleep(3)  # let the controllers finish their status writes before counting requests
    after = request_counts(cluster)
    delta = {k: after[k] - before[k] for k in after if after[k] - before[k] > 0}
    ours = {"ddpjobs", "services", "events"} if kind == "ddpjob" else {"jobs", "events"}
    # Controller-side requests: its own resources, plus pod create/delete/list/get.
    # Excluded: pod status and binding (kwok and the scheduler; the same for both) and our polling LIST.
    controller = 0.0
    for (res, sub, verb), n in delta.items():
        if res in ours and not (res in ("ddpjobs", "jobs") and verb == "POST" and not sub):
            controller += n
        elif res == "pods" and not sub and verb in ("POST", "DELETE", "GET", "PATCH", "PUT"):
            controller += n
        elif res == "pods" and not sub and verb == "LIST":
            controller += max(0.0, n - times["polls"])
    return {"kind": kind, "jobs": jobs, "nodes_per_job": nodes, "pods": jobs * nodes,
            "create_requests_s": round(create_s, 3), **{k: (round(v, 3) if isinstance(v, float) else v)
                                                        for k, v in times.items()},
            "controller_requests": controller, "controller_requests_per_job": round(controller / jobs, 1),
            "request_delta": {f"{r}/{s}:{v}" if s else f"{r}:{v}": n for (r, s, v), n in sorted(delta.items())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="1x64,100x8", help="comma list of JOBSxNODES")
    ap.add_argument("--out", default=str(REPO / "bench/results/operator_scale.json"))
    args = ap.parse_args()
    scenarios = [tuple(int(x) for x in s.split("x")) for s in args.scenarios.split(",")]

    cluster = ensure_cluster()
    api = cluster.api()
    core = client.CoreV1Api(api)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                    str(REPO / "charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd/ddpjobs.ddpjob.dev")
    bench_nodes(core, create=True)

    namespaces = {(kind, j, n): create_namespace(api, prefix=f"bench-{kind[:3]}-")
                  for j, n in scenarios for kind in ("ddpjob", "job")}
    ddp_ns = [ns for (kind, _, _), ns in namespaces.items() if kind == "ddpjob"]
    metrics_port, health_port = free_port(), free_port()
    log_path = Path(tempfile.gettempdir()) / "ddpjob-operator-scale.log"
    log = open(log_path, "w")
    cmd = [str(Path(sys.executable).parent / "ddpjob"), "operator", "--peering", "",
           "--metrics-port", str(metrics_port), "--health-port", str(health_port),
           "--scrape-interval", "600", "--log-level", "WARNING"]
    for ns in ddp_ns:
        cmd += ["-n", ns]
    op = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cluster.env())
    results = []
    try:
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=2).status == 200,
                 timeout=60, desc="operator healthy")
        idle = rss_mb(op.pid)
        for jobs, nodes in scenarios:
            pair = {}
            for kind in ("ddpjob", "job"):
                ns = namespaces[(kind, jobs, nodes)]
                res = run_scenario(cluster, api, kind, jobs, nodes, ns)
                if kind == "ddpjob":
                    res["operator_memory"] = rss_mb(op.pid)
                pair[kind] = res
                print(f"{kind:7s} {jobs:3d} x {nodes:2d}: pods exist {res['all_pods_exist_s']}s, "
                      f"running {res['all_pods_running_s']}s, {res['controller_requests_per_job']} requests/job",
                      flush=True)
                delete_namespace(api, ns, wait=True, timeout=180)
            ours, its = pair["ddpjob"], pair["job"]

            def ratio(key):
                a, b = ours.get(key), its.get(key)
                return round(a / b, 2) if a and b else None
            summary = {"scenario": f"{jobs}x{nodes}", "ddpjob": ours, "indexed_job": its,
                       "ratio_exist": ratio("all_pods_exist_s"), "ratio_running": ratio("all_pods_running_s"),
                       "ratio_requests_per_job": ratio("controller_requests_per_job")}
            results.append(summary)
            print(f"  ratios ours/Job controller ({jobs}x{nodes}): all exist {summary['ratio_exist']}, "
                  f"all running {summary['ratio_running']}, requests/job {summary['ratio_requests_per_job']}; "
                  f"operator RSS {ours['operator_memory']['rss_mb']} MiB (peak "
                  f"{ours['operator_memory']['peak_rss_mb']}, idle {idle['rss_mb']})", flush=True)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        recon = {m.group(1): float(m.group(2)) for m in
                 re.finditer(r"^ddpjob_operator_reconcile_seconds_(count|sum) (\S+)$", metrics, re.M)}
    finally:
        op.send_signal(signal.SIGTERM)
        try:
            op.wait(timeout=20)
        except subprocess.TimeoutExpired:
            op.kill()
        log.close()
        for ns in namespaces.values():
            delete_namespace(api, ns)
        bench_nodes(core, create=False)
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
           "operator_idle_memory": idle, "reconcile_passes": recon.get("count"),
           "reconcile_seconds_total": recon.get("sum"), "results": results,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out} (operator log: {log_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
