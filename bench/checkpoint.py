"""Checkpoint cost of the built-in trainer's state (benchmark, not a test).

For a resnet18-sized state (weights + SGD momentum + scheduler, as loop.save() builds it), in
the same run, alternating arms per round so drift hits all alike:
- `save`: Checkpointer.save (world size 1): serialize, hash while writing, fsync, publish; this is
  how long training stands still for a checkpoint (saves are synchronous: the stall is the
  whole save; the issue's goal of a stall <= 0.2 x a synchronous save needs async saving);
- `dd`: `dd bs=4M conv=fsync` of the same number of bytes to the same directory, the
  write-throughput ceiling; ratio save throughput / dd throughput (goal >= 0.8);
- `reread_sha256`: what the old manifest cost on top (reading every byte back to hash it).
Prints medians and ratios with 95 % intervals; writes bench/results/checkpoint.json.
Usage: .venv/bin/python bench/checkpoint.py [--rounds 7] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from stats import ratio_interval  # noqa: E402

from ddpjob_trainer.checkpoint import COMMON, Checkpointer, _sha256  # noqa: E402
from ddpjob_trainer.models import build_model  # noqa: E402
from ddpjob_trainer.reporting import NullReporter  # noqa: E402


def _state() -> dict:
    model = build_model("resnet18", (3, 32, 32), 1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()  # momentum buffers exist, as in a real checkpoint
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": {}, "step": 1,
            "epoch": 0, "micro_done": 1, "world_size": 1, "config": {}}


def _dd(src: Path, dst: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={src}", f"of={dst}", "bs=4M", "conv=fsync", "status=none"], check=True)
    seconds = time.perf_counter() - t0
    dst.unlink()
    return seconds


def main() -> int:
    """Run the rounds, print, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    ap.add_argument("--out", default=str(HERE / "results" / "checkpoint.json"))
    args = ap.parse_args()
    state = _state()
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        ck = Checkpointer(str(root / "ck"), keep=1, rank=0, barrier=lambda: None,
                          broadcast=lambda v: v, log=NullReporter())
        rng = {"rng": torch.get_rng_state()}
        ck.save(step=0, common=state, rank_state=rng)  # warm-up: allocator, page cache, dirs
        ck.wait()
        save_s, dd_s, sha_s = [], [], []
        nbytes = 0
        for i in range(1, args.rounds + 1):
            def save():
                t0 = time.perf_counter()
                path = ck.save(step=i, common=state, rank_state=rng)
                save_s.append(time.perf_counter() - t0)
                ck.wait()
                return path
            if i % 2:
                path = save()
                dd_s.append(_dd(path / COMMON, root / "dd.bin"))
            else:
                dd_s.append(_dd(root / "ck" / f"step-{i - 1:08d}" / COMMON, root / "dd.bin"))
                path = save()
            nbytes = (path / COMMON).stat().st_size
            t0 = time.perf_counter()
            _sha256(path / COMMON)
            sha_s.append(time.perf_counter() - t0)
            print(f"round {i}/{args.rounds}: save {save_s[-1]:.3f}s  dd {dd_s[-1]:.3f}s  "
                  f"re-read sha256 {sha_s[-1]:.3f}s  ({nbytes / 1e6:.1f} MB)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tput = ratio_interval([d / s for s, d in zip(save_s, dd_s)])  # = save MB/s / dd MB/s
    result = {
        "benchmark": "checkpoint", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "state": "resnet18 (1000 classes) weights + SGD momentum", "bytes": nbytes, "rounds": args.rounds,
        "save_seconds": save_s, "dd_seconds": dd_s, "reread_sha256_seconds": sha_s,
        "median_save_seconds": statistics.median(save_s), "median_dd_seconds": statistics.median(dd_s),
        "save_mb_per_s": nbytes / 1e6 / statistics.median(save_s),
        "dd_mb_per_s": nbytes / 1e6 / statistics.median(dd_s),
        "throughput_ratio_save_over_dd": tput["ratio"], "throughput_ratio_95ci": [tput["low"], tput["high"]],
        "goal_throughput_ratio": 0.8,
        "stall_over_sync_save": 1.0, "goal_stall_over_sync_save": 0.2,
        "note": "saves are synchronous: training stalls for the whole save (async save not implemented)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{nbytes / 1e6:.1f} MB: save {result['median_save_seconds']:.3f}s ({result['save_mb_per_s']:.0f} MB/s), "
          f"dd {result['median_dd_seconds']:.3f}s ({result['dd_mb_per_s']:.0f} MB/s); write throughput "
          f"save/dd = {tput['ratio']:.2f} (95 % interval {tput['low']:.2f}-{tput['high']:.2f}; goal >= 0.8)")
    print("training stall / synchronous save = 1.0 (saves are synchronous; goal <= 0.2 needs async save)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
