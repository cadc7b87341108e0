"""Atomic checkpoint files and the newest-complete choice (one rank; collectives are no-ops)."""
from __future__ import annotations

import json

import torch

from ddpjob_trainer.checkpoint import Checkpointer, verify
from ddpjob_trainer.reporting import NullReporter


class Warnings(NullReporter):
    def __init__(self):
        self.lines = []

    def warning(self, msg):
        self.lines.append(msg)


def make(tmp_path, keep=3, log=None):
    return Checkpointer(str(tmp_path), keep=keep, rank=0, barrier=lambda: None,
                        broadcast=lambda v: v, log=log or NullReporter())


def save(ck, step):
    return ck.save(step=step, common={"step": step, "w": torch.full((4,), float(step))},
                   rank_state={"rng": torch.get_rng_state()})


def test_save_publishes_a_verified_directory_with_a_manifest(tmp_path):
    path = save(make(tmp_path), 7)
    assert path.name == "step-00000007" and verify(path) is None
    files = json.loads((path / "MANIFEST.json").read_text())["files"]
    assert set(files) == {"common.pt", "rank-00000.pt"}
    assert not list(tmp_path.glob(".tmp-*")) and not list(path.glob("*.part"))


def test_manifest_hash_computed_while_writing_matches_the_bytes_on_disk(tmp_path):
    import hashlib

    path = save(make(tmp_path), 3)
    meta = json.loads((path / "MANIFEST.json").read_text())["files"]["common.pt"]
    data = (path / "common.pt").read_bytes()
    assert meta == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_checkpoint_from_another_world_or_batch_size_is_refused():
    from pathlib import Path

    import pytest

    from ddpjob_trainer.checkpoint import check_resumable
    from ddpjob_trainer.errors import ConfigError

    common = {"world_size": 2, "epoch": 1, "micro_done": 5,
              "config": {"batch_size": 64, "grad_accum_steps": 1}}
    check_resumable(common, path=Path("/c/step-1"), world_size=2, batch_size=64, grad_accum_steps=1)
    for kwargs, needle in (({"world_size": 3}, "this run has world size 3"),
                           ({"batch_size": 32}, "batchSize 32"),
                           ({"grad_accum_steps": 2}, "gradAccumSteps 2")):
        args = {"world_size": 2, "batch_size": 64, "grad_accum_steps": 1, **kwargs}
        with pytest.raises(ConfigError) as info:
            check_resumable(common, path=Path("/c/step-1"), **args)
        assert "spec.trainer.checkpoint.dir: checkpoint /c/step-1 was written at world size 2" in str(info.value)
        assert needle in str(info.value)


def test_keep_prunes_the_oldest(tmp_path):
    ck = make(tmp_path, keep=2)
    for s in (1, 2, 3, 4):
        save(ck, s)
    ck.wait()  # pruning runs on a background thread
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]


def test_truncated_file_is_skipped_with_a_warning_naming_it(tmp_path):
    log = Warnings()
    ck = make(tmp_path, log=log)
    save(ck, 1)
    newest = save(ck, 2)
    (newest / "rank-00000.pt").write_bytes(b"x")
    loaded = ck.load_latest(map_location="cpu")
    assert loaded.common["step"] == 1
    assert any(str(newest) in w and "rank-00000.pt" in w for w in log.lines)


def test_nothing_to_resume_from(tmp_path):
    assert make(tmp_path / "empty").load_latest(map_location="cpu") is None


def make_async(tmp_path, keep=3):
    return Checkpointer(str(tmp_path), keep=keep, rank=0, barrier=lambda: None,
                        broadcast=lambda v: v, log=NullReporter(), async_save=True)


def test_async_save_writes_the_state_as_it_was_when_save_returned(tmp_path):
    ck = make_async(tmp_path)
    w = torch.zeros(1000)
    path = ck.save(step=5, common={"step": 5, "w": w}, rank_state={"rng": torch.get_rng_state()})
    w.add_(1.0)  # training goes on while the write runs
    ck.wait()
    assert verify(path) is None
    assert torch.equal(torch.load(path / "common.pt", weights_only=True)["w"], torch.zeros(1000))
    assert not list(tmp_path.glob(".tmp-*"))


def test_async_save_failure_is_raised_by_the_next_wait(tmp_path):
    import pytest

    ck = make_async(tmp_path)
    ck.save(step=1, common={"step": 1, "bad": lambda: None}, rank_state={})  # unpicklable
    with pytest.raises(RuntimeError, match="writing a checkpoint under .* failed"):
        ck.wait()
    assert not (tmp_path / "step-00000001").exists()  # never published: never loaded
    assert ck.load_latest(map_location="cpu") is None


def test_async_keep_prunes_after_publishing(tmp_path):
    ck = make_async(tmp_path, keep=2)
    for s in (1, 2, 3):
        ck.save(step=s, common={"step": s}, rank_state={})
    ck.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
