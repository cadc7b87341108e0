"""Cost of MLflow tracking to training (issue 29; benchmark, not a test).

Steps/s of the built-in convnet on digits-sized batches (CPU, one thread) with the trainer's MLflow
tracker on (a healthy local `mlflow server`: sqlite, loopback) vs off, the tracker fed exactly what
the loop gives it: params once, then at every log step (every 10 steps) the loop's metrics dict
(loss read to the host in both arms). Blocks of steps alternate on/off so that drift of this
shared machine hits both alike; the tracker's thread runs throughout, so whatever it costs lands
in the blocks that cause it or the ones right after. Goal: ratio of steps/s on/off >= 0.99,
stated with a 95 % interval over block pairs.

Wall-clock steps/s is the goal's measure, but on a 2-core machine that other work shares (the
load average is recorded before and after) the other work's share of the cores swings from block
to block by more than the 1 % to be shown, and the server here takes its CPU from the same two
cores, which a real tracking server (another machine) does not. Steps per CPU-second of this
process on/off (`cpu_ratio_on_off`) swings too, by about 3 % from run to run (what runs on the
other core shares caches with this one). What the other work does not change is how much CPU
tracking itself takes in this process: the tracker thread's CPU and the training thread's own
time in the tracker's calls, against the training thread's CPU, block by block.
`serialized_bound_on_off` is the steps/s ratio training would keep if it did all of that itself,
one after the other: an upper bound of the cost where the tracker's thread has a core of its own
(it holds the GIL, which training may wait for, no longer than it runs). The server's CPU per
1,000 steps is reported apart.

Writes bench/results/mlflow_overhead.json.
Usage: .venv/bin/python bench/mlflow_overhead.py [--blocks 20] [--steps 1000]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))
from provenance import Provenance  # noqa: E402
from stats import ratio_interval, verdict  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "mlflow_overhead.json"


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes of process group `pgid` (the server's)."""
    total = 0.0
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                times = p.cpu_times()
                total += times.user + times.system
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue  # gone meanwhile
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=20)
    # About 5 s a block: each "on" block holds about one of the tracker's batched sends (FLUSH_SECONDS).
    ap.add_argument("--steps", type=int, default=1000)
    # The server on CPU 1, this process (training and the tracker's thread) on CPU 0: the server as
    # if on another machine (as it is in a cluster), the tracker sharing training's core (a pod's
    # worst case). Unpinned, the server's CPU competes with training on the same 2 cores.
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    prov = Provenance("api", "trainer", "bench", "tests/support/mlflow_server.py", out=args.out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.nn.functional as F

    from ddpjob_trainer import tracking
    from ddpjob_trainer.models import build_model
    from tests.support.mlflow_server import MlflowServer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_model("convnet", (1, 8, 8), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))

    with tempfile.TemporaryDirectory() as root:
        if args.pin:
            os.sched_setaffinity(0, {1})   # inherited by the server's processes, started now
        server = MlflowServer(Path(root))
        if args.pin:
            os.sched_setaffinity(0, {0})   # this thread, and the tracker's, started after
        try:
            server.wait_healthy()
            server.runs("warm-up")
            tracker = tracking.Tracker(tracking_uri=server.uri, experiment="bench", run_name="overhead",
                                       key=None, tags={"bench": "mlflow_overhead"}, warn=print,
                                       count_drop=lambda reason: None)
            assert tracker.ready.wait(60) and tracker.run_id, tracker.error
            tracker.params({"model": "convnet", "batch_size": 32, "checkpoint": {"dir": "/ckpt"}})
            step = 0

            def block(on: bool, n: int) -> tuple[float, float, float, float, float]:
                """(steps per wall second, steps per CPU second of this process, server CPU seconds,
                CPU seconds of this process's threads but the training one, the serialized bound)."""
                nonlocal step
                s0 = group_cpu_seconds(server.proc.pid)
                c0, m0 = time.process_time(), time.thread_time()
                t0 = time.perf_counter()
                calls = 0.0  # the training thread's own time in the tracker's calls
                for _ in range(n):
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    step += 1
                    if step % 10 == 0:
                        metrics = {"train_loss": loss.item(), "lr": 0.01, "step_seconds": 0.01,
                                   "data_wait_seconds": 0.0, "samples_per_second": 3200.0}
                        if on:
                            c = time.perf_counter()
                            tracker.metrics(metrics, step=step)
                            calls += time.perf_counter() - c
                wall = time.perf_counter() - t0
                main = time.thread_time() - m0
                cpu = time.process_time() - c0
                # Steps/s on/off if the training thread had to do all of tracking's work in this
                # process itself, one after the other: its calls count as without them, the
                # tracker thread's CPU (which holds the GIL the training could wait for) as added.
                bound = (main - calls) / (main + (cpu - main))
                return n / wall, n / cpu, group_cpu_seconds(server.proc.pid) - s0, cpu - main, bound

            block(True, args.steps)
            block(False, args.steps)  # warm-up
            pairs: list[tuple[float, float]] = []
            cpu_pairs: list[tuple[float, float]] = []
            server_cpu = {True: 0.0, False: 0.0}
            other_cpu = {True: 0.0, False: 0.0}   # this process's threads but the training one
            bounds: list[float] = []
            for b in range(args.blocks):
                order = (True, False) if b % 2 == 0 else (False, True)
                rate = {on: block(on, args.steps) for on in order}
                pairs.append((rate[True][0], rate[False][0]))
                cpu_pairs.append((rate[True][1], rate[False][1]))
                bounds.append(rate[True][4])
                for arm in (True, False):
                    server_cpu[arm] += rate[arm][2]
                    other_cpu[arm] += rate[arm][3]
            closed = tracker.close("FINISHED")
            lost = tracker.counts()
        finally:
            server.stop()
    ci = ratio_interval([on / off for on, off in pairs])
    cpu_ci = ratio_interval([on / off for on, off in cpu_pairs])
    bound_ci = ratio_interval(bounds)
    result = {"what": "steps/s with the MLflow tracker on (healthy local server) / off",
              "blocks": args.blocks, "steps_per_block": args.steps,
              "steps_per_second_on": statistics.median(p[0] for p in pairs),
              "steps_per_second_off": statistics.median(p[1] for p in pairs),
              "ratio_on_off": ci,
              "steps_per_cpu_second_on": statistics.median(p[0] for p in cpu_pairs),
              "steps_per_cpu_second_off": statistics.median(p[1] for p in cpu_pairs),
              "cpu_ratio_on_off": cpu_ci,
              "serialized_bound_on_off": bound_ci,
              "other_threads_cpu_seconds_per_1000_steps_on": 1000 * other_cpu[True] / (args.blocks * args.steps),
              "other_threads_cpu_seconds_per_1000_steps_off": 1000 * other_cpu[False] / (args.blocks * args.steps),
              "server_cpu_seconds_per_1000_steps_on": 1000 * server_cpu[True] / (args.blocks * args.steps),
              "server_cpu_seconds_per_1000_steps_off": 1000 * server_cpu[False] / (args.blocks * args.steps),
              "pinned": args.pin,
              "run_ended": closed, "calls_lost": lost,
              "verdict": verdict(ci, what="steps/s MLflow on/off", above_one="faster with MLflow",
                                 below_one="slower with MLflow"),
              "cpu_verdict": verdict(cpu_ci, what="steps per CPU-second of the training process MLflow on/off",
                                     above_one="cheaper with MLflow", below_one="costlier with MLflow"),
              "bound_verdict": f"steps/s on/off with all of tracking's in-process work serialized onto the "
                               f"training thread: {bound_ci['ratio']:.4f} (95 % interval {bound_ci['low']:.4f}-"
                               f"{bound_ci['high']:.4f}, {bound_ci['pairs']} blocks): goal >= 0.99 "
                               + ("met" if bound_ci["low"] >= 0.99 else "not shown")}
    prov.write(result, indent=1)
    print(result["verdict"])
    print(result["cpu_verdict"])
    print(result["bound_verdict"])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
