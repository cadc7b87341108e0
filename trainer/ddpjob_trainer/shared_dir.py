"""At start, refuse a checkpoint directory that is not one directory shared by every node.

A volume per node (a ReadWriteOnce claim, an emptyDir, a hostPath) instead of one ReadWriteMany
volume otherwise shows only at the first save: the ranks' shards land in different directories,
rank 0 waits for files it never sees until a collective times out (600 s), and no checkpoint is
ever loadable. Here it costs two small collectives and a file of a few bytes.
"""
from __future__ import annotations

import secrets
import socket
from pathlib import Path

import torch.distributed as dist

from .errors import ConfigError

NONCE_PREFIX = ".ddpjob-shared-check-"


def check_shared_dir(directory: Path, *, rank: int, group: dist.ProcessGroup | None) -> None:
    """Collective over `group` (gloo, every rank): rank 0 writes a nonce file into `directory`,
    every rank reads it back, and every rank raises the same ConfigError if one did not see it.
    The file is removed once all have looked. Nothing to check in a single process (no group)."""
    if group is None:
        return
    nonce = secrets.token_hex(8) if rank == 0 else None
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{NONCE_PREFIX}{nonce}").write_text(nonce)
    try:
        # Also the barrier: rank 0 wrote the file before it sent the name.
        box = [nonce]
        dist.broadcast_object_list(box, src=0, group=group)
        nonce = box[0]
        try:
            seen = (directory / f"{NONCE_PREFIX}{nonce}").read_text() == nonce
        except OSError:
            seen = False
        views: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(views, (seen, socket.gethostname()), group=group)
    finally:
        if rank == 0:
            (directory / f"{NONCE_PREFIX}{nonce}").unlink(missing_ok=True)
    blind = [(r, host) for r, (seen, host) in enumerate(views) if not seen]
    if blind:
        who = ", ".join(f"rank {r} (host {host})" for r, host in blind)
        raise ConfigError(f"spec.trainer.checkpoint.dir {directory} is not shared by all nodes: {who} cannot "
                          "see the file rank 0 wrote there. Every node must mount the same volume at that "
                          "path (a ReadWriteMany PersistentVolumeClaim)")
