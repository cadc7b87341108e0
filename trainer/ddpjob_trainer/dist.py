"""Process-group setup and teardown; works under torchrun and as a plain single process."""
from __future__ import annotations

import contextlib
import datetime as dt
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .tuning import set_nccl_env_defaults


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job."""

    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    device: torch.device
    backend: str
    # A second group of all ranks, gloo, for checkpoint writes on a background thread (collectives
    # of two threads must not share a group); None in a single process or a run without checkpoints.
    io_group: Any = None

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes results and decides which checkpoint to load."""
        return self.rank == 0


def launched_by_torchrun(env=os.environ) -> bool:
    """torchrun sets RANK and LOCAL_RANK for every worker it starts."""
    return "RANK" in env and "LOCAL_RANK" in env


@contextlib.contextmanager
def process_group(*, timeout_seconds: int, io_group: bool = False) -> Iterator[DistContext]:
    """Init the default group (NCCL with CUDA, gloo otherwise), and with `io_group` the checkpoint
    writer's gloo group; always destroyed on exit."""
    env = os.environ
    if launched_by_torchrun(env):
        rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
        world = int(env["WORLD_SIZE"])
        node_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", "0")))
    else:
        rank, local_rank, world, node_rank = 0, 0, 1, 0
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        # NCCL reads these when the communicator is created; a value the user (or the operator's
        # env builder) set wins.
        set_nccl_env_defaults()
    timeout = dt.timedelta(seconds=timeout_seconds)
    if launched_by_torchrun(env):
        dist.init_process_group(backend, timeout=timeout,
                                **({"device_id": device} if use_cuda else {}))
    else:
        # A single process still gets a real group, so the training code has one path.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        # Only for a run that checkpoints: a gloo group connects every rank to every other.
        io = dist.new_group(backend="gloo", timeout=timeout) if io_group and world > 1 else None
        yield DistContext(rank=rank, local_rank=local_rank, world_size=world,
                          node_rank=node_rank, device=device, backend=backend, io_group=io)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
