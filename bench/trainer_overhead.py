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


def run_ours(nproc: int) -> float:
    """Built-in trainer via the launcher; throughput from its result file."""
    with tempfile.TemporaryDirectory() as d:
        env = _env(nproc)
        env.update({"DDPJOB_TRAINER_CONFIG": json.dumps(CONFIG), "DDPJOB_RESULT_FILE": f"{d}/r.json",
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
    ap.add_argument("--out", default=str(HERE / "results" / "trainer_overhead.json"))
    args = ap.parse_args()
    if args.pairs < 2:
        ap.error("--pairs must be >= 2 for an interval")
    run_ours(args.nproc)
    run_plain(args.nproc)
    ours, plain, ratios, order = [], [], [], []
    for i in range(args.pairs):
        if i % 2 == 0:
            a, b = run_ours(args.nproc), run_plain(args.nproc)
        else:
            b, a = run_plain(args.nproc), run_ours(args.nproc)
        order.append("ours,plain" if i % 2 == 0 else "plain,ours")
        ours.append(a)
        plain.append(b)
        ratios.append(a / b)
        print(f"pair {i + 1}/{args.pairs} ({order[-1]}): ours {a:8.1f}  plain {b:8.1f} samples/s  "
              f"ratio {a / b:.3f}", flush=True)
    ci = ratio_interval(ratios)
    line = verdict(ci, what="throughput ours/plain")
    result = {
        "benchmark": "trainer_overhead", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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
