"""The built-in trainer's throughput against a plain hand-written DDP loop, as a guard (issue 45).

The arms are bench/trainer_overhead.py's: the built-in trainer through the in-pod launcher with
telemetry on, and bench/plain_ddp.py (same model, synthetic data, batch and DDP options), each real
torchrun on gloo with 2 ranks. Here they race: both run at once, rank r of either pinned to core
r, and each arm's steps per second are counted over the same seconds, those in which both trained
(the trainer's steps from its metrics directory, the loop's from the step times it prints). What
else the machine runs slows both alike in those seconds. Run one after the other, as the bench
does on a quiet machine, the same code measured single pairs of 0.44-1.49 here beside the other
sessions' load (4 pairs: 0.862, 95 % interval 0.38-1.95), and a build that slept 30 ms a step
0.810 (0.48-1.37): the two cannot be told apart. Raced, 0.93-1.07 (6 races under a 1-minute load
of 6-10), that build 0.83-0.85; one run of 3 races beside an idle cluster had one at 0.863 and a
mean of 0.925, too near the limit for a guard that must never flake, so longer races (the mean's
spread about a third smaller), and more of them while their interval holds the limit. RACES
races, the arm started first alternating; while the 95 % interval of their ratios holds MIN_RATIO
(bench/trainer_overhead.py), more races, up to MAX_RACES; the geometric mean of them all must be
at least MIN_RATIO, and the interval is printed. The bench keeps the tight goal (no difference
detectable, sequential pairs, both arms warmed).
"""
from __future__ import annotations

import bisect
import json
import os
import signal
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from ddpjob_trainer.agent import read_progress

from .helpers import REPO

# Races before the first look at the interval: on a quiet machine three decide (0.93-1.02 here,
# their interval 0.94-1.05), and each race costs two torchruns of CI's CPU, most of it their
# start-up (a race's common seconds are 10-25 of its 50-90).
RACES = 3
# Races while the interval of those so far straddles MIN_RATIO (a sequential test): the mean of
# them all decides. A loaded run's races spread 0.90-1.11 around 0.99 (its interval 0.89-1.10):
# five races' mean sits clear of 0.90 (its spread a fifth wider than seven's), and two races fewer
# are minutes of both cores that CI's slower machines lacked (stop 69: the session ran past its deadline).
MAX_RACES = 5
NPROC = 2
# Samples each arm trains on (the bench's 4096 take a few seconds): 96 steps a rank, most of
# them while both arms train.
TRAIN_SIZE = 12288
# Steps of the trainer's rank 0 the common seconds must hold for a ratio worth the name.
MIN_COMMON_STEPS = 20
POLL_SECONDS = 0.1


def _pin_workers(roots: list[int], pinned: dict[int, tuple[int, int]]) -> None:
    """Pin every process under `roots` that has RANK and LOCAL_RANK (a worker, or a process a worker
    started, which inherits them) to core RANK: each core then runs one rank of either arm, however
    the scheduler would have placed them. `pinned` maps each pinned pid to (its arm's root, RANK)."""
    cores = os.cpu_count() or 1
    for root in roots:
        try:
            children = psutil.Process(root).children(recursive=True)
        except psutil.Error:
            continue
        for child in children:
            if child.pid in pinned:
                continue
            try:
                env = child.environ()
                if "RANK" in env and "LOCAL_RANK" in env:
                    child.cpu_affinity([int(env["RANK"]) % cores])
                    pinned[child.pid] = (root, int(env["RANK"]))
            except psutil.Error:
                continue


def _rank0(metrics: Path):
    """The trainer's rank 0 progress (agent.read_progress), None while its metrics directory has
    none or holds a file still being created (prometheus_client sizes a new file after creating it:
    read in between, it is empty); the next look reads it."""
    try:
        return read_progress(str(metrics)).get(0)
    except (OSError, ValueError, struct.error):
        return None


def _count_at(times: list[float], t: float) -> float:
    """Steps done by time t, from each step's end time (interpolated between two steps)."""
    i = bisect.bisect_right(times, t)
    if i == 0 or i == len(times):
        return float(i)
    return i - 1 + (t - times[i - 1]) / (times[i] - times[i - 1])


def race(bench, *, ours_first: bool, workdir: Path) -> dict:
    """Both arms at once; each one's rank-0 steps per second over the seconds in which both trained."""
    config = {**bench.CONFIG, "synthetic": {**bench.CONFIG["synthetic"], "trainSize": TRAIN_SIZE}}
    metrics = workdir / "metrics"
    argv = {"ours": bench.ours_command(NPROC, config, str(workdir)), "plain": bench.plain_command(NPROC, config)}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for arm in ("ours", "plain") if ours_first else ("plain", "ours"):
            cmd, env = argv[arm]
            procs[arm] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True)
        ours: list[tuple[int, float]] = []  # (step, when it ended) of rank 0, at each look
        pinned: dict[int, tuple[int, int]] = {}
        deadline = time.monotonic() + 600
        while procs["ours"].poll() is None and time.monotonic() < deadline:
            _pin_workers([p.pid for p in procs.values()], pinned)
            p = _rank0(metrics)
            if p is not None and p.step and (not ours or p.step != ours[-1][0]):
                ours.append((p.step, p.stepped_at))
            time.sleep(POLL_SECONDS)
        out = {arm: proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for arm, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for arm, proc in procs.items():
        assert proc.returncode == 0, f"{arm} exited {proc.returncode}:\n{out[arm][-3000:]}"
    plain = json.loads(out["plain"].strip().splitlines()[-1])["step_times"]
    start, end = max(ours[0][1], plain[0]), min(ours[-1][1], plain[-1])
    common = [(step, t) for step, t in ours if start <= t <= end]
    assert len(common) >= 2 and common[-1][0] - common[0][0] >= MIN_COMMON_STEPS, (
        f"the arms trained together for too few steps to compare: ours {ours[0]}-{ours[-1]}, plain's steps "
        f"ended {plain[0]:.1f}-{plain[-1]:.1f}")
    (s0, t0), (s1, t1) = common[0], common[-1]
    ours_rate, plain_rate = (s1 - s0) / (t1 - t0), (_count_at(plain, t1) - _count_at(plain, t0)) / (t1 - t0)
    return {"ratio": ours_rate / plain_rate, "seconds": t1 - t0, "ours_steps_per_s": ours_rate,
            "plain_steps_per_s": plain_rate, "pinned": len(set(pinned.values()))}


@pytest.mark.timeout(1200)
def test_trainer_throughput_is_at_least_090_of_a_plain_ddp_loop(monkeypatch, tmp_path):
    # bench/ on the path for this test only (its modules import each other by their bare names).
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import stats
    import trainer_overhead as bench

    ratios, lines = [], []
    for i in range(MAX_RACES):
        if i >= RACES:
            ci = stats.ratio_interval(ratios)
            if not ci["low"] < bench.MIN_RATIO <= ci["high"]:
                break  # the interval is on one side of the limit: decided
        r = race(bench, ours_first=i % 2 == 0, workdir=Path(tempfile.mkdtemp(dir=tmp_path)))
        ratios.append(r["ratio"])
        lines.append(f"race {i + 1} ({'ours' if i % 2 == 0 else 'plain'} started first): over {r['seconds']:.1f} s "
                     f"of both training, ours {r['ours_steps_per_s']:.2f}, plain {r['plain_steps_per_s']:.2f} "
                     f"steps/s: {r['ratio']:.3f}; 1-minute load {os.getloadavg()[0]:.1f}")
        # Every rank of both arms (a process a worker starts counts as its rank): else the cores
        # were not shared alike.
        assert r["pinned"] == 2 * NPROC, (r, lines)
    ci = stats.ratio_interval(ratios)
    print("\n".join([*lines, stats.verdict(ci, what="throughput ours/plain, raced")]))
    assert ci["ratio"] >= bench.MIN_RATIO, (
        f"the built-in trainer steps at {ci['ratio']:.3f}x a plain DDP loop's rate (95 % interval {ci['low']:.3f}-"
        f"{ci['high']:.3f}, {len(ratios)} races), under the {bench.MIN_RATIO} asserted:\n" + "\n".join(lines))
