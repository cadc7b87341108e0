"""DCP storage that writes tensors as their raw bytes: one file per writer thread, no archive per tensor.

Imported only by a save, or by the read of a checkpoint from before INDEX.json (storage.py says
why: DCP's import costs as much as torch's, and a worker restarted in place may need neither).

DCP's own FileSystemWriter wraps every tensor in a `torch.save` zip archive (a pickle, a record
per storage, CRC32). For resnet18 with momentum (184 tensors, 94 MB) that made a save as slow as one
plain torch.save, 0.12 s, where writing the same bytes takes 0.06 s here: the archive, not the
disk, was the cost. DCP's metadata already holds each tensor's dtype and shape, so the bytes are
all a shard needs to hold. They are in the host's byte order, which torch.save would have recorded:
little-endian on every platform torch ships wheels for.

The planning, metadata, resharding and coordination stay DCP's; only the storage layer (DCP's
StorageWriter/StorageReader extension point) changes. Every raw item is marked in `.metadata` with
the transform descriptor RAW: stock `dcp.load` on such a checkpoint fails with "Unknown extension
name='raw-tensor-bytes@ddpjob.dev'" instead of misreading bytes, and RawReader still reads shards
written in DCP's default format (checkpoints from before this storage layer).

Beside DCP's `.metadata` (a pickle of torch's private classes, which a torch upgrade may move),
the coordinator writes INDEX (build_index), a JSON index of its own, read without DCP by
storage.py; RawReader (DCP's read path) remains for checkpoints written before the index.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  SavePlanner, WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .parallel import run_each, split_by_size
from .storage import INDEX, INDEX_FORMAT, RAW, HashingWriter, dtype_name, region, tensor_of
from ..torchapi import StorageInfo, load_dcp_state

T = TypeVar("T")


def _nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


def _done(value: T) -> Future[T]:
    """A future that holds `value` already: our storage layer writes and reads synchronously."""
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's element bytes, without a copy when it is a dense CPU tensor."""
    t = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class RawWriter(dcp.FileSystemWriter):
    """FileSystemWriter whose files hold the tensors' bytes back to back (`thread_count` files per rank).

    An exception in any writer thread is raised by write_data: DCP's own extra threads only print
    theirs, and the checkpoint then silently lacks the items they held. With `json_paths`, the
    state is flat and each key is its item's path in the state tree as JSON (path_key), which
    INDEX records as the path.
    """

    json_paths = False

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix  # "__<rank>_", set by DCP's global plan
        buckets = split_by_size(plan.items, self.thread_count, lambda item: _nbytes(item) or 1)
        results = run_each(lambda job: self._write_file(f"{prefix}{job[0]}.distcp", job[1], planner),
                           list(enumerate(buckets)))
        return _done([r for rs in results for r in rs])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only: DCP's `.metadata`, then our own INDEX of the same items."""
        super().finish(metadata, results)
        index = build_index(metadata, [r for rs in results for r in rs], json_paths=self.json_paths)
        with self.fs.create_stream(self.fs.concat_path(self.path, INDEX), "wb") as stream:
            stream.write(json.dumps(index, indent=0).encode())
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        out = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            offset = 0
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    buf, descriptors = data.getbuffer(), None
                else:
                    buf, descriptors = _as_bytes(data), [RAW]
                stream.write(buf)
                out.append(WriteResult(index=item.index, size_in_bytes=buf.nbytes,
                                       storage_data=StorageInfo(name, offset, buf.nbytes,
                                                                transform_descriptors=descriptors)))
                offset += buf.nbytes
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        return out


def _chunk(md: TensorStorageMetadata, index: MetadataIndex):
    """The stored chunk a read item refers to: by DCP's index hint, else by its offsets."""
    if index.index is not None and index.index < len(md.chunks) and md.chunks[index.index].offsets == index.offset:
        return md.chunks[index.index]
    return next(c for c in md.chunks if c.offsets == index.offset)


class RawReader(dcp.FileSystemReader):
    """FileSystemReader for RawWriter's shards; items in DCP's default format go to the stock reader."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        super().set_up_storage_reader(metadata, is_coordinator)
        self._tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        rest = []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if RAW in (info.transform_descriptors or ()):
                by_file.setdefault(info.relative_path, []).append(req)
            else:
                rest.append(req)
        for name, reqs in by_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    self._read_tensor(stream, req, planner)
        if rest:
            return super().read_data(LoadPlan(rest, plan.storage_data), planner)
        return _done(None)

    def _read_tensor(self, stream: Any, req: ReadItem, planner: LoadPlanner) -> None:
        if req.type != LoadItemType.TENSOR:
            raise ValueError(f"{req.storage_index.fqn}: raw storage holds tensors only, not {req.type}")
        info = self.storage_data[req.storage_index]
        md = self._tensors[req.storage_index.fqn]
        chunk = _chunk(md, req.storage_index)
        stream.seek(info.offset)
        data = bytearray(info.length)
        if stream.readinto(data) != info.length:
            raise ValueError(f"{info.relative_path} ends before {req.storage_index.fqn}'s {info.length} bytes "
                             f"at offset {info.offset} (truncated shard)")
        tensor = region(tensor_of(data, md.properties.dtype, chunk.sizes), req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise ValueError(f"{req.storage_index.fqn}: stored {tuple(tensor.size())}, wanted {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def build_index(metadata: Metadata, results: list[WriteResult], *, json_paths: bool = False) -> dict[str, Any]:
    """INDEX's content: every item by its path in the state tree, from DCP's plan and our writes.

    Tensors may be stored in several chunks (a sharded state); each chunk names its place in the
    whole tensor (offsets, sizes) and its bytes (file, offset, length).
    """
    where = {(r.index.fqn, tuple(r.index.offset or ())): r.storage_data for r in results}
    paths = metadata.planner_data or {}
    items = []
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        path = json.loads(fqn) if json_paths else list(paths.get(fqn, (fqn,)))
        if isinstance(md, TensorStorageMetadata):
            chunks = []
            for c in md.chunks:
                info = where[(fqn, tuple(c.offsets))]
                if RAW not in (info.transform_descriptors or ()):
                    raise ValueError(f"{fqn}: not written as raw bytes, cannot be indexed")
                chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes), "file": info.relative_path,
                               "offset": info.offset, "length": info.length})
            items.append({"path": path, "dtype": dtype_name(md.properties.dtype), "shape": list(md.size),
                          "chunks": chunks})
        else:  # bytes: a torch.save of a plain value (step, config)
            info = where[(fqn, ())]
            items.append({"path": path, "bytes": {"file": info.relative_path, "offset": info.offset,
                                                  "length": info.length}})
    return {"format": INDEX_FORMAT, "items": items}




@contextlib.contextmanager
def dcp_errors(what: str):
    """DCP's CheckpointException as a RuntimeError naming the first failure.

    It derives from BaseException: as raised, the trainer's `except Exception` would miss it and
    the job's status would get no reason for the failure.
    """
    try:
        yield
    except CheckpointException as exc:
        failures = getattr(exc, "failures", None) or {}
        first = next(iter(failures.values()), None)
        cause = first[0] if isinstance(first, tuple) and first else exc
        raise RuntimeError(f"{what} failed: {type(cause).__name__}: {cause}") from exc


class _HashingFileSystem(FileSystem):
    """DCP's local file system, with every file it writes hashed on the way: the manifest's entries."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, mode) as f:
            w = HashingWriter(f)
            yield w
        # `.metadata` is written as `.metadata.tmp` and renamed; name the entry after the result.
        self.files[Path(path).name.removesuffix(".tmp")] = w.entry()


def save_shared(state: dict[str, Any], directory: Path, *, group: dist.ProcessGroup | None,
                io_threads: int) -> dict[str, dict[str, Any]]:
    """Collective over `group`: this rank's share of the (flat, share_of) state into `directory`.

    Returns the manifest entries of the files this rank wrote, hashed as they were written.
    """
    fs = _HashingFileSystem()
    writer = RawWriter(directory, sync_files=True, thread_count=io_threads)
    writer.fs = fs
    writer.json_paths = True
    with dcp_errors(f"writing checkpoint {directory}"):
        # Flat (share_of): DCP must not flatten again, and holds no key twice, so it dedups nothing.
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None,
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    return fs.files


def read_metadata(path: Path) -> Any:
    """DCP's `.metadata` of an unindexed checkpoint: raises what makes it unreadable."""
    return RawReader(path).read_metadata()


def load_unindexed(path: Path) -> dict[str, Any]:
    """The whole state of a checkpoint from before INDEX.json, through DCP's read path."""
    with dcp_errors(f"reading checkpoint {path}"):
        return load_dcp_state(path, RawReader(path))
