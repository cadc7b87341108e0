#!/usr/bin/env python3
"""Steps lost to one pod loss on the real nodes: per-step fault tolerance vs the replace path (benchmark).

Both arms run examples/digits.yaml (2 pods, one per real node, the convnet on CPU, gloo) with the
operator installed by Helm from this tree's image, as tests/realpods does, for more epochs than the
measurement needs, every rank sleeping --step-sleep after each step (debug.py) so that both arms
step at the same pace however loaded the machine is. Once pod 0's rank reports step --warm, its
steps are scraped for --before seconds (the pace before), then pod 1 is force-deleted (`kubectl
delete --grace-period=0 --force`: the node or the pod gone without a goodbye, no stop-vote save)
and pod 0 is scraped for --window seconds more:
- `perstep`: the job with `spec.faultTolerance: {mode: perStep}` (its defaults; no disk
  checkpoints, which that mode refuses): pod 0's group steps on alone, the replacement joins the
  quorum and takes pod 0's weights (docs/trainer.md);
- `replace`: the example as is (disk checkpoints every 50 steps): the operator replaces pod 1
  alone, pod 0's workers restart in place, wait for it in the rendezvous, and every rank resumes
  from the newest checkpoint (docs/restarts.md);
- `undisturbed` (only with --arms): the per-step job with nothing deleted; with --to-end every job
  runs to its end and its accuracy is recorded, the done-when's "within 0.01 of an undisturbed run".
Measured, from pod 0's own metrics endpoint (scraped every --poll seconds from this host: the
pods' addresses on the real nodes' bridges and nothing else) and its log's timestamps:
- `steps_lost`: the steps pod 0 would have made in the window at its pace before, less the steps
  it made (its step after the window less its step at the deletion: a resume from an older
  checkpoint counts against it), per minute of window;
- `kept`: the share of the window's steps that it made (1 - lost share): paired perstep/replace,
  as a geometric mean ratio with its 95 % interval (bench/stats.py);
- per-step only, from the pods' logs (`ft: step N participants P` a step, `ft: joined at step`):
  `pause_s`, the longest gap between pod 0's steps in the window (against `step_gap_s`, its
  median gap before), and `join_s`, the replacement's first log line (its container started) to
  its first step.
Each repeat runs both arms, their order alternating; the load average is recorded per run. Writes
bench/results/perstep_loss.json. Not a test: nothing here asserts timings.

    .venv/bin/python bench/perstep_loss.py [--repeats 3]
It takes the cluster lock itself, per repeat.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import stats  # noqa: E402
from provenance import Provenance  # noqa: E402
from recovery import (Pods, cluster_lock, delete_job, first_line_at, fresh_logs_dir, images, load_fields,  # noqa: E402
                      named_example, ranks, summary)
from tests.realpods.conftest import apply_docs, helm_install_operator, shared_checkpoint_pv  # noqa: E402
from tests.support.cluster import Cluster, create_namespace, delete_namespace, wait_for  # noqa: E402

ARMS = ("perstep", "replace")  # and "undisturbed": the per-step job, nothing deleted (--to-end: its accuracy)
METRICS = ("steps_lost", "kept", "pace_steps_per_s", "pause_s", "step_gap_s", "join_s", "delete_to_join_s",
           "eval_accuracy")
START_TIMEOUT = 900   # job created -> pod 0 at --warm (pods start, torch imports, the quorum)
STEP_LINE = re.compile(r"ft: step (\d+) participants (\d+)")
JOINED_LINE = re.compile(r"ft: joined at step (\d+)")


def job_docs(name: str, arm: str, args: argparse.Namespace) -> tuple[list[dict], str]:
    """The example named `name` with its own claim, long enough for the window, paced; the
    per-step arm with faultTolerance on and no disk checkpoints. The docs and the claim's name."""
    docs, claim, spec = named_example(name)
    spec["trainer"]["epochs"] = args.epochs
    spec["trainer"]["logEverySteps"] = 1
    spec["env"] = [*(spec.get("env") or []), {"name": "DDPJOB_DEBUG_STEP_SLEEP", "value": str(args.step_sleep)}]
    if arm in ("perstep", "undisturbed"):
        spec["faultTolerance"] = {"mode": "perStep"}
        spec["trainer"].pop("checkpoint", None)
    return docs, claim


def timed_lines(log: str, pattern: re.Pattern[str]) -> list[tuple[float, re.Match[str]]]:
    """(Unix time, match) of each `kubectl logs --timestamps` line matching `pattern`."""
    out = []
    for line in log.splitlines():
        m = pattern.search(line)
        t = first_line_at(line, ".", 0) if m else None
        if m and t is not None:
            out.append((t, m))
    return out


def run_arm(cluster: Cluster, core: Any, ns: str, arm: str, name: str, tmp: Path, args: argparse.Namespace,
            logs_dir: Path) -> dict[str, Any]:
    """One job: start, train to --warm, the pace before, force-delete pod 1, the window, delete."""
    docs, claim = job_docs(name, arm, args)
    pv = shared_checkpoint_pv(cluster, claim=claim, namespace=ns, tmp=tmp)
    pods = Pods(core, ns, name)
    pod0, pod1 = f"{name}-0", f"{name}-1"
    load_before = os.getloadavg()
    res: dict[str, Any] = {"arm": arm, "job": name}
    apply_docs(cluster, docs, ns)
    try:
        def step0() -> int | None:
            got = pods.scrape().get(pod0)
            rs = ranks({pod0: got}) if got else {}
            return rs[0].step if 0 in rs and rs[0].step is not None else None

        t_applied = time.monotonic()
        wait_for(lambda: (step0() or 0) >= args.warm and len(pods.scrape()) == 2, timeout=START_TIMEOUT,
                 desc=f"{name}: pod 0 at step {args.warm}, both pods serving", interval=args.poll)
        res["start_to_warm_s"] = round(time.monotonic() - t_applied, 1)

        def trace(seconds: float) -> list[tuple[float, int]]:
            seen, end = [], time.time() + seconds
            while time.time() < end:
                s = step0()
                if s is not None:
                    seen.append((time.time(), s))
                time.sleep(args.poll)
            return seen
        before = trace(args.before)
        t_del = time.time()
        if arm != "undisturbed":
            cluster.kubectl("delete", "pod", pod1, "-n", ns, "--grace-period=0", "--force", "--wait=false")
        after = trace(args.window)
        if len(before) < 2 or not after:
            raise RuntimeError(f"{name}: pod 0's endpoint answered too rarely ({len(before)} before, {len(after)} after)")
        pace = (before[-1][1] - before[0][1]) / (before[-1][0] - before[0][0])  # steps a second
        at_del, at_end = before[-1][1], after[-1][1]
        span = after[-1][0] - t_del
        expected = pace * span
        made = at_end - at_del
        res.update(pace_steps_per_s=round(pace, 3), step_at_delete=at_del, step_at_end=at_end,
                   window_s=round(span, 2), expected_steps=round(expected, 1), steps_made=made,
                   steps_lost=round((expected - made) * 60 / span, 2), kept=round(made / expected, 4) if expected else None,
                   lowest_step_after=min(s for _t, s in after))
        if args.to_end:  # the job's own end: its accuracy, against an undisturbed run's
            def ended():
                out = cluster.kubectl("get", "ddpj", name, "-n", ns, "-o", "json").stdout
                st = json.loads(out).get("status") or {}
                return st if st.get("phase") in ("Succeeded", "Failed") else None
            st = wait_for(ended, timeout=1800, desc=f"{name}: the job's end", interval=2)
            res.update(phase=st["phase"], eval_accuracy=(st.get("result") or {}).get("evalAccuracy"))

        logs = {}
        for pod in sorted(p.metadata.name for p in pods.list()) + [pod1]:
            log = cluster.kubectl("logs", "-n", ns, pod, "-c", "trainer", "--timestamps", check=False, timeout=60).stdout
            if log:
                logs[pod] = log
                (logs_dir / f"{pod}.log").write_text(log + "\n")
        if arm != "replace":
            steps = [t for t, _m in timed_lines(logs.get(pod0, ""), STEP_LINE)]
            gaps_before = [b - a for a, b in zip(steps, steps[1:]) if b < t_del]
            in_window = [t for t in steps if t_del - 5 <= t <= t_del + span]
            gaps_after = [b - a for a, b in zip(in_window, in_window[1:]) if b >= t_del]
            res["step_gap_s"] = round(statistics.median(gaps_before), 3) if gaps_before else None
            res["pause_s"] = round(max(gaps_after), 3) if gaps_after else None
            new = f"{pod1}-r1"
            first = first_line_at(logs.get(new, ""), ".", t_del)
            joined = timed_lines(logs.get(new, ""), JOINED_LINE)
            stepped = timed_lines(logs.get(new, ""), STEP_LINE)
            if first is not None and stepped:
                res["join_s"] = round(stepped[0][0] - first, 3)
                res["delete_to_join_s"] = round(stepped[0][0] - t_del, 3)
            res["joined_at_step"] = int(joined[0][1].group(1)) if joined else None
            res["participants_after"] = sorted({int(m.group(2)) for t, m in timed_lines(logs.get(pod0, ""), STEP_LINE)
                                                if t >= t_del})
        return res
    finally:
        res.update(load_fields(load_before, args.max_load))
        delete_job(cluster, pods, ns, name, claim)
        del pv


def report(prov: Provenance, runs: list[dict[str, Any]], arms: list[str], args: argparse.Namespace,
           load_start: tuple[float, ...], *, final: bool) -> None:
    """Write the results so far (after each repeat); print them at the end."""
    by_arm = {a: [r for r in runs if r["arm"] == a] for a in arms}
    result: dict[str, Any] = {
        "benchmark": "perstep_loss",
        "job": f"examples/digits.yaml (2 pods on the 2 real nodes, convnet, CPU, gloo), {args.epochs} epochs, "
               f"every rank sleeping {args.step_sleep}s a step",
        "loss": f"pod 1 force-deleted (grace 0) once pod 0 stepped past {args.warm} and its pace was measured for "
                f"{args.before}s; pod 0 then scraped for {args.window}s",
        "arms": {"perstep": "spec.faultTolerance {mode: perStep} (defaults), no disk checkpoints",
                 "replace": "the example as is: pod 1 replaced alone, every rank resumes from the newest checkpoint"},
        "repeats": args.repeats, "repeats_done": len({r["repeat"] for r in runs}), "poll_seconds": args.poll,
        "load_avg_at_start": load_start, "load_avg_at_end": os.getloadavg(), "max_load": args.max_load,
        "loaded_runs": sum(1 for r in runs if r["loaded"]), "runs": runs,
    }
    for metric in METRICS:
        result[metric] = {a: summary([r[metric] for r in rs if r.get(metric) is not None])
                          for a, rs in by_arm.items() if any(r.get(metric) is not None for r in rs)}
    pairs = [(p["kept"], r["kept"]) for p, r in zip(by_arm.get("perstep", []), by_arm.get("replace", []))
             if p.get("kept") and r.get("kept")]
    if len(pairs) >= 2 and all(a > 0 and b > 0 for a, b in pairs):
        ci = stats.ratio_interval([a / b for a, b in pairs])
        result["kept_ratio_perstep_over_replace"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in ci.items()}
    diffs = [r["steps_lost"] - p["steps_lost"] for p, r in zip(by_arm.get("perstep", []), by_arm.get("replace", []))]
    if len(diffs) >= 2:
        ci = stats.mean_interval(diffs)
        result["steps_lost_saved_per_min"] = {k: round(v, 2) if isinstance(v, float) else v for k, v in ci.items()}
    prov.write(result)
    if not final:
        return
    for metric in METRICS:
        for a, s in result.get(metric, {}).items():
            print(f"{metric:17} {a:8} median {s['median']} [{s['min']}-{s['max']}] n={s['n']}"
                  + (f" mean 95 % interval {s['mean_95ci']}" if "mean_95ci" in s else ""))
    if "kept_ratio_perstep_over_replace" in result:
        ci = result["kept_ratio_perstep_over_replace"]
        print(f"steps made in the window, perstep / replace: {ci['ratio']:.3f} "
              f"(95 % interval {ci['low']:.3f}-{ci['high']:.3f}, {ci['pairs']} pairs)")
    if "steps_lost_saved_per_min" in result:
        ci = result["steps_lost_saved_per_min"]
        print(f"steps a minute the per-step mode saves: {ci['mean']:.1f} (95 % interval {ci['low']:.1f}-{ci['high']:.1f})")
    print(f"{result['loaded_runs']} of {len(runs)} runs on a loaded machine (1-min load > {args.max_load:g})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--warm", type=int, default=20, help="pod 0's step from which its pace is measured")
    ap.add_argument("--before", type=float, default=20, help="seconds of pace measured before the deletion")
    ap.add_argument("--window", type=float, default=60, help="seconds measured after the deletion")
    ap.add_argument("--epochs", type=int, default=40, help="more than --warm, --before and --window take")
    ap.add_argument("--step-sleep", type=float, default=0.2)
    ap.add_argument("--poll", type=float, default=0.25, help="seconds between scrapes of pod 0")
    ap.add_argument("--to-end", action="store_true", help="wait for each job's end and record its accuracy")
    ap.add_argument("--max-load", type=float, default=float(os.cpu_count() or 1))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "perstep_loss.json"))
    args = ap.parse_args()
    prov = Provenance("api", "operator", "trainer", "cli", "bench", "hack", "charts", "examples", "Dockerfile",
                      "requirements", "pyproject.toml", out=args.out)
    arms = [a for a in args.arms.split(",") if a]
    cluster = Cluster()
    if not cluster.healthy():
        print("the local cluster is not up (make cluster-up); this bench does not start it", file=sys.stderr)
        return 2
    api = cluster.api()
    from kubernetes import client
    core = client.CoreV1Api(api)
    load_start = os.getloadavg()
    logs_dir = fresh_logs_dir(args.out)
    tmp = Path(tempfile.mkdtemp(prefix="perstep-bench-"))
    op_ns, release = f"ddpjob-op-{uuid.uuid4().hex[:6]}", f"op{uuid.uuid4().hex[:6]}"
    runs: list[dict[str, Any]] = []
    with cluster_lock():
        print(f"images: {images()}", flush=True)
        ns = create_namespace(api, prefix="bench-perstep-")
        helm_install_operator(cluster, namespace=op_ns, watch=[ns], name=release)
    try:
        for i in range(args.repeats):
            with cluster_lock():
                images()
                for arm in (arms if i % 2 == 0 else arms[::-1]):
                    res = run_arm(cluster, core, ns, arm, f"ps-{arm}-{i}", tmp, args, logs_dir)
                    res["repeat"] = i
                    runs.append(res)
                    print(f"repeat {i} {arm}: {json.dumps({k: v for k, v in res.items() if k not in ('arm', 'repeat')})}",
                          flush=True)
            report(prov, runs, arms, args, load_start, final=False)
    finally:
        with cluster_lock():
            cluster.helm("uninstall", release, "-n", op_ns, "--wait", "--timeout", "60s", check=False, timeout=90)
            for n in (ns, op_ns):
                with contextlib.suppress(Exception):
                    delete_namespace(api, n)
        api.close()
    report(prov, runs, arms, args, load_start, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
