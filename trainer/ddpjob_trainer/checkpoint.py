"""Atomic, per-rank checkpoints: written to a temp dir, published by one rename, newest complete one loaded.

Layout under `dir`: `step-00000120/{common.pt, rank-00000.pt, ..., MANIFEST.json}`. `common.pt`
(rank 0) holds model, optimizer, scheduler, step, epoch, sampler position and config; each
`rank-N.pt` holds what differs per rank (RNG states). MANIFEST.json, written last, lists every
file's size and sha256: a directory without a valid manifest is incomplete and never loaded.
The directory must be shared by all nodes (an RWX volume on Kubernetes).

common.pt (the big file) is hashed while it is written, never read back; the rank files are a few
KiB of RNG state that rank 0 hashes from disk. With async saving (the trainer's default) common.pt
is written, published and old checkpoints pruned on a background thread, off the training path.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import ConfigError
from .reporting import NullReporter

_STEP_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST = "MANIFEST.json"
COMMON = "common.pt"


def rank_file(rank: int) -> str:
    """Per-rank state file name."""
    return f"rank-{rank:05d}.pt"


def step_dir_name(step: int) -> str:
    """Directory name for a step (zero-padded so names sort by step)."""
    return f"step-{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file wrapper that hashes and counts the bytes passing through."""

    def __init__(self, f) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def atomic_torch_save(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save to a temp name, fsync, rename: readers see the old file or the whole new one.

    Returns the manifest entry ({size, sha256}) computed from the bytes as they were written.
    """
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"size": w.size, "sha256": w.sha256.hexdigest()}


def verify(step_dir: Path) -> str | None:
    """None when step_dir is a complete checkpoint, else why it is not."""
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        return "no MANIFEST.json (incomplete write)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"unreadable MANIFEST.json ({exc})"
    for name, meta in files.items():
        p = step_dir / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{name} has {p.stat().st_size} bytes, manifest says {meta['size']}"
        if _sha256(p) != meta["sha256"]:
            return f"{name} does not match its sha256 (corrupt)"
    return None


def check_resumable(common: dict[str, Any], *, path: Path, world_size: int, batch_size: int,
                    grad_accum_steps: int) -> None:
    """Refuse a checkpoint whose sampler position means other samples in this run.

    The saved position (epoch, batches done) counts per-rank batches of the old world size and
    batch size; under another one it would skip or repeat samples silently. Exit 78: retrying
    cannot help, the job must be resumed with the same sizes or started in a fresh directory.
    """
    old = common.get("config", {})
    saved = (common.get("world_size"), old.get("batch_size"), old.get("grad_accum_steps", 1))
    now = (world_size, batch_size, grad_accum_steps)
    if saved != now:
        raise ConfigError(
            f"spec.trainer.checkpoint.dir: checkpoint {path} was written at world size {saved[0]}, "
            f"batchSize {saved[1]}, gradAccumSteps {saved[2]}; this run has world size {now[0]}, "
            f"batchSize {now[1]}, gradAccumSteps {now[2]}. Its data position (epoch "
            f"{common.get('epoch')}, batch {common.get('micro_done')}) would point at other samples. "
            "Resume with the same nodes x nprocPerNode and batch sizes, or use a new checkpoint.dir")


@dataclass
class Loaded:
    """A checkpoint read back by one rank."""

    path: Path
    common: dict[str, Any]
    rank_state: dict[str, Any] | None


class _Stager:
    """Copies a state tree to host buffers so that training may change the original while it is written.

    The buffers are kept and reused from one save to the next (same shapes): fresh memory costs
    page faults on first touch, which made a copy of resnet18's state 5x slower than the copy
    itself. CUDA tensors go to pinned buffers (asynchronous copies, one synchronize at the end).
    Reuse is safe because a save waits for the previous write before staging again.
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []
        self._next = 0
        self._cuda = False

    def stage(self, obj: Any) -> Any:
        self._next, self._cuda = 0, False
        # One thread: a state is ~200 tensor copies, each too small to gain from OpenMP, and on
        # a busy CPU every parallel region waits for descheduled threads (measured: 0.08 s with
        # one thread, 0.6-0.9 s with two, resnet18 + momentum on a loaded 2-core machine).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            out = self._walk(obj)
        finally:
            torch.set_num_threads(threads)
        if self._cuda:
            torch.cuda.synchronize()
        return out

    def _walk(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy(obj.detach())
        if isinstance(obj, dict):
            return {k: self._walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._walk(v) for v in obj)
        return obj  # numbers, strings: immutable

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type not in ("cpu", "cuda"):
            return t.clone()  # e.g. meta in tests: nothing to stage
        cuda = t.device.type == "cuda"
        self._cuda |= cuda
        i, self._next = self._next, self._next + 1
        if i >= len(self._bufs) or self._bufs[i].shape != t.shape or self._bufs[i].dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
            self._bufs[i:i + 1] = [buf]
        return self._bufs[i].copy_(t, non_blocking=cuda)


class Checkpointer:
    """Saves and finds checkpoints for one rank; collective calls are made by every rank.

    With `async_save`, rank 0 stages the common state (a host copy) and writes, hashes,
    publishes and prunes it on a background thread while training goes on; training stands
    still only for the staging copy and the small per-rank files. At most one write is in
    flight: the next save, and the end of the run (`wait`), first wait for it and raise its
    error, if any. A write cut short by a crash leaves only a `.tmp-*` directory, which is never
    loaded: the previous complete checkpoint is.
    """

    def __init__(self, directory: str, *, keep: int, rank: int,
                 barrier: Callable[[], None], broadcast: Callable[[Any], Any],
                 log: NullReporter, async_save: bool = False) -> None:
        self.dir = Path(directory)
        self.keep = keep
        self.rank = rank
        self._barrier = barrier
        self._broadcast = broadcast  # rank 0's value -> every rank
        self.log = log
        self.async_save = async_save
        self.last_saved_step: int | None = None
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stager = _Stager()

    def save(self, *, step: int, common: dict[str, Any], rank_state: dict[str, Any]) -> Path:
        """Collective: every rank writes its part; rank 0 publishes the directory atomically."""
        final = self.dir / step_dir_name(step)
        tmp = self.dir / f".tmp-{step_dir_name(step)}"
        self.wait()
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed earlier attempt
            tmp.mkdir(parents=True)
        self._barrier()
        atomic_torch_save(rank_state, tmp / rank_file(self.rank))
        self._barrier()  # every rank's file is complete: rank 0 may publish whenever common.pt is
        if self.rank == 0:
            # The rank files are a few KiB of RNG state; hashing them here is cheap.
            files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
                     for p in sorted(tmp.iterdir()) if p.suffix == ".pt"}
            if self.async_save:
                staged = self._stager.stage(common)
                self._writer = threading.Thread(target=self._publish_in_background, name="ckpt-writer",
                                                args=(staged, files, tmp, final, step), daemon=True)
                self._writer.start()
            else:
                self._publish(common, files, tmp, final, step)
        self.last_saved_step = step
        return final

    def _publish_in_background(self, *args) -> None:
        try:
            self._publish(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = exc

    def _publish(self, common: dict[str, Any], files: dict[str, Any], tmp: Path, final: Path,
                 step: int) -> None:
        files = {**files, COMMON: atomic_torch_save(common, tmp / COMMON)}
        (tmp / (MANIFEST + ".part")).write_text(json.dumps({"step": step, "files": files}, indent=1))
        os.replace(tmp / (MANIFEST + ".part"), tmp / MANIFEST)
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        self._prune()

    def wait(self) -> None:
        """Block until the checkpoint being written is published; raise if writing it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint under {self.dir} failed: {exc}") from exc

    def _prune(self) -> None:
        steps = sorted(self._step_dirs(), reverse=True)
        for _, path in steps[self.keep:]:
            shutil.rmtree(path, ignore_errors=True)

    def _step_dirs(self) -> list[tuple[int, Path]]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
        return out

    def newest_complete(self) -> Path | None:
        """Rank 0's choice: the newest verified checkpoint, warning about every one skipped."""
        for _, path in sorted(self._step_dirs(), reverse=True):
            problem = verify(path)
            if problem is None:
                try:
                    torch.load(path / COMMON, map_location="cpu", weights_only=True)
                except Exception as exc:  # noqa: BLE001 - any unreadable file means "skip it"
                    problem = f"{COMMON} cannot be loaded ({exc})"
            if problem is None:
                return path
            self.log.warning(f"skipping checkpoint {path}: {problem}")
        return None

    def load_latest(self, *, map_location: Any) -> Loaded | None:
        """Collective: every rank loads the checkpoint rank 0 chose (or None)."""
        chosen = self.newest_complete() if self.rank == 0 else None
        chosen = self._broadcast(str(chosen) if chosen else None)
        if not chosen:
            return None
        path = Path(chosen)
        common = torch.load(path / COMMON, map_location=map_location, weights_only=True)
        rf = path / rank_file(self.rank)
        # A rank beyond the old world size (elastic growth) has no state of its own to restore.
        rank_state = torch.load(rf, map_location="cpu", weights_only=True) if rf.is_file() else None
        return Loaded(path=path, common=common, rank_state=rank_state)
