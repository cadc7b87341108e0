#!/usr/bin/env python3
"""Recovery from a SIGKILLed worker on the real nodes: restart in place vs the group restart (benchmark).

Both arms run examples/digits.yaml (2 pods, one per real node, checkpoints every 50 steps and at
each epoch's end on a shared volume, in-memory snapshots every 10 steps, the default) with the
operator installed by Helm from this tree's image, as tests/realpods does. Per run, once the ranks
report step >= --kill-at, the worker process of rank 1 is SIGKILLed from this host (the real nodes'
containers are this machine's processes: no pods/exec), the cause an OOM kill or a segfault is:
- `inplace`: the job as the example has it: the pods' torchrun agents restart their workers where
  they are (docs/restarts.md);
- `group`: the same job with `spec.elastic.maxRestarts: 0`, so the agent has no in-place budget,
  the pod fails and the operator restarts the group (new pods, a fresh /dev/shm, the disk
  checkpoint): what every failure cost before restarts in place.
Measured from the ranks themselves, on the pods' clocks (one machine: the same clock as the
kill's), by scraping each pod's metrics endpoint every --poll seconds from this host (the pods'
own addresses on the real nodes' bridges, hack/nodes-lib.sh's POD_RANGE, and nothing else):
- `kill_to_step_s`: the kill to the last rank's `first_step_timestamp_seconds` after it;
- `failure_to_step_s`: the agents' earliest failure timestamp (`worker_failure_timestamp_seconds`)
  to the same, what status.restartHistory's recoverySeconds derives from (read too: `status_*`);
- `steps_lost`: the step rank 1 had finished at the kill less the lowest `resumed_from_step`;
- `pods_recreated`: the pods before the kill whose UID is not among the pods the ranks stepped
  again in.
Per in-place run the pods' logs (`kubectl logs --timestamps`, the container runtime's clock) give
where the seconds go: `phases` (see PHASES). Each repeat runs both arms, their order alternating;
the cluster lock (/tmp/ddpjob-cluster.lock) is held per repeat, not for the whole bench, so other
users of the cluster wait at most one repeat. The load average is recorded before and after each
run; a run that saw a 1-minute load above --max-load (default: the CPU count) is flagged `loaded`.
Prints medians [min-max], each arm's 95 % t-interval, and in-place/group as the geometric mean of
the per-repeat ratios with its 95 % interval (bench/stats.py); writes bench/results/recovery.json.
Not a test: nothing here asserts timings.

    .venv/bin/python bench/recovery.py [--repeats 3] [--kill-at 37]
It takes the cluster lock itself, per repeat: do not run it under `flock` of the same lock.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import ipaddress
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import stats  # noqa: E402
from provenance import Provenance  # noqa: E402
from ddpjob_api import contract  # noqa: E402
from ddpjob_operator.decisions.samples import RankSample, parse_metrics  # noqa: E402
from tests.realpods.conftest import (apply_docs, example_docs, helm_install_operator,  # noqa: E402
                                     shared_checkpoint_pv)
from tests.support.cluster import Cluster, create_namespace, delete_namespace, wait_for  # noqa: E402

LOCK = "/tmp/ddpjob-cluster.lock"
ARMS = ("inplace", "group")
JOB_LABEL = "ddpjob.dev/job-name"
METRICS_PORT = 9400            # examples/digits.yaml sets none: the operator's default
# The real nodes' pod addresses (hack/nodes-lib.sh, its one home): the only ones this bench contacts.
POD_RANGE = ipaddress.IPv4Network(re.search(r"^POD_RANGE=(\S+)", (REPO / "hack" / "nodes-lib.sh").read_text(),
                                            re.M).group(1))  # type: ignore[union-attr]
START_TIMEOUT = 900            # job created -> rank 1 at --kill-at (pods start, torch imports, training)
RECOVERY_TIMEOUT = 600
STATUS_TIMEOUT = 120           # ranks stepped again -> the operator's restartHistory says so
# Where the seconds go, from the pods' log lines (the container runtime's timestamps): (name, rank,
# its pod before the kill ("old"), the one it stepped again in ("new": the same pod in place) or that
# one only when it is another pod ("recreated"),
# pattern of the first line at or after the kill), in the order they happen.
PHASES = (
    ("rank0_worker_failed", 0, "old", r"\[rank 0\] (training failed|process group teardown)|failed \(exitcode"),
    ("rank1_worker_failed_seen", 1, "old", r"failed \(exitcode: -9\)"),
    ("rank0_new_pod_first_line", 0, "recreated", r"."),  # a new pod's container started (the group arm)
    ("rank1_new_pod_first_line", 1, "recreated", r"."),
    ("rank0_marker", 0, "new", r"==> ddpjob: attempt \d+ restart \d+ <=="),  # the agent starts workers
    ("rank1_marker", 1, "new", r"==> ddpjob: attempt \d+ restart \d+ <=="),
    ("rank0_gloo_connected", 0, "new", r"\[Gloo\] Rank 0 is connected"),  # the process group is up
    ("rank0_resumed", 0, "new", r"resumed from"),
)


@contextlib.contextmanager
def cluster_lock() -> Iterator[None]:
    """The machine's shared cluster lock (everyone's real-pod tests take it)."""
    with open(LOCK, "a") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = time.monotonic() - t0
        if waited > 1:
            print(f"(waited {waited:.0f}s for the cluster lock)", flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def images() -> str:
    """hack/images.sh all from this tree (cached by its inputs' hash): the nodes run our trainer."""
    proc = subprocess.run(["bash", str(REPO / "hack" / "images.sh"), "all"], cwd=REPO, capture_output=True,
                          text=True, timeout=3000)
    if proc.returncode != 0:
        raise RuntimeError(f"hack/images.sh all failed:\n{proc.stderr[-3000:]}")
    return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""


def named_example(name: str) -> tuple[list[dict], str, dict]:
    """examples/digits.yaml as the real-pod tests apply it, named `name`, with its own claim: the
    docs, the claim's name and the DDPJob's spec (to change in place)."""
    docs = example_docs("digits.yaml")
    claim = f"{name}-ckpt"
    spec: dict = {}
    for d in docs:
        if d.get("kind") == "PersistentVolumeClaim":
            d["metadata"]["name"] = claim
        elif d.get("kind") == "DDPJob":
            d["metadata"]["name"] = name
            spec = d["spec"]
            for v in spec.get("volumes") or []:
                if "persistentVolumeClaim" in v:
                    v["persistentVolumeClaim"]["claimName"] = claim
    return docs, claim, spec


def job_docs(name: str, arm: str) -> tuple[list[dict], str]:
    """The example as named_example has it; the group arm without in-place budget. Returns the
    docs and the claim's name."""
    docs, claim, spec = named_example(name)
    if arm == "group":
        spec["elastic"] = {"maxRestarts": 0}
    return docs, claim


def load_fields(before: tuple[float, ...], max_load: float) -> dict[str, Any]:
    """A run's load averages, before it and now, and whether either 1-minute one passed max_load."""
    after = os.getloadavg()
    return {"load_avg_before": [round(x, 2) for x in before], "load_avg_after": [round(x, 2) for x in after],
            "loaded": max(before[0], after[0]) > max_load}


def fresh_logs_dir(out: str) -> Path:
    """<result>_logs beside the result, holding this run's pod logs only."""
    logs_dir = Path(out).with_suffix("").parent / (Path(out).stem + "_logs")
    logs_dir.mkdir(parents=True, exist_ok=True)
    for old in logs_dir.glob("*.log"):
        old.unlink()
    return logs_dir


def delete_job(cluster: Cluster, pods: Pods, ns: str, name: str, claim: str) -> None:
    """A bench job gone with its pods, its claim and the claim's volume."""
    cluster.kubectl("delete", "ddpj", name, "-n", ns, "--wait=true", check=False, timeout=180)
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not pods.list(), timeout=180, desc=f"{name}: pods gone", interval=1)
    cluster.kubectl("delete", "pvc", claim, "-n", ns, "--wait=false", check=False)
    cluster.kubectl("delete", "pv", f"{ns}-{claim}", "--wait=false", check=False)


class Pods:
    """The job's pods as the API sees them, and their ranks' metrics as their endpoints serve them."""

    def __init__(self, core: Any, ns: str, job: str) -> None:
        self.core, self.ns, self.job = core, ns, job

    def list(self) -> list[Any]:
        return self.core.list_namespaced_pod(self.ns, label_selector=f"{JOB_LABEL}={self.job}").items

    def uids(self) -> dict[str, str]:
        return {p.metadata.name: p.metadata.uid for p in self.list() if not p.metadata.deletion_timestamp}

    def scrape(self) -> dict[str, tuple[str, dict[int, RankSample]]]:
        """{pod name: (uid, {rank: sample})} for every Running pod whose endpoint answered."""
        out = {}
        for p in self.list():
            ip = p.status.pod_ip
            if p.status.phase != "Running" or not ip:
                continue
            if ipaddress.IPv4Address(ip) not in POD_RANGE:  # the network rule: only our real nodes' pods
                raise RuntimeError(f"pod {p.metadata.name} has address {ip}, outside the real nodes' {POD_RANGE}")
            try:
                with urllib.request.urlopen(f"http://{ip}:{METRICS_PORT}/metrics", timeout=2) as r:
                    out[p.metadata.name] = (p.metadata.uid, parse_metrics(r.read().decode()))
            except OSError:
                continue
        return out


def ranks(scraped: dict[str, tuple[str, dict[int, RankSample]]]) -> dict[int, RankSample]:
    return {rank: s for _uid, samples in scraped.values() for rank, s in samples.items()}


def kill_worker(ns: str, job: str, rank: int) -> tuple[int, float]:
    """SIGKILL the training worker of `rank` (the process torchrun's agent started: its parent is
    the agent), found through /proc by its environment; (pid, Unix time of the kill)."""
    def env_of(pid: str) -> dict[str, str]:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"ddpjob_trainer" not in cmd or b"ddpjob_trainer.agent" in cmd or b"ddpjob_trainer.launch" in cmd:
                continue
            env = env_of(pid)
            ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if (env.get(contract.ENV_JOB_NAME) == job and env.get(contract.ENV_JOB_NAMESPACE) == ns
                and env.get("RANK") == str(rank) and b"ddpjob_trainer.agent" in parent):
            found.append(int(pid))
    if len(found) != 1:
        raise RuntimeError(f"expected one worker of rank {rank} of {ns}/{job}, found pids {found}")
    at = time.time()
    os.kill(found[0], signal.SIGKILL)
    return found[0], at


def first_line_at(log: str, pattern: str, after: float) -> float | None:
    """Unix time of the first line at or after `after` matching `pattern` (`kubectl logs --timestamps`)."""
    rx = re.compile(pattern)
    for line in log.splitlines():
        stamp, _, text = line.partition(" ")
        try:
            t = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        if t >= after - 0.5 and rx.search(text):  # the runtime stamps a line when it reads it
            return t
    return None


def run_arm(cluster: Cluster, core: Any, ns: str, arm: str, name: str, tmp: Path, args: argparse.Namespace,
            logs_dir: Path) -> dict[str, Any]:
    """One job: start, train to --kill-at, SIGKILL rank 1's worker, measure its recovery, delete."""
    docs, claim = job_docs(name, arm)
    pv = shared_checkpoint_pv(cluster, claim=claim, namespace=ns, tmp=tmp)
    pods = Pods(core, ns, name)
    load_before = os.getloadavg()
    res: dict[str, Any] = {"arm": arm, "job": name}
    apply_docs(cluster, docs, ns)
    try:
        t_applied = time.monotonic()

        def at_kill_step():
            scraped = pods.scrape()
            rs = ranks(scraped)
            done = len(rs) == 2 and all((s.step or 0) >= args.kill_at for s in rs.values())
            return (rs, {r: pod for pod, (_u, samples) in scraped.items() for r in samples}) if done else None
        before, old_pods = wait_for(at_kill_step, timeout=START_TIMEOUT, desc=f"{name}: both ranks at step {args.kill_at}",
                          interval=args.poll)
        res["start_to_kill_step_s"] = round(time.monotonic() - t_applied, 1)
        uids = pods.uids()
        pid, t_kill = kill_worker(ns, name, rank=1)
        # The step rank 1 had finished at the kill: its last scrape, or a step more that it finished since.
        res.update(killed_pid=pid, kill_time=t_kill, step_before_kill=before[1].step)
        failures: dict[tuple[str, str, str], dict] = {}
        pod_lost_at: float | None = None
        firsts: dict[int, tuple[float, int]] = {}
        new_pods: dict[int, tuple[str, str]] = {}  # rank -> (pod, uid) it stepped again in
        stages: dict[str, float] = {}  # "rank R STAGE": when the new worker of rank R entered STAGE

        def recovered():
            nonlocal pod_lost_at
            scraped = pods.scrape()
            if pod_lost_at is None and set(uids.values()) - {u for u, _ in scraped.values()}:
                pod_lost_at = time.time()  # an old pod stopped answering (the group arm: it failed)
            for pod, (uid, samples) in scraped.items():
                for rank, s in samples.items():
                    for f in s.worker_failures:
                        if float(f["time"]) >= t_kill - 1:
                            failures[(pod, str(rank), str(f.get("restart")))] = {"pod": pod, "rank": rank, **f}
                    if s.stage and s.stage_started_at and s.stage_started_at > t_kill:
                        stages.setdefault(f"rank{rank}_{s.stage}", s.stage_started_at)
                    if s.first_step_timestamp and s.first_step_timestamp > t_kill:
                        firsts[rank] = (s.first_step_timestamp, int(s.resumed_from_step or 0))
                        new_pods[rank] = (pod, uid)
            return len(firsts) == 2
        wait_for(recovered, timeout=RECOVERY_TIMEOUT, desc=f"{name}: every rank stepping again", interval=args.poll)
        t_step = max(ts for ts, _ in firsts.values())
        resumed = min(step for _, step in firsts.values())
        t_fail = min((float(f["time"]) for f in failures.values()), default=None)
        rank1_failure = [f for f in failures.values() if f["rank"] == 1]
        step_at_failure = max([int(f["step"]) for f in rank1_failure if str(f.get("step", "")).isdigit()]
                              + [before[1].step or 0])
        stepping = {uid for _pod, uid in new_pods.values()}
        res.update({
            "kill_to_step_s": round(t_step - t_kill, 3),
            "failure_to_step_s": round(t_step - t_fail, 3) if t_fail else None,
            "kill_to_agent_failure_s": round(t_fail - t_kill, 3) if t_fail else None,
            "first_step_after": {str(r): round(ts - t_kill, 3) for r, (ts, _) in sorted(firsts.items())},
            # Seen by the scrapes: a stage shorter than --poll may be missed, a time seen is exact.
            "stages_after": {k: round(v - t_kill, 3) for k, v in sorted(stages.items(), key=lambda kv: kv[1])},
            "step_at_failure": step_at_failure, "resumed_from_step": resumed,
            "steps_lost": max(0, step_at_failure - resumed),
            "pods_recreated": sorted(p for p, u in uids.items() if u not in stepping),
            "agent_failures": sorted(failures.values(), key=lambda f: float(f["time"])),
        })
        if pod_lost_at is not None:
            res["kill_to_old_pod_gone_s"] = round(pod_lost_at - t_kill, 3)

        # The operator's account of the same restart (its scrape, every 3 s in this install).
        kind = "InPlace" if arm == "inplace" else "Group"

        def entry():
            out = cluster.kubectl("get", "ddpj", name, "-n", ns, "-o", "json").stdout
            hist = (json.loads(out).get("status") or {}).get("restartHistory") or []
            return next((e for e in hist if e.get("kind") == kind and "recoverySeconds" in e), None)
        try:
            e = wait_for(entry, timeout=STATUS_TIMEOUT, desc=f"{name}: {kind} recovery in status", interval=1)
            res.update(status_recovery_s=e["recoverySeconds"], status_steps_lost=e.get("stepsLost"),
                       status_resumed_from=e.get("resumedFromStep"), status_entry=e)
        except AssertionError as exc:
            res["status_error"] = str(exc)[:300]

        # The pods' logs from just before the kill, kept for the breakdown.
        pod_logs = {}
        for pod in sorted(set(old_pods.values()) | {p for p, _u in new_pods.values()}):
            log = cluster.kubectl("logs", "-n", ns, pod, "-c", "trainer", "--timestamps", check=False, timeout=60).stdout
            pod_logs[pod] = "\n".join(ln for ln in log.splitlines() if first_line_at(ln, ".", t_kill - 5))
            (logs_dir / f"{pod}.log").write_text(pod_logs[pod] + "\n")
        res["phases"] = {}
        for phase, rank, which, pattern in PHASES:
            pod = old_pods.get(rank) if which == "old" else new_pods.get(rank, ("", ""))[0]
            if which == "recreated" and pod == old_pods.get(rank):
                continue
            t = first_line_at(pod_logs.get(pod or "", ""), pattern, t_kill)
            res["phases"][phase] = round(t - t_kill, 3) if t else None
        return res
    finally:
        res.update(load_fields(load_before, args.max_load))
        delete_job(cluster, pods, ns, name, claim)
        del pv


def summary(values: list[float]) -> dict[str, Any]:
    """Median [min-max] and the mean's 95 % t-interval (None with fewer than 2 values)."""
    out: dict[str, Any] = {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                           "max": round(max(values), 3), "n": len(values)}
    if len(values) >= 2:
        mean = stats.mean_interval(values)
        out["mean_95ci"] = [round(mean["low"], 3), round(mean["high"], 3)]
    return out


def report(prov: Provenance, runs: list[dict[str, Any]], arms: list[str], args: argparse.Namespace,
           load_start: tuple[float, ...], *, final: bool) -> None:
    """Write the results so far (after each repeat: a run cut short keeps what it measured); print them at the end."""
    by_arm = {a: [r for r in runs if r["arm"] == a] for a in arms}
    result: dict[str, Any] = {
        "benchmark": "recovery",
        "job": "examples/digits.yaml (2 pods on the 2 real nodes, convnet, CPU, gloo; disk checkpoints every 50 "
               "steps and at epoch ends, snapshots every 10 steps)",
        "kill": f"SIGKILL of rank 1's worker once both ranks finished step {args.kill_at}",
        "arms": {"inplace": "the example as is: torchrun's agents restart the workers in place",
                 "group": "spec.elastic.maxRestarts 0: the pod fails, the operator restarts the group"},
        "repeats": args.repeats, "repeats_done": len({r["repeat"] for r in runs}),
        "lock": "held for the whole run" if args.hold_lock else "held per repeat", "poll_seconds": args.poll, "load_avg_at_start": load_start,
        "load_avg_at_end": os.getloadavg(), "max_load": args.max_load,
        "loaded_runs": sum(1 for r in runs if r["loaded"]), "runs": runs,
    }
    for metric in ("kill_to_step_s", "failure_to_step_s", "status_recovery_s", "steps_lost"):
        result[metric] = {a: summary([r[metric] for r in rs if r.get(metric) is not None])
                          for a, rs in by_arm.items() if any(r.get(metric) is not None for r in rs)}
    pairs = [(ip["kill_to_step_s"], gr["kill_to_step_s"]) for ip, gr in
             zip(by_arm.get("inplace", []), by_arm.get("group", []))]
    if len(pairs) >= 2:
        ci = stats.ratio_interval([a / b for a, b in pairs])
        result["ratio_inplace_over_group"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in ci.items()}
    for a, rs in by_arm.items():
        for key in ("phases", "stages_after"):
            seen = [r[key] for r in rs if r.get(key)]
            names = sorted({k for p in seen for k in p}, key=lambda k: statistics.median(
                [p[k] for p in seen if p.get(k) is not None] or [0]))
            result.setdefault(f"{key}_median_s", {})[a] = {
                k: round(statistics.median(vs), 3) for k in names if (vs := [p[k] for p in seen if p.get(k) is not None])}
    prov.write(result)
    if not final:
        return
    for metric in ("kill_to_step_s", "failure_to_step_s", "status_recovery_s", "steps_lost"):
        for a, s in result.get(metric, {}).items():
            print(f"{metric:18} {a:8} median {s['median']} [{s['min']}-{s['max']}] n={s['n']}"
                  + (f" mean 95 % interval {s['mean_95ci']}" if "mean_95ci" in s else ""))
    if "ratio_inplace_over_group" in result:
        ci = result["ratio_inplace_over_group"]
        print(f"in-place / group (kill -> every rank stepping): {ci['ratio']:.3f} "
              f"(95 % interval {ci['low']:.3f}-{ci['high']:.3f}, {ci['pairs']} pairs)")
    print(f"{result['loaded_runs']} of {len(runs)} runs on a loaded machine (1-min load > {args.max_load:g})")




def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--kill-at", type=int, default=37,
                    help="kill once both ranks finished this step (examples/digits.yaml: disk checkpoints at "
                         "steps 23 (epoch end) and 46; snapshots every 10)")
    ap.add_argument("--poll", type=float, default=0.25, help="seconds between scrapes of the pods")
    ap.add_argument("--max-load", type=float, default=float(os.cpu_count() or 1))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "recovery.json"))
    ap.add_argument("--hold-lock", action="store_true",
                    help="hold the cluster lock for the whole run, not per repeat (where others hold it for long)")
    args = ap.parse_args()
    # The real pods run the images `make images` built from this tree (hack/images.sh), with the
    # chart and the example from it: everything that goes into them is measured.
    prov = Provenance("api", "operator", "trainer", "cli", "bench", "hack", "charts", "examples", "Dockerfile",
                      "requirements", "pyproject.toml", out=args.out)
    arms = [a for a in args.arms.split(",") if a]
    cluster = Cluster()
    if not cluster.healthy():
        print("the local cluster is not up (make cluster-up); this bench does not start it", file=sys.stderr)
        return 2
    api = cluster.api()
    load_start = os.getloadavg()
    logs_dir = fresh_logs_dir(args.out)
    with cluster_lock() if args.hold_lock else contextlib.nullcontext():
        runs = repeats(prov, cluster, api, arms, args, logs_dir, load_start,
                       lock=contextlib.nullcontext if args.hold_lock else cluster_lock)
    report(prov, runs, arms, args, load_start, final=True)
    return 0


def repeats(prov: Provenance, cluster: Cluster, api: Any, arms: list[str], args: argparse.Namespace, logs_dir: Path,
            load_start: tuple[float, ...], *, lock: Any) -> list[dict[str, Any]]:
    """Install the operator, run every repeat (each under `lock()`), uninstall; the runs."""
    from kubernetes import client
    core = client.CoreV1Api(api)
    tmp = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    op_ns, release = f"ddpjob-op-{uuid.uuid4().hex[:6]}", f"op{uuid.uuid4().hex[:6]}"
    runs: list[dict[str, Any]] = []
    with lock():
        print(f"images: {images()}", flush=True)
        ns = create_namespace(api, prefix="bench-recovery-")
        helm_install_operator(cluster, namespace=op_ns, watch=[ns], name=release)
    try:
        for i in range(args.repeats):
            order = arms if i % 2 == 0 else arms[::-1]
            with lock():
                images()  # another session may have imported its own trainer:dev since
                for arm in order:
                    res = run_arm(cluster, core, ns, arm, f"rec-{arm}-{i}", tmp, args, logs_dir)
                    res["repeat"] = i
                    runs.append(res)
                    print(f"repeat {i} {arm}: kill -> every rank stepping {res['kill_to_step_s']}s "
                          f"(agent failure -> step {res['failure_to_step_s']}s; status {res.get('status_recovery_s')}s), "
                          f"steps lost {res['steps_lost']} (step {res['step_at_failure']} -> "
                          f"{res['resumed_from_step']}), pods recreated {res['pods_recreated']}, "
                          f"load {res['load_avg_before'][0]}->{res['load_avg_after'][0]}"
                          + (" LOADED" if res["loaded"] else "") + f"; phases {res['phases']}", flush=True)
            report(prov, runs, arms, args, load_start, final=False)
    finally:
        with lock():
            cluster.helm("uninstall", release, "-n", op_ns, "--wait", "--timeout", "60s", check=False, timeout=90)
            for n in (ns, op_ns):
                with contextlib.suppress(Exception):
                    delete_namespace(api, n)
        api.close()
    return runs


if __name__ == "__main__":
    sys.exit(main())
