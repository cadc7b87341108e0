"""The one checkpoint manager the training loop drives (torchtitan's shape: `load`, `maybe_save`, `close`):
when the disk checkpoint (checkpoint.py) and the /dev/shm snapshot (snapshot.py) are written, what
they hold, and which one a resume loads: the newest snapshot every rank holds when it is newer than
the newest disk checkpoint, else the newest complete disk checkpoint."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .. import rng
from ..collectives import Collectives
from ..config import TrainerConfig
from ..dist import DistContext
from ..reporting import NullReporter
from ..shared_dir import check_shared_dir
from ..telemetry import Telemetry
from .checkpoint import Checkpointer, check_resumable, optimizer_state, step_dir_name
from .snapshot import Snapshots, agreed_step, snapshot_root


@dataclass
class TrainState:
    """Where training stands; what a checkpoint must bring back besides the tensors."""

    step: int = 0
    epoch: int = 0
    micro_done: int = 0  # micro-batches of the current epoch already trained on


class CheckpointManager:
    """One rank's checkpoints of `model`, `optimizer` and `scheduler`; every method is collective.

    A disk checkpoint is taken in the `stage` "checkpoint" (a hang there is named so) after
    `sync_buffers`: every rank's BatchNorm statistics alike, the model that evaluation measures (a
    snapshot keeps each rank's own: resuming it is exactly resuming that rank).
    """

    def __init__(self, cfg: TrainerConfig, ctx: DistContext, *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, log: NullReporter, telemetry: Telemetry,
                 stage: Callable[[str], None], sync_buffers: Callable[[], None]) -> None:
        ck = cfg.checkpoint
        assert ck.dir, "a CheckpointManager needs checkpoint.dir"
        check_shared_dir(Path(ck.dir), rank=ctx.rank, group=ctx.io_group)
        self.cfg, self.ctx, self.log, self.telemetry = cfg, ctx, log, telemetry
        self.stage, self.sync_buffers = stage, sync_buffers
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.comm = Collectives(ctx.device)
        self.disk = Checkpointer(ck.dir, keep=ck.keep, rank=ctx.rank, group=ctx.io_group, barrier=self.comm.barrier,
                                 broadcast=self.comm.broadcast_object, log=log, async_save=ck.async_save)
        self.snapshots = (Snapshots(snapshot_root(), rank=ctx.rank, warn=log.warning)
                          if ck.snapshot_every_steps else None)

    def due(self, step: int) -> bool:
        """A disk checkpoint follows this step (besides the one at each epoch's end)."""
        return _every(step, self.cfg.checkpoint.every_steps)

    def saved(self, step: int) -> bool:
        return self.disk.last_saved_step == step

    def path(self, step: int) -> Path:
        return self.disk.dir / step_dir_name(step)

    @property
    def last_seconds(self) -> float | None:
        """The last finished disk save's whole time, write included (None before the first)."""
        return self.disk.last_seconds

    def maybe_save(self, st: TrainState, *, epoch_end: bool) -> bool:
        """At a step boundary: the disk checkpoint when due, else the snapshot when due and not at an
        epoch's end (that step's disk checkpoint follows its evaluation). Whether a disk checkpoint
        was taken (a snapshot's copy counts in the next step's time: what it costs training,
        bench/trainer_overhead.py)."""
        if self.due(st.step):
            return self.save(st)
        snap = self.snapshots
        if snap is not None and not snap.failed and not epoch_end and _every(st.step, self.cfg.checkpoint.snapshot_every_steps):
            snap.save(st.step, {**self._state(st), "rng": rng.get_state()})
        return False

    def save(self, st: TrainState) -> bool:
        """A disk checkpoint of this step, once (False: it is saved already). With async saving,
        training stands still only for the host copy; the write goes on in the background."""
        if self.saved(st.step):
            return False
        self.stage("checkpoint")
        t0 = time.perf_counter()
        self.sync_buffers()
        path = self.disk.save(step=st.step, common=self._state(st), rank_state={"rng": rng.get_state()})
        seconds = time.perf_counter() - t0  # how long training stood still for it
        self.telemetry.checkpoint(seconds)
        how = "being written in the background" if self.cfg.checkpoint.async_save else "written"
        self.log.info(f"checkpoint {path}: training paused {seconds:.2f}s ({how})")
        self.log.metrics({"checkpoint_seconds": seconds}, step=st.step)
        self.stage("training")
        return True

    def _state(self, st: TrainState) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": st.step, "epoch": st.epoch,
                "micro_done": st.micro_done, "world_size": self.ctx.world_size, "config": self.cfg.to_dict()}

    def wait(self) -> None:
        """The disk write in flight is published (its error raised, if any)."""
        self.disk.wait()

    def close(self) -> None:
        """The run ended: the last disk write published; the snapshots would only hold /dev/shm room."""
        self.disk.wait()
        if self.snapshots is not None:
            self.snapshots.clear()

    def load(self) -> TrainState | None:
        """Restore model, optimizer, scheduler and RNG from the newest snapshot or disk checkpoint;
        the position resumed from, None when there is nothing to resume from."""
        snaps = self.snapshots
        if snaps is not None and (agreed := self._agreed_snapshot(snaps)) is not None:
            step, disk = agreed
            path, state = snaps.path(step), snaps.load(step)
            return self._restore(state, path, f"the in-memory snapshot {path}",
                                 f"; newest disk checkpoint: step {disk if disk is not None else 'none'}")
        loaded = self.disk.load_latest()
        if not loaded:
            return None
        return self._restore({**loaded.common, **(loaded.rank_state or {})}, loaded.path, str(loaded.path))

    def _agreed_snapshot(self, snaps: Snapshots) -> tuple[int, int | None] | None:
        """The newest snapshot step every rank holds, when it is newer than the newest disk
        checkpoint (a worker restarted in place: snapshot.py), with that disk step (rank 0's)."""
        # Rank 0's steps, and how many ranks hold each: collectives on the rank's device (an NCCL
        # group takes no CPU tensor, so no all_gather_object).
        mine = snaps.steps()
        candidates = self.comm.broadcast_object(mine)
        if not candidates:
            return None
        holders = self.comm.sum([1.0 if s in mine else 0.0 for s in candidates]).tolist()
        step = agreed_step(candidates, holders, self.ctx.world_size)
        disk = self.disk.newest_published_step() if self.ctx.rank == 0 else None
        if not self.comm.broadcast_object(step is not None and step > (disk or 0)):
            return None
        assert step is not None
        return step, disk

    def _restore(self, state: dict[str, Any], path: Path, what: str, note: str = "") -> TrainState:
        """`state`: a snapshot, or a checkpoint's shared state with this rank's own (its RNG) merged in."""
        check_resumable(state, path=path, world_size=self.ctx.world_size, batch_size=self.cfg.batch_size,
                        grad_accum_steps=self.cfg.grad_accum_steps)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(optimizer_state(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        if "rng" in state:  # a rank beyond the old world size has no state of its own to restore
            rng.set_state(state["rng"])
        st = TrainState(step=state["step"], epoch=state["epoch"], micro_done=state["micro_done"])
        self.log.info(f"resumed from {what} at step {st.step} (epoch {st.epoch}, batch {st.micro_done}{note})")
        return st


def _every(step: int, n: int) -> bool:
    return bool(n) and step % n == 0
