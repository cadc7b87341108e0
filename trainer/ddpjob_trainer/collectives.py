"""Every collective the training loop issues itself, on tensors of the group's device.

NCCL takes only CUDA tensors ("No backend type associated with device type cpu"), gloo only
CPU ones: a tensor made without `device=` works on a CPU test run and kills every GPU job. So
the loop never calls torch.distributed directly; it calls these, which place every tensor on
`device` (the rank's training device, which is what the default group's backend serves).
DDP's own traffic (gradient buckets, the initial state broadcast) uses the model's tensors,
which are on that device by construction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

# The spec.trainer.ddp.bufferSync modes sync_buffers implements (the CRD's enum; a unit test holds them equal).
BUFFER_SYNCS = ("average", "broadcast")


@dataclass(frozen=True)
class Collectives:
    """Collectives on the default group with tensors on `device`."""

    device: torch.device

    def sum(self, values: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks, in float64; the result stays on the device."""
        if isinstance(values, torch.Tensor):
            t = values.to(self.device, torch.float64)
        else:
            t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t

    def broadcast_object(self, value: Any, *, src: int = 0) -> Any:
        """Rank `src`'s picklable value on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=src, device=self.device)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank (NCCL: on this rank's device, set by init_process_group's device_id)."""
        dist.barrier()

    def sync_buffers(self, module: nn.Module, *, mode: str) -> None:
        """Make every rank's buffers (BatchNorm running statistics) identical, in place.

        `average`: floating buffers become the mean over ranks, integer ones (num_batches_tracked)
        take rank 0's value (they are equal: every rank takes the same number of steps).
        `broadcast`: all buffers take rank 0's values.
        """
        if mode not in BUFFER_SYNCS:
            raise ValueError(f"buffer sync mode must be one of {BUFFER_SYNCS}, got {mode!r}")
        world = dist.get_world_size()
        if world == 1:
            return
        for buf in module.buffers():
            if buf.device != self.device:
                raise RuntimeError(f"buffer on {buf.device}, expected {self.device}")
            if mode == "average" and buf.is_floating_point():
                dist.all_reduce(buf)
                buf.div_(world)
            else:
                dist.broadcast(buf, src=0)
