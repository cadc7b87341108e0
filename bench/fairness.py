#!/usr/bin/env python3
"""Fairness and bounded memory on the local control plane (issue 12 item 7).

- Restart latency: a small 2-node job is Running; one of its pods is made to fail (kwok's
  test-exit-code annotation) and we time from that write until the restarted group (a higher
  ddpjob.dev/attempt) has all its pods, and until they are all Running.
  A (idle): nothing else happens. B (busy): a --big node job of the same operator is being
  created meanwhile (applied, and at least --head of its pods exist when the pod is failed); a
  B sample only counts when the big job was still incomplete at the failure (the previous big
  job is deleted and a new one applied whenever it is complete). Medians and the ratio B/A of
  "pods exist" (the operator's part; goal <= 2) and of "Running" (which adds the shared
  scheduler's queue of the big job's pending pods).
- The floor: the same restart of two plain pods done by the bench itself with the fewest requests
  (see the failure, one write, delete both, create both), idle and right after each busy sample.
  Its busy/idle ratio is what the loaded API server and machine impose on any controller; the
  operator's ratio over the floor's is the operator's own share.
- Memory: a fresh operator in its own namespace creates one --huge node job; its RSS
  (/proc/<pid>/status VmRSS, and the peak VmHWM) once all pods exist, against the chart's memory
  limit (charts/ddpjob-operator/values.yaml).
Pods request no GPUs (gpusPerNode 0) and land on the fake bench nodes of operator_scale.py,
sized here for the pod counts. The operator scrapes only a closed loopback port. Writes
bench/results/fairness.json. Not a test: nothing here asserts timings.

    .venv/bin/python bench/fairness.py [--big 3000] [--huge 10000] [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import operator_scale as osc  # also puts the repo root on sys.path
from provenance import Provenance
from kubernetes import client

from ddpjob_api import labels
from ddpjob_operator.cluster.k8s import K8s
from tests.support.cluster import (create_namespace, delete_namespace, ensure_cluster,
                                   set_pod_exit, wait_crd_established, wait_for)

SMALL = "small"
POLL = 0.05
CHART_VALUES = osc.REPO / "charts/ddpjob-operator/values.yaml"


def chart_memory_limit_mib() -> float:
    raw = str(yaml.safe_load(CHART_VALUES.read_text())["resources"]["limits"]["memory"])
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "K": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if raw.endswith(suffix):
            return float(raw[: -len(suffix)]) * mult
    return float(raw) / 2**20


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def job_pods(core, ns: str, job: str) -> list:
    return core.list_namespaced_pod(ns, label_selector=f"{labels.JOB_NAME}={job}").items


def attempt_of(pod) -> int:
    return int((pod.metadata.labels or {}).get(labels.ATTEMPT, "0"))


def group_running(core, ns: str, job: str, nodes: int, *, above: int = -1) -> list | None:
    """The job's pods of an attempt > `above` when all `nodes` of them are Running, else None."""
    pods = [p for p in job_pods(core, ns, job) if attempt_of(p) > above and not p.metadata.deletion_timestamp]
    if len(pods) == nodes and all(p.status.phase == "Running" for p in pods):
        return pods
    return None


def restart_once(core, api, ns: str) -> dict:
    """Fail one pod of the small job; seconds until the next attempt's pods exist / are Running."""
    pods = wait_for(lambda: group_running(core, ns, SMALL, 2), timeout=120, desc="small job Running")
    before = max(attempt_of(p) for p in pods)
    t0 = time.monotonic()
    set_pod_exit(api, ns, pods[0].metadata.name, 3)
    exist_at = None
    deadline = t0 + osc.TIMEOUT
    while time.monotonic() < deadline:
        new = [p for p in job_pods(core, ns, SMALL) if attempt_of(p) > before]
        now = time.monotonic() - t0
        if exist_at is None and len(new) == 2:
            exist_at = now
        if len(new) == 2 and all(p.status.phase == "Running" for p in new):
            return {"exist_s": round(exist_at, 3), "running_s": round(now, 3)}
        time.sleep(POLL)
    return {"exist_s": None if exist_at is None else round(exist_at, 3), "running_s": None}


FLOOR = "floor"


def floor_pods(core, ns: str, attempt: int) -> None:
    """The floor's two pods of one attempt (plain pods, placed like the jobs' pods)."""
    for rank in range(2):
        core.create_namespaced_pod(ns, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{FLOOR}-{rank}", "labels": {labels.JOB_NAME: FLOOR, labels.ATTEMPT: str(attempt)}},
            "spec": {**osc.PLACEMENT, "restartPolicy": "Never",
                     "containers": [{"name": "trainer", "image": "bench/trainer:1"}]}})


def floor_once(core, api, ns: str, attempt: int) -> dict:
    """The same restart done by the least any controller must do, with no operator: see the failure
    (polling, as the measurement does), write one object (the status write), delete both pods,
    create the next pair once the names are free. Its busy/idle ratio is what the machine and the
    shared API server impose on every controller; the operator's ratio is judged against it."""
    wait_for(lambda: group_running(core, ns, FLOOR, 2, above=attempt - 1), timeout=120, desc="floor pods Running")
    t0 = time.monotonic()
    set_pod_exit(api, ns, f"{FLOOR}-0", 3)
    wait_for(lambda: core.read_namespaced_pod(f"{FLOOR}-0", ns).status.phase == "Failed", timeout=osc.TIMEOUT,
             desc="floor pod Failed", interval=POLL)
    core.patch_namespace(ns, {"metadata": {"annotations": {"bench.ddpjob.dev/floor-attempt": str(attempt + 1)}}})
    for rank in range(2):
        core.delete_namespaced_pod(f"{FLOOR}-{rank}", ns, grace_period_seconds=0)
    wait_for(lambda: not job_pods(core, ns, FLOOR), timeout=osc.TIMEOUT, desc="floor pods gone", interval=POLL)
    floor_pods(core, ns, attempt + 1)
    exist_at = time.monotonic() - t0
    wait_for(lambda: group_running(core, ns, FLOOR, 2, above=attempt), timeout=osc.TIMEOUT,
             desc="floor pods Running again", interval=POLL)
    return {"exist_s": round(exist_at, 3), "running_s": round(time.monotonic() - t0, 3)}


def count_pods(core, ns: str, job: str) -> int:
    return len(job_pods(core, ns, job))


def small_job() -> dict:
    job = osc.ddpjob(SMALL, 2)
    job["spec"]["failurePolicy"] = {"maxRestarts": 1000}  # every sample spends one restart
    return job


def restart_latencies(custom, core, api, ns: str, *, repeat: int, big: int, head: int) -> dict:
    custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", small_job())
    floor_pods(core, ns, 0)
    attempt = 0
    idle, floor_idle, floor_busy = [], [], []
    for i in range(repeat):
        idle.append(restart_once(core, api, ns))
        floor_idle.append(floor_once(core, api, ns, attempt))
        attempt += 1
        print(f"A idle   #{i}: {idle[-1]} floor {floor_idle[-1]}", flush=True)
    busy, skipped, bigs = [], [], 0
    big_name = None
    while len(busy) < repeat and len(skipped) < 3 * repeat:
        if big_name is None or count_pods(core, ns, big_name) >= big:
            if big_name is not None:  # only one big job at a time fits the bench nodes
                custom.delete_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", big_name)
                wait_for(lambda: count_pods(core, ns, big_name) == 0, timeout=osc.TIMEOUT,
                         desc=f"pods of {big_name} deleted", interval=1)
            big_name = f"big-{bigs}"
            bigs += 1
            custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", osc.ddpjob(big_name, big))
            wait_for(lambda: count_pods(core, ns, big_name) >= min(head, big), timeout=osc.TIMEOUT,
                     desc=f"{head} pods of {big_name}", interval=0.5)
        at_fail = count_pods(core, ns, big_name)
        res = restart_once(core, api, ns)
        at_end = count_pods(core, ns, big_name)
        res.update(big_job=big_name, big_pods_at_fail=at_fail, big_pods_at_restart=at_end)
        # Counted when the failure came while the big job was being created (a restart held back
        # until the big job is complete is exactly the unfairness measured).
        (busy if at_fail < big else skipped).append(res)
        if at_end < big:  # the floor under the same load, right after
            floor_busy.append(floor_once(core, api, ns, attempt))
            attempt += 1
        print(f"B busy   #{len(busy) + len(skipped) - 1}: {res}{'' if at_fail < big else ' (big job done: not counted)'}",
              flush=True)
    return {"idle": idle, "busy": busy, "busy_not_counted": skipped, "big_jobs_applied": bigs,
            "floor_idle": floor_idle, "floor_busy": floor_busy}


def huge_rss(cluster, api, k8s: K8s, *, huge: int, logs: Path) -> dict:
    ns = create_namespace(api, prefix="bench-huge-")
    ctrl = osc.Ours(cluster, ns, logs / f"huge-{huge}.log")
    custom = client.CustomObjectsApi(api)
    try:
        ctrl.wait_ready()
        time.sleep(2)
        rss_idle = osc.rss_mib(ctrl.pid)
        t0 = time.monotonic()
        tracker = osc.PodTracker(k8s, ns, huge, t0)
        custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", osc.ddpjob("huge", huge))
        peak_sampled = rss_idle
        while not tracker.done.is_set() and time.monotonic() - t0 < osc.TIMEOUT * 3:
            tracker.done.wait(2)
            peak_sampled = max(peak_sampled, osc.rss_mib(ctrl.pid))
        time.sleep(5)  # status writes trail the pods
        return {"nodes": huge, "all_pods_exist_s": osc._r(tracker.exist_at),
                "all_pods_running_s": osc._r(tracker.running_at), "rss_idle_mib": rss_idle,
                "rss_after_mib": osc.rss_mib(ctrl.pid), "rss_peak_mib": vm_hwm_mib(ctrl.pid),
                "cpu_s": round(osc.cpu_seconds(ctrl.pid), 1)}
    finally:
        stop_and_clean(ctrl, api, ns)


def stop_and_clean(ctrl, api, ns: str) -> None:
    """Stop the operator, then delete its namespace (thousands of pods: GC may take minutes)."""
    ctrl.stop()
    try:
        delete_namespace(api, ns, wait=True, timeout=600)
    except AssertionError as exc:
        print(f"warning: {exc}", flush=True)


def med(samples: list, key: str) -> float | None:
    vals = [s[key] for s in samples if s.get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big", type=int, default=3000, help="nodes of the job created meanwhile (B)")
    ap.add_argument("--head", type=int, default=100, help="pods of the big job that exist before the failure")
    ap.add_argument("--huge", type=int, default=10000, help="nodes of the job whose operator RSS is read (0 = skip)")
    ap.add_argument("--repeat", type=int, default=5, help="restart samples per scenario")
    ap.add_argument("--out", default=str(osc.REPO / "bench/results/fairness.json"))
    args = ap.parse_args()
    for flag in ("big", "head", "repeat"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1")
    prov = Provenance("api", "operator", "trainer", "bench", "hack", "charts", out=args.out)

    cluster = ensure_cluster()
    api = cluster.api()
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    k8s = K8s(api=cluster.api())
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                    str(osc.REPO / "charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml"))
    wait_crd_established(cluster, "ddpjobs.ddpjob.dev")
    # operator_scale's bench nodes, sized so every pod of this run fits (kwok runs any number).
    osc.PODS_PER_NODE = -(-(max(args.huge, 2 * args.big) + 100) // osc.BENCH_NODES) + 50
    osc.bench_nodes(core, create=True)
    logs = Path(tempfile.mkdtemp(prefix="fairness-"))
    limit = chart_memory_limit_mib()
    out: dict = {"args": vars(args)}
    try:
        ns = create_namespace(api, prefix="bench-fair-")
        ctrl = osc.Ours(cluster, ns, logs / "fairness.log")
        try:
            ctrl.wait_ready()
            lat = restart_latencies(custom, core, api, ns, repeat=args.repeat, big=args.big, head=args.head)
            lat["rss_after_mib"] = osc.rss_mib(ctrl.pid)
        finally:
            stop_and_clean(ctrl, api, ns)
        a, b = med(lat["idle"], "running_s"), med(lat["busy"], "running_s")
        ea, eb = med(lat["idle"], "exist_s"), med(lat["busy"], "exist_s")
        fa, fb = med(lat["floor_idle"], "exist_s"), med(lat["floor_busy"], "exist_s")
        out["restart"] = {"idle_median_exist_s": ea, "busy_median_exist_s": eb,
                          "ratio_busy_idle_exist": round(eb / ea, 2) if ea and eb else None,
                          "floor_idle_median_exist_s": fa, "floor_busy_median_exist_s": fb,
                          "floor_ratio_busy_idle_exist": round(fb / fa, 2) if fa and fb else None,
                          # The operator's own share of the slowdown: its ratio over the floor's.
                          "ratio_over_floor_ratio_exist": round((eb / ea) / (fb / fa), 2) if ea and eb and fa and fb else None,
                          "idle_median_running_s": a, "busy_median_running_s": b,
                          "ratio_busy_idle_running": round(b / a, 2) if a and b else None, "goal_ratio": 2.0, **lat}
        print(f"failure -> restarted pods exist: idle {ea}s, while a {args.big}-node job is created {eb}s, "
              f"ratio {out['restart']['ratio_busy_idle_exist']}; -> Running: idle {a}s, busy {b}s, "
              f"ratio {out['restart']['ratio_busy_idle_running']} (goal <= 2); the floor (no operator, the "
              f"fewest requests): idle {fa}s, busy {fb}s, ratio {out['restart']['floor_ratio_busy_idle_exist']}; "
              f"ours over the floor's {out['restart']['ratio_over_floor_ratio_exist']}", flush=True)
        write(prov, out, logs)  # the huge run takes minutes: keep this part if it is cut short
        if args.huge > 0:
            mem = huge_rss(cluster, api, k8s, huge=args.huge, logs=logs)
            mem.update(chart_limit_mib=limit, ratio_rss_limit=round(mem["rss_after_mib"] / limit, 2),
                       ratio_peak_limit=round(mem["rss_peak_mib"] / limit, 2))
            out["memory"] = mem
            print(f"{args.huge}-node job: all pods in {mem['all_pods_exist_s']}s; operator RSS "
                  f"{mem['rss_after_mib']} MiB after (peak {mem['rss_peak_mib']}) vs chart limit {limit:g} MiB: "
                  f"{mem['ratio_rss_limit']} ({mem['ratio_peak_limit']} peak)", flush=True)
    finally:
        osc.bench_nodes(core, create=False)
        k8s.close()
    write(prov, out, logs)
    return 0


def write(prov: Provenance, out: dict, logs: Path) -> None:
    print(f"wrote {prov.write({**out, 'logs': str(logs)})} (operator logs: {logs})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
