"""Checkpoint cost of the built-in trainer's state (benchmark, not a test).

For a resnet18-sized state (weights + SGD momentum, as loop.save() builds it), in the same run,
rotating the arms' order every round so drift hits all alike:
- `sync`: Checkpointer.save with async_save off: DCP shards of raw tensor bytes (storage.py)
  written by IO_THREADS threads, each file checksummed (xxh3-128) while written, fsync, manifest,
  rank file, publish; training stands still for all
  of it (not for deleting the checkpoint `keep` retires: a background thread does that, waited for
  outside the timed window);
- `stall`: Checkpointer.save with async_save on (the trainer's default), time until it returns:
  training stands still only this long (the host copy); `async_total` adds the wait
  for the background write to be published and the retired checkpoint deleted (the sync arm
  leaves that deletion out). Ratio stall / sync (goal <= 0.2);
- `dd`: `dd bs=4M conv=fsync` of the same number of bytes into the same directory: the write
  ceiling; ratio sync-save throughput / dd throughput (goal >= 0.8);
- `dcp_default`: plain `dcp.save` with DCP's own FileSystemWriter (a torch.save archive per
  tensor), same threads, fsync, no checksum or manifest: what our storage layer replaces;
- `torch_save`: the plain peer, one `torch.save` of the state into one file + fsync, no checksum (what
  pytorch/examples' checkpoints cost), for scale.
Then `sharded`: the same sync save by 2 ranks (gloo, 2 processes), each writing its DCP share, timed
on rank 0 from a barrier to its return, against the dd median above (not paired: other processes).
Prints medians and ratios with 95 % intervals; writes bench/results/checkpoint.json.
Usage: .venv/bin/python bench/checkpoint.py [--rounds 11] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
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
from provenance import Provenance  # noqa: E402
from stats import ratio_interval  # noqa: E402

from ddpjob_trainer.checkpointing.checkpoint import IO_THREADS, MANIFEST, Checkpointer  # noqa: E402
from ddpjob_trainer.models import build_model  # noqa: E402
from ddpjob_trainer.reporting import NullReporter  # noqa: E402


def _state() -> dict:
    model = build_model("resnet18", (3, 32, 32), 1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()  # momentum buffers exist, as in a real checkpoint
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": {}, "step": 1,
            "epoch": 0, "micro_done": 1, "world_size": 1, "config": {}}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _dd(src: Path, dst: Path) -> float:
    seconds = _timed(lambda: subprocess.run(["dd", f"if={src}", f"of={dst}", "bs=4M", "conv=fsync", "status=none"],
                                            check=True))
    dst.unlink()
    return seconds


def _torch_save(state: dict, dst: Path) -> float:
    def write():
        with open(dst, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    seconds = _timed(write)
    dst.unlink()
    return seconds


def _dcp_default(state: dict, dst: Path) -> float:
    import torch.distributed.checkpoint as dcp

    seconds = _timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(
        dst, thread_count=IO_THREADS, sync_files=True), no_dist=True))
    shutil.rmtree(dst)
    return seconds


def _sharded_rank(rank: int, world: int, port: int, root: str, rounds: int, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group(backend="gloo")
        ck = Checkpointer(root, keep=1, rank=rank, group=group, barrier=dist.barrier, broadcast=lambda v: v,
                          log=NullReporter())
        state, seconds = _state(), []
        for i in range(rounds + 1):  # round 0 warms up
            dist.barrier()
            seconds.append(_timed(lambda: ck.save(step=i, common=state, rank_state={})))
            ck.wait()  # pruning, as in the single-process arm
        if rank == 0:
            out.put(seconds[1:])
    finally:
        dist.destroy_process_group()


def _sharded(root: Path, rounds: int, world: int = 2) -> list[float]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_sharded_rank, args=(r, world, port, str(root), rounds, out)) for r in range(world)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=600)
    for p in procs:
        p.join()
    return seconds


def _checkpoint_bytes(step_dir: Path) -> int:
    return sum(m["size"] for m in json.loads((step_dir / MANIFEST).read_text())["files"].values())


def main() -> int:
    """Run the rounds, print, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    ap.add_argument("--out", default=str(HERE / "results" / "checkpoint.json"))
    args = ap.parse_args()
    prov = Provenance("api", "trainer", "bench", out=args.out)
    state = _state()
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    rng = {"rng": torch.get_rng_state()}
    times: dict[str, list[float]] = {"sync": [], "stall": [], "async_total": [], "dd": [], "torch_save": [],
                                 "dcp_default": []}
    try:
        cks = {mode: Checkpointer(str(root / mode), keep=1, rank=0, group=None, barrier=lambda: None,
                                  broadcast=lambda v: v, log=NullReporter(), async_save=mode == "async")
               for mode in ("sync", "async")}
        for ck in cks.values():  # warm-up: allocator, staging buffers, page cache, directories
            ck.save(step=0, common=state, rank_state=rng)
            ck.wait()
        nbytes = _checkpoint_bytes(root / "sync" / "step-00000000")
        src = root / "dd-source.bin"
        with open(src, "wb") as f:  # on disk before the rounds: its write-back must not land in one
            f.write(os.urandom(nbytes))
            os.fsync(f.fileno())
        _dd(src, root / "dd.bin")  # warm-up, as the other arms had
        _torch_save(state, root / "plain.pt")
        _dcp_default(state, root / "dcp-default")

        def sync(i):
            times["sync"].append(_timed(lambda: cks["sync"].save(step=i, common=state, rank_state=rng)))
            cks["sync"].wait()  # old checkpoints are deleted in the background: not in the next arm's time

        def asynchronous(i):
            t0 = time.perf_counter()
            cks["async"].save(step=i, common=state, rank_state=rng)
            times["stall"].append(time.perf_counter() - t0)
            cks["async"].wait()
            times["async_total"].append(time.perf_counter() - t0)

        def dd(i):
            times["dd"].append(_dd(src, root / "dd.bin"))

        def plain(i):
            times["torch_save"].append(_torch_save(state, root / "plain.pt"))

        def dcp_default(i):
            times["dcp_default"].append(_dcp_default(state, root / "dcp-default"))

        arms = [sync, asynchronous, dd, plain, dcp_default]
        for i in range(1, args.rounds + 1):
            for arm in arms[i % len(arms):] + arms[:i % len(arms)]:  # rotated order
                arm(i)
            print(f"round {i}/{args.rounds}: sync save {times['sync'][-1]:.3f}s  async stall "
                  f"{times['stall'][-1]:.3f}s (total {times['async_total'][-1]:.3f}s)  dd {times['dd'][-1]:.3f}s  "
                  f"torch.save {times['torch_save'][-1]:.3f}s  DCP default {times['dcp_default'][-1]:.3f}s  "
                  f"({nbytes / 1e6:.1f} MB)", flush=True)
        times["sharded_2_ranks"] = _sharded(root / "sharded", args.rounds)
        print(f"sharded, 2 ranks: {' '.join(f'{t:.3f}s' for t in times['sharded_2_ranks'])}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    tput = ratio_interval([d / s for s, d in zip(times["sync"], times["dd"])])  # save MB/s / dd MB/s
    stall = ratio_interval([a / s for a, s in zip(times["stall"], times["sync"])])
    peer = ratio_interval([p / s for s, p in zip(times["sync"], times["torch_save"])])
    stock = ratio_interval([p / s for s, p in zip(times["sync"], times["dcp_default"])])
    result = {
        "benchmark": "checkpoint",
        "state": "resnet18 (1000 classes) weights + SGD momentum", "format": "DCP with raw-bytes storage, one process",
        "io_threads": IO_THREADS, "bytes": nbytes, "rounds": args.rounds,
        "seconds": times, "median_seconds": med,
        "sync_save_mb_per_s": nbytes / 1e6 / med["sync"], "dd_mb_per_s": nbytes / 1e6 / med["dd"],
        "throughput_ratio_sync_save_over_dd": tput["ratio"], "throughput_ratio_95ci": [tput["low"], tput["high"]],
        "goal_throughput_ratio": 0.8,
        "stall_over_sync_save": stall["ratio"], "stall_over_sync_save_95ci": [stall["low"], stall["high"]],
        "goal_stall_over_sync_save": 0.2,
        "sharded_2_ranks_mb_per_s": nbytes / 1e6 / med["sharded_2_ranks"],
        "throughput_ratio_sharded_2_ranks_over_dd_medians": med["dd"] / med["sharded_2_ranks"],
        "throughput_ratio_sync_save_over_torch_save": peer["ratio"],
        "throughput_ratio_sync_save_over_torch_save_95ci": [peer["low"], peer["high"]],
        "throughput_ratio_sync_save_over_dcp_default": stock["ratio"],
        "throughput_ratio_sync_save_over_dcp_default_95ci": [stock["low"], stock["high"]],
    }
    prov.write(result)
    print(f"{nbytes / 1e6:.1f} MB: sync save {med['sync']:.3f}s ({result['sync_save_mb_per_s']:.0f} MB/s), "
          f"dd {med['dd']:.3f}s ({result['dd_mb_per_s']:.0f} MB/s): write throughput save/dd = "
          f"{tput['ratio']:.2f} (95 % interval {tput['low']:.2f}-{tput['high']:.2f}; goal >= 0.8)")
    print(f"async save: training stalls {med['stall']:.3f}s, {stall['ratio']:.2f} x a synchronous save "
          f"(95 % interval {stall['low']:.2f}-{stall['high']:.2f}; goal <= 0.2); write done after "
          f"{med['async_total']:.3f}s")
    print(f"plain torch.save (one file, no checksum) {med['torch_save']:.3f}s: our save's throughput over it = "
          f"{peer['ratio']:.2f} (95 % interval {peer['low']:.2f}-{peer['high']:.2f})")
    print(f"DCP's default storage {med['dcp_default']:.3f}s: our save's throughput over it = "
          f"{stock['ratio']:.2f} (95 % interval {stock['low']:.2f}-{stock['high']:.2f})")
    print(f"sharded over 2 ranks: {med['sharded_2_ranks']:.3f}s ({result['sharded_2_ranks_mb_per_s']:.0f} MB/s), "
          f"{result['throughput_ratio_sharded_2_ranks_over_dd_medians']:.2f} x dd (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
