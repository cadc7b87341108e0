"""In-memory snapshots: each rank's whole training state in the pod's /dev/shm, every few steps.

A worker restarted in place (docs/restarts.md) finds them where its predecessor left them: the pod
and its memory-backed /dev/shm outlive the worker process. So a restart loses at most
`checkpoint.snapshotEverySteps` steps instead of everything since the last disk checkpoint. Disk
checkpoints stay the durable layer (a lost pod, a group restart: its new pods have a fresh /dev/shm).

Each rank writes its own state (model with its own buffers, optimizer, scheduler, data position,
RNG), so resuming one is exactly resuming that rank: bit-exact like a disk resume. Under DDP every
rank's snapshot of a step holds the whole state and the same position, so a group resumed at
another world size loads them too: each new rank the one its pod holds under its new rank number,
when every rank holds one of that step (a rank that grew the group holds none: then the disk). Written
asynchronously: training stands still only for the copy into reused host buffers (the disk
checkpoint's stager), a thread writes `rank-R-step-S.pt.part` and renames it; the newest KEEP are
kept, so a write cut short by the kill leaves the one before. manager.py says when, and which to load.

Each rank measures what they cost it (`Cost`): the time training stood still in `save` (the
copy, and waiting for the previous write when it was not done) and the writer thread's CPU time,
which on a busy CPU is taken from training. Rank 0 reports it when the run ends (manager.py); the
benchmark reads it (bench/trainer_overhead.py --snapshot-every).

It costs /dev/shm room: KEEP copies of the state per local rank (the pod's memory limit counts
them). A write that fails (the room ran out) is a warning and ends snapshots for the run; it never
stops training.
"""
from __future__ import annotations

import os
import re
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ddpjob_api import contract
from .checkpoint import _Stager

KEEP = contract.SNAPSHOTS_KEPT
_FILE = re.compile(r"^rank-(\d+)-step-(\d{8})\.pt$")


@dataclass
class Cost:
    """What one rank's snapshots cost it so far: `paused` seconds of training stood still in `save`,
    `writer_cpu` seconds of CPU its writer thread used, over `taken` snapshots."""

    taken: int = 0
    paused: float = 0.0
    writer_cpu: float = 0.0

    def line(self, train_seconds: float) -> str:
        """The report of a run that trained `train_seconds` (COST_LINE reads it back)."""
        share = 100 * (self.paused + self.writer_cpu) / train_seconds if train_seconds > 0 else 0.0
        each = 1000 / max(1, self.taken)
        return (f"in-memory snapshots: {self.taken} taken; training paused {self.paused:.6f} s "
                f"({self.paused * each:.2f} ms each), their writer used {self.writer_cpu:.6f} s of CPU "
                f"({self.writer_cpu * each:.2f} ms each): {share:.3f} % of {train_seconds:.3f} s of training")


COST_LINE = re.compile(r"in-memory snapshots: (?P<taken>\d+) taken; training paused (?P<paused>[\d.]+) s .*"
                       r"their writer used (?P<writer_cpu>[\d.]+) s of CPU")


def read_cost(text: str) -> Cost | None:
    """The Cost a run's log reports (the last line of it), None when it reports none."""
    found = list(COST_LINE.finditer(text))
    if not found:
        return None
    m = found[-1]
    return Cost(taken=int(m["taken"]), paused=float(m["paused"]), writer_cpu=float(m["writer_cpu"]))


class Snapshots:
    """One rank's snapshots: `save` (async), `steps` and `load` on resume (manager.py says when)."""

    def __init__(self, root: Path, *, rank: int, warn: Callable[[str], None]) -> None:
        self.root, self.rank, self.warn = root, rank, warn
        self._stager = _Stager()
        self._writer: threading.Thread | None = None
        self.failed = False  # a write failed: no more snapshots this run
        self.cost = Cost()

    def path(self, step: int) -> Path:
        return self.root / f"rank-{self.rank}-step-{step:08d}.pt"

    def steps(self) -> list[int]:
        """This rank's complete snapshots, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(_FILE.match(p.name), p) for p in self.root.iterdir()]
        return sorted(int(m.group(2)) for m, _ in found if m and int(m.group(1)) == self.rank)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Copy `state` now; write it on a thread (waiting first for the previous write)."""
        t0 = time.perf_counter()
        self.wait()
        if self.failed:
            return
        staged = self._stager.stage(state)
        self._writer = threading.Thread(target=self._write, args=(step, staged), name="snapshot", daemon=True)
        self._writer.start()
        self.cost.taken += 1
        self.cost.paused += time.perf_counter() - t0

    def _write(self, step: int, state: dict[str, Any]) -> None:
        final = self.path(step)
        tmp = final.with_name(final.name + ".part")
        cpu0 = time.thread_time()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            torch.save(state, tmp)
            os.replace(tmp, final)
            for old in self.steps()[:-KEEP]:
                self.path(old).unlink(missing_ok=True)
        except Exception as exc:  # noqa: BLE001 - a snapshot never stops training
            self.failed = True
            with suppress(OSError):  # nothing was written there
                tmp.unlink(missing_ok=True)
            self.warn(f"in-memory snapshot to {final} failed ({type(exc).__name__}: {exc}); no more snapshots "
                      "this run (disk checkpoints go on)")
        finally:
            self.cost.writer_cpu += time.thread_time() - cpu0  # read by the trainer after wait()

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def load(self, step: int) -> dict[str, Any]:
        return torch.load(self.path(step), map_location="cpu", weights_only=True)

    def discard_after(self, step: int) -> None:
        """On a resume from `step`: delete every rank's snapshots of later steps under this root.

        Those steps are taken again, and after a resize on other ranks' data: a rank that kept its
        old copy could later agree on that step with another rank's new copy (the other ranks'
        files too: on one machine every local node shares the root). Every rank does this while
        resuming, before its first step's gradient all-reduce, so it cannot delete a new
        snapshot: none is written before every rank has passed that all-reduce.
        """
        self.wait()
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            m = _FILE.match(p.name)
            if m and int(m.group(2)) > step:
                p.unlink(missing_ok=True)

    def clear(self) -> None:
        """The run ended: its snapshots would only hold /dev/shm room."""
        self.wait()
        for step in self.steps():
            self.path(step).unlink(missing_ok=True)


def agreed_step(candidates: list[int], holders: list[float], world_size: int) -> int | None:
    """The newest of rank 0's snapshot steps (`candidates`) that every rank holds: `holders[i]` is
    how many ranks hold candidates[i] (a sum over ranks); None when no step is held by all."""
    held = [step for step, n in zip(candidates, holders) if round(n) == world_size]
    return max(held) if held else None
