"""Sharded, atomic checkpoints: torch.distributed.checkpoint (DCP) shards, a manifest, one rename.

Layout under `dir`: `step-00000120/{.metadata, INDEX.json, __0_0.distcp, __1_0.distcp, ...,
rank-00000.pt, ..., MANIFEST.json}`.
- The state every rank shares (model, optimizer, scheduler, step, epoch, sampler position,
  config) is saved with DCP, through our raw-bytes storage layer (dcp_storage.py, imported by
  the first save: a resume needs none of DCP). Under DDP it is
  replicated; share_of gives each tensor to one rank (split by bytes, the same split on every
  rank), so N ranks stage and write about 1/N of the bytes each, in parallel, into the shared
  directory, and rank 0 writes `.metadata` and INDEX.json (where each item lives; storage.py).
  Loading uses no DCP: each rank reads about 1/N of the tensors through INDEX.json and broadcasts
  them (one buffer per rank over the checkpoint group), so every rank has the whole state (DDP
  needs all of it), whatever the world size that wrote it; a single process reads it all.
- `rank-N.pt` holds what differs per rank (RNG states).
- MANIFEST.json, written last by rank 0 once every rank has reported its files, lists every
  file's size and xxh3-128 checksum, computed from the bytes as they were written (never read
  back). A directory without a manifest is incomplete (a write cut short) and is skipped. One with
  a manifest is complete: if it then cannot be read (a corrupt file, an index this version cannot
  read), loading fails with a ConfigError naming it and why, never falling back to an older
  checkpoint or step 0 (training from there would prune the newer ones).
Everything is written under `.tmp-step-N` and published by one rename; the directory must be
shared by all nodes (an RWX volume on Kubernetes). With async saving (the trainer's default) the
shared state and the rank state are first copied to reused (pinned, for CUDA) host buffers; the
rank file, the DCP write, manifest, publish and pruning then run on a background thread over a
gloo group of their own, off the training path.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from ..errors import ConfigError
from ..reporting import NullReporter
from .parallel import run_each, split_by_size
from .storage import HASH, INDEX, HashingWriter, build_state, item_nbytes, load_indexed, path_key, read_index, read_items

# A single process saves without a group on purpose; DCP would warn about it at every save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

_STEP_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST = "MANIFEST.json"
DCP_METADATA = ".metadata"
# Files per rank written by parallel threads: checksumming and writing overlap across threads
# (both release the GIL). Measured on 2 cores, resnet18's state, one rank, raw storage, medians of
# 11: 0.076 s with 1 thread, 0.067 s with 2, 0.064 s with 4 (dd of the bytes: 0.067 s). More threads
# mostly add files: a GPU node runs several ranks, each writing its share.
IO_THREADS = 2
# Threads that copy the state to host buffers for an async save (see _Stager), for a state of at
# least PARALLEL_COPY_BYTES: a smaller one is copied on the caller's thread. A second thread halves a
# large copy (resnet18's 94 MB below) but the caller joins it, and on a busy CPU it may be descheduled:
# the convnet's 1.2 MB state (the snapshot every 10 steps) took a median 0.56-0.84 ms, p90 2.2-3.5 ms,
# worst 34 ms with 2 threads, 0.42 ms, p90 0.6 ms, worst 8 ms with 1 (200 copies, load average 4.6 on 2 cores).
COPY_THREADS = 2
PARALLEL_COPY_BYTES = 16 << 20


class CheckpointUnreadable(ConfigError):
    """A complete checkpoint (it has a manifest) that cannot be read: the job stops (exit 78).

    Skipping it would resume from an older checkpoint or from step 0, and the next saves would
    prune the checkpoints that could not be read; a person has to look at it first.
    """

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"spec.trainer.checkpoint.dir: checkpoint {path} is complete but cannot be read: {reason}. "
            f"Nothing was loaded or pruned. Move {path.name} out of {path.parent} to resume from the "
            "checkpoint before it, or restore it")
        self.path, self.reason = path, reason


def rank_file(rank: int) -> str:
    """Per-rank state file name."""
    return f"rank-{rank:05d}.pt"


def step_dir_name(step: int) -> str:
    """Directory name for a step (zero-padded so names sort by step)."""
    return f"step-{step:08d}"


def _digest(path: Path) -> str:
    h = xxhash.xxh3_128()
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


def atomic_torch_save(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save to a temp name, fsync, rename: readers see the old file or the whole new one.

    Returns the manifest entry ({size, xxh3_128}) computed from the bytes as they were written.
    """
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        w = HashingWriter(f)
        torch.save(obj, w)  # type: ignore[arg-type]  # torch.save needs only write()
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return w.entry()


# The write probe (probe_write_bandwidth): 4 MiB. Big enough that the fsync's fixed cost (a few ms on a
# local disk, round trips on network storage) does not dominate a fast disk's transfer (4 MiB at
# 1 GB/s is 4 ms); what it still adds only lowers the speed measured, so a save is estimated
# longer, the safe side. Small enough that opening the directory stays cheap: 40 ms at 100 MB/s.
PROBE_BYTES = 4 << 20
PROBE_FILE = ".ddpjob-write-probe"


def probe_write_bandwidth(directory: Path) -> float:
    """Bytes per second one writer gets into `directory`: PROBE_BYTES written and fsynced, as a
    checkpoint's files are, then removed. Random bytes: storage that compresses would take zeros
    faster than it takes a model's weights."""
    directory.mkdir(parents=True, exist_ok=True)
    data = os.urandom(PROBE_BYTES)
    path = directory / PROBE_FILE
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink(missing_ok=True)
    return PROBE_BYTES / max(seconds, 1e-6)


def state_nbytes(state: Any) -> int:
    """The bytes of the tensors in a state tree (what a checkpoint of it writes, less a little metadata)."""
    return sum(v.numel() * v.element_size() for v in flatten(state).values() if isinstance(v, torch.Tensor))


def verify(step_dir: Path) -> str | None:
    """None when step_dir is a complete checkpoint, else why it is not."""
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        return "no MANIFEST.json (incomplete write)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"unreadable MANIFEST.json ({exc})"
    if DCP_METADATA not in files:
        return "no DCP .metadata in the manifest (written by a DDPJob before 2026-11-24, not loadable)"
    for name, meta in files.items():
        p = step_dir / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{name} has {p.stat().st_size} bytes, manifest says {meta['size']}"
        if _digest(p) != meta[HASH]:
            return f"{name} does not match its {HASH} checksum (corrupt)"
    return None


def check_resumable(common: dict[str, Any], *, path: Path, batch_size: int, grad_accum_steps: int) -> None:
    """Refuse a checkpoint written with another batchSize or gradAccumSteps.

    Any world size resumes (the position is a global sample offset, re-split over the new ranks,
    and the learning rate follows the world size: loop.py), but a batch the user changed has no
    rule for the learning rate the user set with it. Exit 78: retrying cannot help, the job must
    be resumed with the same sizes or started in a fresh directory.
    """
    old = common.get("config", {})
    saved = (old.get("batch_size"), old.get("grad_accum_steps", 1))
    if saved != (batch_size, grad_accum_steps):
        raise ConfigError(
            f"spec.trainer.checkpoint.dir: checkpoint {path} was written with batchSize {saved[0]}, "
            f"gradAccumSteps {saved[1]}; this run has batchSize {batch_size}, gradAccumSteps {grad_accum_steps}. "
            "Resume with the same batch sizes (the world size may differ), or use a new checkpoint.dir")


def optimizer_state(saved: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state_dict as loaded from a checkpoint, ready for `load_state_dict`.

    DCP stores dict keys as strings; the optimizer's per-parameter state is keyed by the
    parameter's index, and under a string key `load_state_dict` would keep it without ever
    using it (training would go on with fresh momentum, silently).
    """
    return {**saved, "state": {int(k): v for k, v in saved.get("state", {}).items()}}


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
    CPU tensors are copied as plain bytes, a large state by COPY_THREADS threads (numpy's copy
    releases the GIL).
    Reuse is safe because a save waits for the previous write before staging again.
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []
        self._next = 0
        self._cuda = False
        self._host: list[tuple[Any, Any]] = []  # (destination bytes, source bytes) of CPU tensors

    def stage(self, obj: Any) -> Any:
        self._next, self._cuda, self._host = 0, False, []
        # torch's own copies on one thread: a state is ~200 tensor copies, each too small to gain
        # from OpenMP, and on a busy CPU every parallel region waits for descheduled threads
        # (measured: 0.08 s with one thread, 0.6-0.9 s with two, resnet18 + momentum on a loaded
        # 2-core machine). The byte copies below have no such barrier: a descheduled thread only
        # delays its own half.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            out = self._walk(obj)
        finally:
            torch.set_num_threads(threads)
        self._copy_host()
        if self._cuda:
            torch.cuda.synchronize()
        return out

    def _copy_host(self) -> None:
        # Split by bytes; resnet18's 94 MB: 10.7 ms by torch on one thread, 8.3 ms by numpy on
        # one, 4.8 ms on two (idle 2-core machine).
        def copy(pairs):
            for dst, src in pairs:
                np.copyto(dst, src)
        size = sum(dst.nbytes for dst, _ in self._host)
        threads = COPY_THREADS if size >= PARALLEL_COPY_BYTES else 1
        run_each(copy, split_by_size(self._host, threads, lambda pair: pair[0].nbytes))

    def _walk(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy(obj.detach())
        if isinstance(obj, dict):
            return {k: self._walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._walk(v) for v in obj)
        return obj  # numbers, strings: immutable

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            # The device-only test's stand-in for CUDA holds no data; zeros of its shape take the
            # writer down the same path as a real device's tensors.
            return torch.zeros(t.shape, dtype=t.dtype)
        if t.device.type not in ("cpu", "cuda"):
            return t.detach().cpu()
        cuda = t.device.type == "cuda"
        self._cuda |= cuda
        i, self._next = self._next, self._next + 1
        if i >= len(self._bufs) or self._bufs[i].shape != t.shape or self._bufs[i].dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
            self._bufs[i:i + 1] = [buf]
        buf = self._bufs[i]
        if not cuda and t.is_contiguous() and t.numel() and not t.is_conj() and not t.is_neg():
            self._host.append((_byte_view(buf), _byte_view(t)))
            return buf
        return buf.copy_(t, non_blocking=cuda)


def _byte_view(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    return False


def flatten(state: dict[str, Any]) -> dict[str, Any]:
    """The state as {path_key: leaf}: tensors, and whole containers without a tensor (a config, a
    scheduler's state, AdamW's betas stay what they are). Dict keys become strings, as under DCP."""
    out: dict[str, Any] = {}

    def walk(obj: Any, path: list[Any]) -> None:
        if path and (isinstance(obj, torch.Tensor) or not _holds_tensor(obj)):
            out[path_key(path)] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, [*path, str(k)])
        else:
            for i, v in enumerate(obj):
                walk(v, [*path, i])

    walk(state, [])
    return out


def share_of(state: dict[str, Any], *, rank: int, world_size: int) -> dict[str, Any]:
    """The leaves of the (replicated) state this rank writes: tensors split by bytes over the ranks,
    the small non-tensor leaves on rank 0. Every rank computes the same split from the same state."""
    flat = flatten(state)
    tensors = [k for k, v in flat.items() if isinstance(v, torch.Tensor)]
    parts = split_by_size(tensors, world_size, lambda k: flat[k].numel() * flat[k].element_size() or 1)
    mine = parts[rank] if rank < len(parts) else []
    if rank == 0:
        mine = mine + [k for k, v in flat.items() if not isinstance(v, torch.Tensor)]
    return {k: flat[k] for k in mine}


class Checkpointer:
    """Saves and finds checkpoints for one rank; `save` and `load_latest` are called by every rank.

    `group` is a gloo group of all ranks used only by checkpoint writes (DCP's planning and the
    manifest), so that a write on the background thread never interleaves with the training
    thread's collectives on the default group; None in a single process. With `async_save`,
    training stands still only for the host copy of the shared state and its rank state; the
    rest runs on a background thread. At most one write is in flight: the next save, and the end
    of the run (`wait`), first wait for it and raise its error, if any. A write cut short by a
    crash leaves only a `.tmp-*` directory, which is never loaded: the previous complete
    checkpoint is.
    """

    def __init__(self, directory: str, *, keep: int, rank: int, group: dist.ProcessGroup | None,
                 barrier: Callable[[], None], broadcast: Callable[[Any], Any],
                 log: NullReporter, async_save: bool = False, io_threads: int = IO_THREADS) -> None:
        self.dir = Path(directory)
        self.keep = keep
        self.rank = rank
        self.group = group
        self._barrier = barrier  # on the default group: the training thread's
        self._broadcast = broadcast  # rank 0's value -> every rank
        self.log = log
        self.async_save = async_save
        self.io_threads = io_threads
        self.last_saved_step: int | None = None
        # The last save's time from its start until this rank's files were written, background write
        # included (preempt.plan's estimate of the next one); None until one got that far.
        self.last_seconds: float | None = None
        self._writer: threading.Thread | None = None
        self._pruner: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stager = _Stager()

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    def save(self, *, step: int, common: dict[str, Any], rank_state: dict[str, Any]) -> Path:
        """Collective: every rank stages and writes its share only; rank 0 publishes the directory atomically."""
        final = self.dir / step_dir_name(step)
        tmp = self.dir / f".tmp-{step_dir_name(step)}"
        self.wait()
        t0 = time.perf_counter()
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed earlier attempt
            tmp.mkdir(parents=True)
        self._barrier()
        common = share_of(common, rank=self.rank, world_size=self.world_size)
        if self.async_save:
            staged = self._stager.stage({"common": common, "rank": rank_state})
            self._writer = threading.Thread(target=self._write_in_background, name="ckpt-writer",
                                            args=(staged["common"], staged["rank"], tmp, final, step, t0), daemon=True)
            self._writer.start()
        else:
            self._write(common, rank_state, tmp, final, step, t0)
        self.last_saved_step = step
        return final

    def _write_in_background(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = exc

    def _write(self, common: dict[str, Any], rank_state: dict[str, Any], tmp: Path, final: Path, step: int,
               t0: float) -> None:
        """Every rank: its rank file and DCP share; then rank 0, holding every rank's file list, publishes."""
        own = {rank_file(self.rank): atomic_torch_save(rank_state, tmp / rank_file(self.rank))}
        from .dcp_storage import save_shared  # on this writer thread: off the training path
        files = {**own, **save_shared(common, tmp, group=self.group, io_threads=self.io_threads)}
        # This rank's part is on disk: its time is recorded before the gather below, hence before
        # any rank can publish the manifest. A stop vote cast once the checkpoint is complete on disk
        # so always carries its time (preempt.plan; before issue 52 it was recorded after publishing,
        # and a SIGTERM just after the manifest could find no save measured).
        self.last_seconds = time.perf_counter() - t0
        if self.group is not None:
            # Also the barrier that makes publishing safe: every rank has written all its files.
            gathered: list[Any] | None = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
            dist.gather_object(files, gathered, dst=0, group=self.group)
            files = {k: v for part in (gathered or []) for k, v in part.items()}
        if self.rank == 0:
            self._publish(files, tmp, final, step)

    def _publish(self, files: dict[str, Any], tmp: Path, final: Path, step: int) -> None:
        (tmp / (MANIFEST + ".part")).write_text(json.dumps({"step": step, "files": dict(sorted(files.items()))},
                                                           indent=1))
        os.replace(tmp / (MANIFEST + ".part"), tmp / MANIFEST)
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        # Deleting old checkpoints (hundreds of MB of unlinks, 0.1 s for resnet18's on a busy
        # 2-core machine) is no part of saving this one: off the training path even when saving
        # synchronously. The next save, and the end of the run, wait for it.
        self._pruner = threading.Thread(target=self._prune, name="ckpt-prune", daemon=True)
        self._pruner.start()

    def wait(self) -> None:
        """Block until the checkpoint being written is published and old ones pruned; raise if
        writing it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._pruner is not None:  # started by the writer, when there is one: joined after it
            self._pruner.join()
            self._pruner = None
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint under {self.dir} failed: {exc}") from exc

    def _prune(self) -> None:
        # Only complete checkpoints count towards `keep` and only they are deleted: a directory
        # without a manifest is nobody's to delete, and counting it would delete a good one.
        complete = [path for _, path in self._step_dirs() if (path / MANIFEST).is_file()]
        for path in complete[self.keep:]:
            shutil.rmtree(path, ignore_errors=True)

    def _step_dirs(self) -> list[tuple[int, Path]]:
        """(step, directory) of every step directory, newest first."""
        found = [(_STEP_DIR.match(p.name), p) for p in self.dir.iterdir()] if self.dir.is_dir() else []
        return sorted(((int(m.group(1)), p) for m, p in found if m and p.is_dir()), reverse=True)

    def newest_published_step(self) -> int | None:
        """The step of the newest checkpoint with a manifest (not verified: a cheap listing)."""
        return next((step for step, path in self._step_dirs() if (path / MANIFEST).is_file()), None)

    def newest_complete(self) -> Path | None:
        """Rank 0's choice: the newest checkpoint with a manifest, verified and readable.

        A directory without a manifest (a write cut short) is skipped with a warning; one with a
        manifest that fails verification or whose index cannot be read raises CheckpointUnreadable.
        """
        for _, path in self._step_dirs():
            if not (path / MANIFEST).is_file():
                self.log.warning(f"skipping checkpoint {path}: no {MANIFEST} (incomplete write)")
                continue
            problem = verify(path)
            if problem is None:
                indexed = (path / INDEX).is_file()
                try:
                    if indexed:
                        read_index(path)
                    else:
                        from .dcp_storage import read_metadata
                        read_metadata(path)
                except Exception as exc:  # noqa: BLE001 - whatever it is, this checkpoint cannot be read
                    problem = f"{INDEX if indexed else DCP_METADATA}: {exc}"
            if problem is not None:
                raise CheckpointUnreadable(path, problem)
            return path
        return None

    def load_latest(self) -> Loaded | None:
        """Collective: every rank loads the checkpoint rank 0 chose (or None), onto the CPU.

        Rank 0's refusal (CheckpointUnreadable) reaches every rank, so the whole group stops with
        the same reason instead of the others waiting for a broadcast that never comes.
        """
        choice: tuple[str | None, str | None] = (None, None)
        if self.rank == 0:
            try:
                chosen = self.newest_complete()
                choice = (str(chosen) if chosen else None, None)
            except CheckpointUnreadable as exc:
                choice = (str(exc.path), exc.reason)
        chosen, problem = self._broadcast(choice)
        if problem is not None:
            raise CheckpointUnreadable(Path(chosen), problem)
        if not chosen:
            return None
        path = Path(chosen)
        rf = path / rank_file(self.rank)
        try:
            # A rank beyond the old world size (elastic growth) has no state of its own to restore.
            rank_state = torch.load(rf, map_location="cpu", weights_only=True) if rf.is_file() else None
            if (path / INDEX).is_file() and self.group is not None:
                common = self._read_and_share(path, self.group)
            else:
                common = load_shared_state(path)
        except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as exc:
            raise CheckpointUnreadable(path, f"{type(exc).__name__}: {exc}") from exc
        return Loaded(path=path, common=common, rank_state=rank_state)

    def _read_and_share(self, path: Path, group: dist.ProcessGroup) -> dict[str, Any]:
        """Collective: each rank reads about 1/N of the tensors' bytes and broadcasts them, one
        buffer per rank, over the checkpoint group; every rank ends with the whole state (DDP
        needs it). The split depends only on INDEX, so any world size reads any checkpoint."""
        items = read_index(path)["items"]
        tensors = [i for i, item in enumerate(items) if "bytes" not in item]
        parts = split_by_size(tensors, self.world_size, lambda i: item_nbytes(items[i]) or 1)
        parts += [[] for _ in range(self.world_size - len(parts))]
        own = parts[self.rank] + [i for i, item in enumerate(items) if "bytes" in item]  # values are tiny
        values: dict[int, Any] = dict(zip(own, read_items(path, [items[i] for i in own])))
        for src, ids in enumerate(parts):
            sizes = [item_nbytes(items[i]) for i in ids]
            if not sum(sizes):
                continue
            buf = (torch.cat([values[i].reshape(-1).view(torch.uint8) for i in ids]) if src == self.rank
                   else torch.empty(sum(sizes), dtype=torch.uint8))
            dist.broadcast(buf, src=dist.get_global_rank(group, src), group=group)
            if src != self.rank:
                for i, chunk in zip(ids, torch.split(buf, sizes)):
                    dtype = getattr(torch, items[i]["dtype"])
                    values[i] = chunk.clone().view(dtype).reshape(items[i]["shape"])  # clone: aligned
        return build_state(items, [values[i] for i in range(len(items))])


def load_shared_state(path: Path) -> dict[str, Any]:
    """The whole shared state of a checkpoint directory, read by this process alone (no collectives).

    DDP needs every tensor on every rank, so there is nothing to split; reading without a
    process group also makes the state loadable at any world size, and by tools (an eval script).
    Non-tensor values (step, config) come back as saved; dict keys come back as strings.
    Read through the checkpoint's own INDEX.json; one written before the index existed goes
    through DCP's pickled `.metadata` instead.
    """
    if (path / INDEX).is_file():
        return load_indexed(path, read_index(path))
    from .dcp_storage import load_unindexed
    return load_unindexed(path)
