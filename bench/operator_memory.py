#!/usr/bin/env python3
"""The operator's memory against the pods it keeps, and a group restart at the largest size.

One `ddpjob operator` (as bench/operator_scale.py starts it: one namespace, loopback scrapes)
serves DDPJobs of --nodes pods on kwok bench nodes, added in steps (--steps 2000,5000,10000 pods in
all). After each step, once every pod is Running and the operator has sent nothing for a while,
its RSS is read a few times (the median is the step's), and its high-water mark (the peak
while the pods were created, VmHWM). A least-squares line through (pods, RSS),
the idle operator at 0 pods included, gives the slope in KiB per pod: the chart's sizing rule
(docs/install.md) is idle + slope x pods + headroom. At the first and the largest step one pod of
each of --restarts jobs exits 1, one job after another, and the seconds until that job's next
attempt is Running (their median is the step's) are compared (the ratio, measured in the same
run). The operator must never restart (its pid is checked), and after each step every job's status
must say Running with all its nodes running (counted, the first wrong ones named). The result
records the chart's memory limit beside the RSS.
With --before REV the operator is that git revision's (the bench, its cluster and its fake ranks
stay the checkout's): a change's before, its commit recorded as operator_commit.
With --tracemalloc DIR the operator runs under bench/pymem.py and each step also writes the lines
that hold its live memory (DIR/<step>.txt): where the memory goes, while that run's RSS, inflated by
tracemalloc, is not the operator's (the result says so).
Not a test: nothing here asserts sizes or times.

    .venv/bin/python bench/operator_memory.py [--steps 2000,5000,10000] [--nodes 10] [--tracemalloc DIR]
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from kubernetes import client  # noqa: E402

import operator_scale as scale  # noqa: E402
from provenance import Provenance  # noqa: E402
from ddpjob_operator.cluster.k8s import K8s, job_path  # noqa: E402
from tests.support.cluster import (create_namespace, delete_namespace, ensure_cluster,  # noqa: E402
                                   set_pod_exit, wait_crd_established, wait_for)

RSS_READINGS = 5
STATUS_WAIT = 300.0  # seconds for every job's status to say Running with all nodes after a step


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """The process's resident memory now (VmRSS), or the most it has had since it started (VmHWM,
    the high-water mark: what a memory limit must allow, creation bursts included)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def steady_rss(ours: scale.Ours) -> int:
    """The operator's RSS once it has sent nothing for a while: the median of a few readings."""
    scale.settle(ours, quiet=10.0, limit=120.0)
    readings = []
    for _ in range(RSS_READINGS):
        readings.append(rss_kib(ours.pid))
        time.sleep(2)
    return int(statistics.median(readings))


def traced(ours: scale.Ours, out: Path | None, pods: int) -> None:
    """With --tracemalloc: the traced operator's dump of its live memory, kept as OUT/<pods>.txt."""
    if out is None:
        return
    n = len(list(out.glob("pods-*.txt")))  # pymem numbers its dumps from 0: one per step so far
    os.kill(ours.pid, signal.SIGUSR2)
    dump = out / f"{n}.txt"
    wait_for(dump.exists, timeout=300, desc=f"the operator's tracemalloc dump {dump}")
    dump.rename(out / f"pods-{pods}.txt")


def fit(points: list[tuple[int, int]]) -> dict:
    """Least squares RSS (KiB) = intercept + slope x pods."""
    xs, ys = [p for p, _ in points], [r for _, r in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else float("nan")
    intercept = my - slope * mx
    resid = [y - (intercept + slope * x) for x, y in points]
    return {"slope_kib_per_pod": round(slope, 2), "intercept_mib": round(intercept / 1024, 1),
            "max_residual_mib": round(max(abs(r) for r in resid) / 1024, 1)}


def status_right(k8s: K8s, ns: str, jobs: int, nodes: int) -> dict:
    """How many of the namespace's DDPJobs say what their pods are: phase Running with every node
    running. Waits up to STATUS_WAIT s for all of them (the last writes trail the pods), then
    reports what it saw, the first wrong ones named; never raises on a wrong count."""
    seen: dict = {}

    def all_right() -> bool:
        items, _ = k8s.list_objects(job_path(ns))
        said = [(o["metadata"]["name"], o.get("status") or {}) for o in items]
        wrong = [(name, st.get("phase"), (st.get("nodes") or {}).get("running")) for name, st in said
                 if st.get("phase") != "Running" or (st.get("nodes") or {}).get("running") != nodes]
        seen.update(jobs=len(items), right=len(items) - len(wrong), wrong=wrong[:5])
        return len(items) == jobs and not wrong
    t0 = time.monotonic()
    try:
        wait_for(all_right, timeout=STATUS_WAIT, interval=5.0, desc="every DDPJob Running with all nodes running")
    except AssertionError:
        pass
    return {**seen, "seconds": round(time.monotonic() - t0, 1)}


def chart_memory_limit() -> str:
    """The operator's memory limit as the chart ships it (values.yaml)."""
    import yaml
    values = yaml.safe_load((REPO / "charts/ddpjob-operator/values.yaml").read_text())
    return str(values["resources"]["limits"]["memory"])


def restart_seconds(custom, api, ns: str, job: str, *, timeout: float) -> float:
    """One pod of `job` exits 1: seconds until the job's next attempt is Running."""
    attempt = int((custom.get_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", job)
                   .get("status") or {}).get("attempt") or 0)
    pod = f"{job}-1" if attempt == 0 else f"{job}-1-a{attempt}"
    t0 = time.monotonic()
    set_pod_exit(api, ns, pod, 1)

    def running_again() -> bool:
        st = custom.get_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", job).get("status") or {}
        return int(st.get("attempt") or 0) > attempt and st.get("phase") == "Running"
    wait_for(running_again, timeout=timeout, interval=0.5, desc=f"{job} restarted and Running")
    return round(time.monotonic() - t0, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="2000,5000,10000", help="comma list of total pod counts, increasing")
    ap.add_argument("--nodes", type=int, default=10, help="pods per DDPJob")
    ap.add_argument("--restarts", type=int, default=1,
                    help="group restarts (of jobs b0, b1, ...) timed at the first and the largest step; the median is the step's")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="run the operator of this git revision instead of the checkout's (a change's before)")
    ap.add_argument("--running-timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=str(REPO / "bench/results/operator_memory.json"))
    ap.add_argument("--tracemalloc", type=Path, default=None, metavar="DIR",
                    help="run the operator under bench/pymem.py and dump its top allocation lines per step into DIR")
    ap.add_argument("--operator-env", action="append", default=[], metavar="NAME=VALUE",
                    help="set NAME=VALUE for the operator alone (e.g. an allocator setting); repeatable")
    args = ap.parse_args()
    if any("=" not in kv or kv.startswith("=") for kv in args.operator_env):
        ap.error(f"--operator-env: NAME=VALUE, got {args.operator_env}")
    extra_env = dict(kv.split("=", 1) for kv in args.operator_env)
    prov = Provenance("api", "operator", "trainer", "bench", "hack", "charts", out=args.out)
    steps = [int(s) for s in args.steps.split(",")]
    if not 1 <= args.restarts <= steps[0] // args.nodes:
        ap.error(f"--restarts: 1 to {steps[0] // args.nodes} (the first step's jobs)")
    if steps != sorted(steps) or steps[0] <= 0 or any(s % args.nodes for s in steps):
        ap.error("--steps: increasing pod counts, each a multiple of --nodes")
    if args.tracemalloc and args.tracemalloc.exists() and any(args.tracemalloc.iterdir()):
        ap.error(f"--tracemalloc {args.tracemalloc}: not empty (each run's dumps are numbered from 0)")

    cluster = ensure_cluster()
    api = cluster.api()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    k8s = K8s(api=cluster.api())
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                    str(REPO / "charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml"))
    wait_crd_established(cluster, "ddpjobs.ddpjob.dev")
    # One node more than the pods fill: the group restart's new pods need room beside the failed
    # pod its job keeps (with exactly full nodes one of them never schedules).
    node_count = math.ceil(steps[-1] / scale.PODS_PER_NODE) + 1
    scale.bench_nodes(core, node_count, create=True)
    ranks = scale.FakeRanks()
    ns = create_namespace(api, prefix="bench-mem-", labels=scale.BENCH_NAMESPACE_LABELS)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"operator-memory-{ns}.log"
    wrapper = (str(REPO / "bench/pymem.py"), str(args.tracemalloc)) if args.tracemalloc else ()
    source = scale.operator_at(args.before) if args.before else None
    ours = scale.Ours(cluster, ns, logs, scrape_url=ranks.template, wrapper=wrapper, extra_env=extra_env,
                      source=source)
    out: dict = {"operator_env": extra_env, "nodes_per_job": args.nodes, "steps": [], "operator_log": str(logs),
                 "chart_memory_limit": chart_memory_limit()}
    if args.before:
        out["operator_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.before],
                                                capture_output=True, text=True, check=True).stdout.strip()
    if args.tracemalloc:
        out["tracemalloc"] = {"dir": str(args.tracemalloc),
                              "note": "the operator ran under tracemalloc: its RSS here is inflated by the tracing"}
    try:
        ours.wait_ready()
        pid = ours.pid
        out["steps"].append({"pods": 0, "rss_kib": steady_rss(ours), "load_avg": os.getloadavg()})
        traced(ours, args.tracemalloc, 0)
        jobs, target, step = 0, 0, {}
        for target in steps:
            step = {"pods": target}   # what the step saw so far: kept as the run's error if it fails
            t0 = time.monotonic()
            tracker = scale.PodTracker(k8s, ns, target, t0)
            with ThreadPoolExecutor(scale.FLOOR_IN_FLIGHT) as pool:
                list(pool.map(lambda j: custom.create_namespaced_custom_object(
                    "ddpjob.dev", "v1alpha1", ns, "ddpjobs", scale.ddpjob(f"b{j}", args.nodes)),
                    range(jobs, target // args.nodes)))
            jobs = target // args.nodes
            times = tracker.wait(args.running_timeout)
            step.update(times)
            if ours.proc.poll() is not None or ours.pid != pid:
                raise RuntimeError(f"the operator exited ({ours.proc.returncode}) at {target} pods")
            step.update(rss_kib=steady_rss(ours), peak_rss_kib=rss_kib(ours.pid, "VmHWM"), load_avg=os.getloadavg(),
                        status=status_right(k8s, ns, jobs, args.nodes))
            traced(ours, args.tracemalloc, target)
            if target in (steps[0], steps[-1]):
                # --restarts jobs one after another (b0, b1, ...), each at its own moment of the
                # scrape interval: the median is the step's.
                step["group_restarts_s"] = [restart_seconds(custom, api, ns, f"b{j}", timeout=args.running_timeout)
                                            for j in range(args.restarts)]
                step["group_restart_s"] = statistics.median(step["group_restarts_s"])
            out["steps"].append(step)
            print(f"{target:6d} pods: running {times['all_pods_running_s']}s, RSS {step['rss_kib'] / 1024:.1f} MiB"
                  f" (peak {step['peak_rss_kib'] / 1024:.1f})"
                  + (f", group restart {step['group_restart_s']}s" if "group_restart_s" in step else "")
                  + f", load {step['load_avg'][0]:.1f}, status right {step['status']['right']}/{jobs}", flush=True)
            out["fit"] = fit([(s["pods"], s["rss_kib"]) for s in out["steps"]])
            out["operator_restarts"] = 0
            prov.write(out)
        first, last = out["steps"][1], out["steps"][-1]
        if len(out["steps"]) > 2:
            out["group_restart_ratio_largest_to_first"] = round(last["group_restart_s"] / first["group_restart_s"], 2)
        # What a limit must allow beyond the line: the creation's peak over the steady RSS after it.
        out["peak_over_steady_largest"] = round(last["peak_rss_kib"] / last["rss_kib"], 2)
        out["fit"] = fit([(s["pods"], s["rss_kib"]) for s in out["steps"]])
        prov.write(out)
        print(f"RSS = {out['fit']['intercept_mib']} MiB + {out['fit']['slope_kib_per_pod']} KiB x pods "
              f"(largest residual {out['fit']['max_residual_mib']} MiB); wrote {args.out}")
    except BaseException as exc:
        # What a step that did not end left: kept in the result (the run so far is the evidence),
        # and its traceback printed now, before the cleanup below can fail on top of it.
        traceback.print_exc()
        out["error"] = {"pods": target, "error": f"{type(exc).__name__}: {exc}", "step": step}
        try:
            prov.write(out)
        except Exception as failed:  # noqa: BLE001  (the step's own error is the one to raise)
            print(f"could not write {args.out}: {failed}", file=sys.stderr)
        raise
    finally:
        ours.stop()
        ranks.close()
        scale.clear_pods(core, ns)
        delete_namespace(api, ns, wait=True, timeout=900)
        scale.bench_nodes(core, node_count, create=False)
        k8s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
