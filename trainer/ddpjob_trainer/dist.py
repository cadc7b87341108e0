"""Process-group setup and teardown; works under torchrun and as a plain single process."""
from __future__ import annotations

import contextlib
import datetime as dt
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ddpjob_api import contract
from .errors import ConfigError
from .tuning import set_nccl_env_defaults


# How long a failed rank gives its process group's teardown. With a peer mid-collective it can
# block until that collective times out (NCCL's communicators; a gloo group's, with a collective
# in flight): minutes in which the pod stays up and the failure's cause waits to be told.
FAILED_TEARDOWN_SECONDS = 10.0


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
    # A third, gloo, for the per-step stop vote (preempt.StopVote), in flight while a step runs;
    # present exactly when io_group is.
    vote_group: Any = None

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes results and decides which checkpoint to load."""
        return self.rank == 0


def launched_by_torchrun(env=os.environ) -> bool:
    """torchrun sets RANK and LOCAL_RANK for every worker it starts."""
    return contract.TORCHRUN_RANK in env and contract.TORCHRUN_LOCAL_RANK in env


def rank_device(local_rank: int, local_world_size: int, env=os.environ) -> torch.device:
    """This rank's device: one CUDA device per local rank, or the CPU for all of them.

    Never a mix: a rank on the CPU would join with gloo while its peers use NCCL, and the group
    would hang at its first collective. A GPU job (the operator's DDPJOB_GPUS_PER_NODE > 0) whose
    pod lacks a device for some rank is a config error, raised before any rendezvous; a CPU job
    stays on the CPU whatever it can see. Outside the operator (no variable), CUDA when every
    local rank has a device.
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = env.get(contract.ENV_GPUS_PER_NODE)
    if gpus is None:
        return torch.device("cuda", local_rank) if count >= local_world_size else torch.device("cpu")
    if int(gpus) == 0:
        return torch.device("cpu")
    if count < local_world_size:
        seen = f"{count} CUDA device(s)" if count else "no CUDA (no NVIDIA runtime or driver in the pod, or a CPU-only torch)"
        raise ConfigError(f"spec.gpusPerNode is {gpus}, so each of this pod's {local_world_size} local ranks needs "
                          f"a GPU, but it sees {seen}; check the node's GPUs, its device plugin and the "
                          "pod's runtime class, or set gpusPerNode: 0 for a CPU job")
    return torch.device("cuda", local_rank)


@contextlib.contextmanager
def process_group(*, timeout_seconds: int, io_group: bool = False,
                  debug_dir: str | None = None) -> Iterator[DistContext]:
    """Init the default group (NCCL on GPUs, gloo on the CPU: see rank_device), and with
    `io_group` the checkpoint writer's and the stop vote's gloo groups; always destroyed on exit."""
    env = os.environ
    if launched_by_torchrun(env):
        rank, local_rank = int(env[contract.TORCHRUN_RANK]), int(env[contract.TORCHRUN_LOCAL_RANK])
        world = int(env[contract.ENV_WORLD_SIZE])
        node_rank = int(env.get(contract.TORCHRUN_GROUP_RANK, env.get(contract.ENV_NODE_RANK, "0")))
    else:
        rank, local_rank, world, node_rank = 0, 0, 1, 0
    device = rank_device(local_rank, int(env.get(contract.TORCHRUN_LOCAL_WORLD_SIZE, "1")) if launched_by_torchrun(env) else 1)
    use_cuda = device.type == "cuda"
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(device)
        # NCCL reads these when the communicator is created; a value the user (or the operator's
        # env builder) set wins.
        set_nccl_env_defaults(debug_dir=debug_dir)
    timeout = dt.timedelta(seconds=timeout_seconds)
    if launched_by_torchrun(env):
        device_kw: dict[str, Any] = {"device_id": device} if use_cuda else {}
        dist.init_process_group(backend, timeout=timeout, **device_kw)
    else:
        # A single process still gets a real group, so the training code has one path.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        # Only for a run that checkpoints: a gloo group connects every rank to every other.
        io = dist.new_group(backend="gloo", timeout=timeout) if io_group and world > 1 else None
        vote = dist.new_group(backend="gloo", timeout=timeout) if io is not None else None
        yield DistContext(rank=rank, local_rank=local_rank, world_size=world,
                          node_rank=node_rank, device=device, backend=backend, io_group=io, vote_group=vote)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def teardown_within(seconds: float) -> bool:
    """Destroy the process group on a thread of its own, waiting at most `seconds`; False if it is
    still blocked then (the caller ends the process, which closes whatever is left)."""
    if not dist.is_initialized():
        return True
    teardown = threading.Thread(target=dist.destroy_process_group, name="pg-teardown", daemon=True)
    teardown.start()
    teardown.join(seconds)
    return not teardown.is_alive()
