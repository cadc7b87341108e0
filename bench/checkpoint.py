"""Checkpoint cost of the built-in trainer's state (benchmark, not a test).

For a resnet18-sized state (weights + SGD momentum, as loop.save() builds it), in the same run,
rotating the arms' order every round so drift hits all alike:
- `sync`: Checkpointer.save with async_save off: serialize, hash while writing, fsync, publish;
  training stands still for all of it;
- `stall`: Checkpointer.save with async_save on (the trainer's default), time until it returns:
  training stands still only this long (host copy + per-rank files); `async_total` adds the
  wait for the background write to be published. Ratio stall / sync (goal <= 0.2);
- `dd`: `dd bs=4M conv=fsync` of the same number of bytes into the same directory: the write
  ceiling; ratio sync-save throughput / dd throughput (goal >= 0.8);
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
from stats import git_head, ratio_interval  # noqa: E402

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
    rng = {"rng": torch.get_rng_state()}
    times: dict[str, list[float]] = {"sync": [], "stall": [], "async_total": [], "dd": [], "reread_sha256": []}
    nbytes = 0
    try:
        cks = {mode: Checkpointer(str(root / mode), keep=1, rank=0, barrier=lambda: None,
                                  broadcast=lambda v: v, log=NullReporter(), async_save=mode == "async")
               for mode in ("sync", "async")}
        for ck in cks.values():  # warm-up: allocator, page cache, directories
            ck.save(step=0, common=state, rank_state=rng)
            ck.wait()

        def sync(i):
            t0 = time.perf_counter()
            cks["sync"].save(step=i, common=state, rank_state=rng)
            times["sync"].append(time.perf_counter() - t0)

        def asynchronous(i):
            t0 = time.perf_counter()
            cks["async"].save(step=i, common=state, rank_state=rng)
            times["stall"].append(time.perf_counter() - t0)
            cks["async"].wait()
            times["async_total"].append(time.perf_counter() - t0)

        def dd(i):
            times["dd"].append(_dd(root / "sync" / f"step-{0:08d}" / COMMON if i == 0 else
                                   next((root / "sync").glob("step-*")) / COMMON, root / "dd.bin"))

        arms = [sync, asynchronous, dd]
        for i in range(1, args.rounds + 1):
            for arm in arms[i % 3:] + arms[:i % 3]:  # rotated order
                arm(i)
            newest = next((root / "sync").glob("step-*")) / COMMON
            nbytes = newest.stat().st_size
            t0 = time.perf_counter()
            _sha256(newest)
            times["reread_sha256"].append(time.perf_counter() - t0)
            print(f"round {i}/{args.rounds}: sync save {times['sync'][-1]:.3f}s  async stall "
                  f"{times['stall'][-1]:.3f}s (total {times['async_total'][-1]:.3f}s)  dd {times['dd'][-1]:.3f}s  "
                  f"re-read sha256 {times['reread_sha256'][-1]:.3f}s  ({nbytes / 1e6:.1f} MB)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    tput = ratio_interval([d / s for s, d in zip(times["sync"], times["dd"])])  # save MB/s / dd MB/s
    stall = ratio_interval([a / s for a, s in zip(times["stall"], times["sync"])])
    result = {
        "benchmark": "checkpoint", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_head": git_head(), "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "state": "resnet18 (1000 classes) weights + SGD momentum", "bytes": nbytes, "rounds": args.rounds,
        "seconds": times, "median_seconds": med,
        "sync_save_mb_per_s": nbytes / 1e6 / med["sync"], "dd_mb_per_s": nbytes / 1e6 / med["dd"],
        "throughput_ratio_sync_save_over_dd": tput["ratio"], "throughput_ratio_95ci": [tput["low"], tput["high"]],
        "goal_throughput_ratio": 0.8,
        "stall_over_sync_save": stall["ratio"], "stall_over_sync_save_95ci": [stall["low"], stall["high"]],
        "goal_stall_over_sync_save": 0.2,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{nbytes / 1e6:.1f} MB: sync save {med['sync']:.3f}s ({result['sync_save_mb_per_s']:.0f} MB/s), "
          f"dd {med['dd']:.3f}s ({result['dd_mb_per_s']:.0f} MB/s): write throughput save/dd = "
          f"{tput['ratio']:.2f} (95 % interval {tput['low']:.2f}-{tput['high']:.2f}; goal >= 0.8)")
    print(f"async save: training stalls {med['stall']:.3f}s, {stall['ratio']:.2f} x a synchronous save "
          f"(95 % interval {stall['low']:.2f}-{stall['high']:.2f}; goal <= 0.2); write done after "
          f"{med['async_total']:.3f}s; the old manifest re-read cost {med['reread_sha256']:.3f}s more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
