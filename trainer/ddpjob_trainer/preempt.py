"""A last checkpoint when the pod is stopped (preemption, a drain, a deleted pod).

The kubelet sends SIGTERM and SIGKILLs the pod at the end of its terminationGracePeriodSeconds;
the launcher passes its own, shorter grace on as DDPJOB_STOP_GRACE_SECONDS (contract.stop_grace).
A rank that gets SIGTERM only notes the time (`StopRequest`): it is most likely inside a step or
a collective, and a checkpoint is a collective of every rank, most of which (on other nodes) got
no signal. So at every step boundary the ranks share, over a gloo group of their own and one step
behind (the all-reduce runs while the next step does), the least time any rank has left, the
longest last save and the longest step (`StopVote`). Every rank then decides alike (`plan`):
save when the last measured save, with a margin, fits in what is left; before the attempt has
measured one, when the estimate from the state's bytes and the checkpoint directory's write speed
(`SaveEstimate`, the same on every rank) does; otherwise say why not, with both numbers.
Then the signalled ranks end as stopped (143) and the others fail (errors.PeerStopped) to be restarted
with the group; the next attempt resumes from the newest complete checkpoint, this one.
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from . import torchapi
from ddpjob_api import contract

# A save, judged by the last one's time or by SaveEstimate, must fit this many times over in what
# is left: a write to shared storage varies, and a checkpoint cut off by SIGKILL is lost (the
# previous one is used).
SAVE_MARGIN = 1.5


def stop_budget(env: Mapping[str, str] = os.environ) -> float:
    """Seconds from this rank's SIGTERM to its SIGKILL: the launcher's grace, or torchrun's own
    shutdown timeout where that is shorter (torch 2.8: 30 s whatever the launcher says)."""
    raw = env.get(contract.ENV_STOP_GRACE, "")
    try:
        grace = float(raw) if raw else contract.STOP_GRACE_DEFAULT
    except ValueError:  # the launcher refuses such a value before starting any rank
        grace = contract.STOP_GRACE_DEFAULT
    return min(grace, torchapi.torchrun_shutdown_seconds(env))


@dataclass(frozen=True)
class SaveEstimate:
    """A save's time before the attempt measured one: the state's bytes (model, optimizer and
    scheduler, as the host copy holds them) over the write speed measured when the checkpoint
    directory was opened (checkpointing/manager.py). Every rank's share counted at one writer's
    speed: right where the ranks share the storage's bandwidth, long where it grows with writers.
    It leaves out fixed costs, chiefly the first save's import of torch's DCP (1.8 s on a busy
    2-core machine): a grace of a few seconds holds them."""

    nbytes: int
    bandwidth: float  # bytes per second

    @property
    def seconds(self) -> float:
        return self.nbytes / self.bandwidth

    def __str__(self) -> str:
        return (f"a save estimated at {self.seconds:.2f}s ({_size(self.nbytes)} at {_size(self.bandwidth)}/s, the "
                "checkpoint directory's write speed; no save measured yet in this attempt)")


def _size(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def plan(*, left: float, last_save: float | None, estimate: SaveEstimate, step_seconds: float,
         saved: bool) -> tuple[bool, str]:
    """Whether to save on a stop, and why (the same inputs on every rank: the same answer).

    `left`: the least time any rank had left when the vote was cast, a step ago (`step_seconds`,
    the longest step, is taken off it); `last_save`: the longest whole save (write included) of
    the last checkpoint this attempt wrote, None before its first (then `estimate` is used);
    `saved`: this step's checkpoint exists already."""
    if saved:
        return False, "this step's checkpoint is already saved"
    if last_save is not None:
        need, what = last_save, f"the last save took {last_save:.2f}s (measured)"
    else:
        need, what = estimate.seconds, str(estimate)
    now_left = left - step_seconds
    if need * SAVE_MARGIN > now_left:
        return False, (f"{what} and {max(now_left, 0.0):.1f}s of the stop grace is left (a save needs "
                       f"{SAVE_MARGIN:g}x its time)")
    return True, f"{what}, {now_left:.1f}s of the stop grace left"


class StopRequest:
    """SIGTERM noted, not acted on: the time of the first one (monotonic), None until then."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.at: float | None = None
        self._previous: Any = None

    def install(self) -> StopRequest:
        """Take SIGTERM over (only the main thread can; elsewhere SIGTERM keeps its handler)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.at is None:  # torchrun's agent sends a second one: the first counts
            self.at = time.monotonic()

    def left(self, now: float | None = None) -> float:
        """Seconds left until SIGKILL (inf without a signal)."""
        if self.at is None:
            return math.inf
        return self.budget - ((time.monotonic() if now is None else now) - self.at)


@dataclass(frozen=True)
class Agreed:
    """What every rank shared at one step boundary."""

    left: float                # least time left over the ranks (inf: none was signalled)
    last_save: float | None    # longest last save (None: a rank has not saved yet)
    step_seconds: float        # longest step


def agree(values: torch.Tensor) -> Agreed:
    """Decode the MIN-reduced [left, -last_save, -step_seconds] (unknown save time: +inf)."""
    left, neg_save, neg_step = values.tolist()
    return Agreed(left=left, last_save=None if math.isinf(neg_save) else -neg_save, step_seconds=-neg_step)


def ballot(*, left: float, last_save: float | None, step_seconds: float) -> torch.Tensor:
    return torch.tensor([left, -math.inf if last_save is None else -last_save, -step_seconds], dtype=torch.float64)


class StopVote:
    """Each step boundary's ballot, all-reduced (MIN) on `group` while the next step runs; `cast`
    returns the previous boundary's result. Without a group (one process) it is this rank's own."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._pending: tuple[torch.Tensor, Any] | None = None

    def cast(self, *, left: float, last_save: float | None, step_seconds: float) -> Agreed | None:
        mine = ballot(left=left, last_save=last_save, step_seconds=step_seconds)
        if self.group is None:
            return agree(mine)
        previous = self.finish()
        work = dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        self._pending = (mine, work)
        return previous

    def finish(self) -> Agreed | None:
        """Wait for the ballot in flight (every rank cast it); its result."""
        if self._pending is None:
            return None
        values, work = self._pending
        self._pending = None
        work.wait()
        return agree(values)
