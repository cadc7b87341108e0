"""Built-in trainer vs a plain hand-written DDP loop: same model, data, batch size, DDP options.

Method (what makes the ratio mean something on a shared machine):
- both arms warmed once before measuring (imports, page cache, first-touch allocations);
- pairs in rotated order (ours first in even pairs, plain first in odd ones), so drift and
  "who runs first" hit both alike; >= 7 pairs;
- identical timing windows: each arm reports samples / (sum of its step-boundary-to-boundary
  times), the first step included, data wait included, loss read to the host at the same
  logEverySteps in both; evaluation, checkpoints and start-up are outside both windows;
- identical DDP: the plain loop wraps its model with the trainer's own `wrap_ddp` (same
  bucket size, static_graph, buffer handling, gradient_as_bucket_view);
- ours runs through the in-pod launcher with telemetry on (a multiprocess metrics dir), as in a pod.
With --snapshot-every N the arms are instead the built-in trainer with in-memory snapshots every N
steps and without (both with a checkpoint dir, disk checkpoints only at the epoch's end, outside
the window): what the snapshots cost training (bench/results/trainer_snapshot_overhead.json).
Prints the geometric-mean ratio ours/plain with a 95 % interval, worded "no difference
detectable within ±x %" when the interval holds 1.0; writes bench/results/trainer_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from stats import git_head, ratio_interval, verdict  # noqa: E402

# A constant learning rate: the plain loop has no scheduler, and the arms must do the same math
# (different weights can mean different speed on a CPU, e.g. through denormal floats).
CONFIG = {"dataset": "synthetic", "model": "convnet", "epochs": 1, "batchSize": 64, "lr": 0.01,
          "scheduler": "constant", "seed": 0, "logEverySteps": 20, "numWorkers": 0,
          "synthetic": {"trainSize": 4096, "valSize": 256, "shape": [3, 32, 32], "numClasses": 10, "seed": 1}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PET_NNODES": "1", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": str(nproc),
                "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(_port()), "NODE_RANK": "0",
                "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))})
    return env


def run_ours(nproc: int, snapshot_every: int | None = None) -> float:
    """Built-in trainer via the launcher; throughput from its result file. With `snapshot_every`
    (0: none) it checkpoints into a temp dir and snapshots into another."""
    with tempfile.TemporaryDirectory() as d:
        env = _env(nproc)
        config = dict(CONFIG)
        if snapshot_every is not None:
            config["checkpoint"] = {"dir": f"{d}/ckpt", "snapshotEverySteps": snapshot_every}
            env["DDPJOB_SNAPSHOT_DIR"] = f"/dev/shm/ddpjob-bench-{os.getpid()}"
        env.update({"DDPJOB_TRAINER_CONFIG": json.dumps(config), "DDPJOB_RESULT_FILE": f"{d}/r.json",
                    "DDPJOB_NAME": "bench", "DDPJOB_METRICS_DIR": f"{d}/metrics"})
        subprocess.run([sys.executable, "-m", "ddpjob_trainer.launch", "--metrics-port", "0", "--"],
                       env=env, check=True, capture_output=True, timeout=600)
        return json.loads(Path(f"{d}/r.json").read_text())["train_samples_per_second"]


def run_plain(nproc: int) -> float:
    """The peer loop under torchrun."""
    env = _env(nproc)
    env["BENCH_CONFIG"] = json.dumps(CONFIG)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", str(HERE / "plain_ddp.py")],
                         env=env, check=True, capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])["train_samples_per_second"]


def main() -> int:
    """Warm both, run rotated pairs, print the ratio with its interval, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--snapshot-every", type=int, default=None,
                    help="compare snapshots every N steps (ours) with none (plain) instead")
    args = ap.parse_args()
    if args.pairs < 2:
        ap.error("--pairs must be >= 2 for an interval")
    if args.snapshot_every is not None and args.snapshot_every < 1:
        ap.error("--snapshot-every must be >= 1")
    name = "trainer_overhead" if args.snapshot_every is None else "trainer_snapshot_overhead"
    args.out = args.out or str(HERE / "results" / f"{name}.json")
    if args.snapshot_every is None:
        def first() -> float:
            return run_ours(args.nproc)

        def peer() -> float:
            return run_plain(args.nproc)
    else:
        def first() -> float:
            return run_ours(args.nproc, args.snapshot_every)

        def peer() -> float:
            return run_ours(args.nproc, 0)
    first()
    peer()
    ours, plain, ratios, order = [], [], [], []
    for i in range(args.pairs):
        if i % 2 == 0:
            a, b = first(), peer()
        else:
            b, a = peer(), first()
        order.append("ours,plain" if i % 2 == 0 else "plain,ours")
        ours.append(a)
        plain.append(b)
        ratios.append(a / b)
        print(f"pair {i + 1}/{args.pairs} ({order[-1]}): ours {a:8.1f}  plain {b:8.1f} samples/s  "
              f"ratio {a / b:.3f}", flush=True)
    ci = ratio_interval(ratios)
    line = verdict(ci, what="throughput ours/plain" if args.snapshot_every is None
                   else f"throughput with snapshots every {args.snapshot_every} steps / without")
    result = {
        "benchmark": name, "snapshot_every": args.snapshot_every, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_head": git_head(), "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": CONFIG, "nproc": args.nproc, "backend": "gloo", "method": "rotated pairs, both warmed",
        "order": order, "ours_samples_per_second": ours, "plain_samples_per_second": plain,
        "pair_ratios": ratios, "ratio": ci["ratio"], "ratio_95ci": [ci["low"], ci["high"]],
        "verdict": line,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
