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

from .. import preempt, rng
from ..collectives import Collectives
from ..config import TrainerConfig
from ..dist import DistContext
from ..reporting import NullReporter
from ..shared_dir import check_shared_dir
from ..telemetry import Telemetry
from .checkpoint import (Checkpointer, check_resumable, optimizer_state, probe_write_bandwidth, state_nbytes,
                         step_dir_name)
from ddpjob_api.contract import snapshot_root
from .snapshot import Snapshots, agreed_step


@dataclass
class TrainState:
    """Where training stands; what a checkpoint must bring back besides the tensors."""

    step: int = 0
    epoch: int = 0
    # Samples of the epoch's order (data.epoch_order) already trained on, by the whole group: a
    # global offset, the same position at any world size (data.rank_share re-splits the rest).
    samples_done: int = 0
    # The world size the run started at: the learning rate's reference on a resize (loop.py);
    # 0 until the first start sets it.
    first_world_size: int = 0
    # Where the schedule's decay was re-anchored on the last resize: (step, progress), None: never
    # (loop.Schedule).
    schedule_from: tuple[int, float] | None = None
    # The world size that wrote the state this run resumed from (0: a fresh start).
    written_at: int = 0


class CheckpointManager:
    """One rank's checkpoints of `model`, `optimizer` and `scheduler`; every method is collective.

    A disk checkpoint is taken in the `stage` "checkpoint" (a hang there is named so) after
    `sync_buffers`: every rank's BatchNorm statistics alike, the model that evaluation measures (a
    snapshot keeps each rank's own: resuming it is exactly resuming that rank).
    """

    def __init__(self, cfg: TrainerConfig, ctx: DistContext, *, train_size: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, log: NullReporter, telemetry: Telemetry,
                 stage: Callable[[str], None], sync_buffers: Callable[[], None],
                 write_bandwidth: float | None = None) -> None:
        ck = cfg.checkpoint
        assert ck.dir, "a CheckpointManager needs checkpoint.dir"
        check_shared_dir(Path(ck.dir), rank=ctx.rank, group=ctx.io_group)
        self.comm = Collectives(ctx.device)
        # Bytes per second into the directory, for a stop's save before the attempt measured one
        # (estimate_save); rank 0's probe, shared so that every rank estimates alike. `write_bandwidth`:
        # a test's stand-in (debug.py), no probe.
        self.write_bandwidth: float = write_bandwidth or self.comm.broadcast_object(
            probe_write_bandwidth(Path(ck.dir)) if ctx.rank == 0 else None)
        self.cfg, self.ctx, self.log, self.telemetry = cfg, ctx, log, telemetry
        self.train_size = train_size
        self.stage, self.sync_buffers = stage, sync_buffers
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
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
        """The last disk save's time up to its files written, before its manifest (None before the first)."""
        return self.disk.last_seconds

    def estimate_save(self, st: TrainState) -> preempt.SaveEstimate:
        """How long a disk checkpoint of `st` would take, from its bytes (the same on every rank)."""
        return preempt.SaveEstimate(nbytes=state_nbytes(self._state(st)), bandwidth=self.write_bandwidth)

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
                "samples_done": st.samples_done, "first_world_size": st.first_world_size or self.ctx.world_size,
                **({"schedule_from": list(st.schedule_from)} if st.schedule_from else {}),
                "world_size": self.ctx.world_size, "config": self.cfg.to_dict()}

    def wait(self) -> None:
        """The disk write in flight is published (its error raised, if any)."""
        self.disk.wait()

    def close(self, *, train_seconds: float) -> None:
        """The run ended: the last disk write published; the snapshots would only hold /dev/shm room.
        What they cost this rank in its `train_seconds` of training is reported (rank 0's log)."""
        self.disk.wait()
        if self.snapshots is not None:
            self.snapshots.clear()
            if self.snapshots.cost.taken:
                self.log.info(self.snapshots.cost.line(train_seconds))

    def load(self) -> TrainState | None:
        """Restore model, optimizer, scheduler and RNG from the newest snapshot or disk checkpoint;
        the position resumed from, None when there is nothing to resume from."""
        snaps = self.snapshots
        if snaps is not None and (agreed := self._agreed_snapshot(snaps)) is not None:
            step, disk = agreed
            path, state = snaps.path(step), snaps.load(step)
            st = self._restore(state, path, f"the in-memory snapshot {path}",
                               f"; newest disk checkpoint: step {disk if disk is not None else 'none'}")
        else:
            loaded = self.disk.load_latest()
            if not loaded:
                return None
            st = self._restore({**loaded.common, **(loaded.rank_state or {})}, loaded.path, str(loaded.path))
        if snaps is not None:
            # Snapshots past the resumed step are of steps this run takes again (after a resize, on
            # other data): an old copy must never be agreed on with a rank's copy of the new step.
            snaps.discard_after(st.step)
        return st

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
        check_resumable(state, path=path, batch_size=self.cfg.batch_size, grad_accum_steps=self.cfg.grad_accum_steps)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(optimizer_state(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        if "rng" in state:  # a rank beyond the old world size has no state of its own to restore
            rng.set_state(state["rng"])
        st = saved_position(state, train_size=self.train_size)
        resized = f", written at world size {st.written_at}" if st.written_at != self.ctx.world_size else ""
        self.log.info(f"resumed from {what} at step {st.step} (epoch {st.epoch}, sample {st.samples_done} of "
                      f"{self.train_size}{resized}{note})")
        return st


def saved_position(state: dict[str, Any], *, train_size: int) -> TrainState:
    """Where a saved state stands. A checkpoint written before the position was a global offset holds
    `micro_done`, per-rank micro-batches: each of its world_size ranks took batch_size samples per
    micro-batch off the front of the epoch's order, hence the offset (at most the epoch's n)."""
    if "samples_done" in state:
        done = state["samples_done"]
    else:
        done = min(train_size, state["micro_done"] * state["config"]["batch_size"] * state["world_size"])
    anchor = state.get("schedule_from")
    return TrainState(step=state["step"], epoch=state["epoch"], samples_done=done,
                      first_world_size=state.get("first_world_size", state["world_size"]),
                      schedule_from=(int(anchor[0]), float(anchor[1])) if anchor else None,
                      written_at=state["world_size"])


def _every(step: int, n: int) -> bool:
    return bool(n) and step % n == 0
