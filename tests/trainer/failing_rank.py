"""The built-in trainer's entry point (ddpjob_trainer.__main__) under torchrun, with a training
function in which rank 1 raises while rank 0 is blocked in a collective that rank 1 never joins.

Rank 1 also leaves a collective in flight on a group of its own, as the checkpoint writer's group
has mid-save, and drops it: destroying the process group then waits in gloo for that collective to
time out. That is this machine's real instance of what the issue is about (NCCL's teardown with a
peer mid-collective blocks until the watchdog fires); nothing here fakes it. Everything else is
the trainer's: the process group, the failure record, the teardown, the exit.

Usage: torchrun --nproc-per-node 2 failing_rank.py   (DDPJOB_TRAINER_CONFIG as for the trainer)
"""
from __future__ import annotations

import datetime as dt

import torch
import torch.distributed as dist

from ddpjob_trainer import loop
from ddpjob_trainer.__main__ import exit_now, main

REASON = "no such shard: /data/train-00042.tar"


def train(cfg, ctx, **_) -> None:
    in_flight = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=cfg.timeout_seconds))
    if ctx.rank == 0:
        dist.all_reduce(torch.zeros(1))  # the peer, mid-collective, waiting for rank 1
        return
    dist.all_reduce(torch.zeros(1), group=in_flight, async_op=True)
    del in_flight  # only the process group's registry holds it now: its teardown is the group's
    raise FileNotFoundError(REASON)


if __name__ == "__main__":
    loop.train = train
    exit_now(main())
