"""Built-in trainer vs a plain hand-written DDP loop: same model, data, batch size, 2 gloo ranks.

Runs the pair several times, interleaved (A B A B ...), so drift in machine speed hits both.
Ours runs through the in-pod launcher with telemetry on (multiprocess metrics dir), as in a pod.
Prints the median training throughput of each and the ratio ours/plain; writes JSON.
Goal: ratio >= 0.98.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = {"dataset": "synthetic", "model": "convnet", "epochs": 1, "batchSize": 64, "lr": 0.01,
          "seed": 0, "logEverySteps": 1000,
          "synthetic": {"trainSize": 8192, "valSize": 256, "shape": [3, 32, 32], "numClasses": 10, "seed": 1}}


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
                    "DDPJOB_NAME": "bench"})
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
    """Run the pairs, print medians and the ratio, write bench/results/trainer_overhead.json."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "trainer_overhead.json"))
    args = ap.parse_args()
    ours, plain, ratios = [], [], []
    run_plain(args.nproc)  # warm-up: page cache, imports
    for i in range(args.pairs):
        a, b = run_ours(args.nproc), run_plain(args.nproc)
        ours.append(a)
        plain.append(b)
        ratios.append(a / b)
        print(f"pair {i + 1}/{args.pairs}: ours {a:8.1f} samples/s  plain {b:8.1f} samples/s  ratio {a / b:.3f}",
              flush=True)
    result = {
        "benchmark": "trainer_overhead", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": CONFIG, "nproc": args.nproc, "backend": "gloo",
        "ours_samples_per_second": ours, "plain_samples_per_second": plain, "pair_ratios": ratios,
        "median_ours": statistics.median(ours), "median_plain": statistics.median(plain),
        "median_ratio": statistics.median(ratios), "goal_ratio": 0.98,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"median throughput: ours {result['median_ours']:.1f}, plain {result['median_plain']:.1f} "
          f"samples/s; ratio ours/plain = {result['median_ratio']:.3f} (goal >= 0.98)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
