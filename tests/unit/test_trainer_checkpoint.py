"""Atomic DCP checkpoints, their manifest and the newest-complete choice (one process: no group)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash

from ddpjob_trainer.checkpointing.checkpoint import (MANIFEST, Checkpointer, CheckpointUnreadable, check_resumable,
                                                    load_shared_state, optimizer_state, probe_write_bandwidth, verify)
from ddpjob_trainer.errors import ConfigError
from ddpjob_trainer.reporting import NullReporter


class Warnings(NullReporter):
    def __init__(self):
        self.lines = []

    def warning(self, msg):
        self.lines.append(msg)


def make(tmp_path, keep=3, log=None, async_save=False):
    return Checkpointer(str(tmp_path), keep=keep, rank=0, group=None, barrier=lambda: None,
                        broadcast=lambda v: v, log=log or NullReporter(), async_save=async_save)


def save(ck, step):
    return ck.save(step=step, common={"step": step, "w": torch.full((4,), float(step))},
                   rank_state={"rng": torch.get_rng_state()})


def test_save_publishes_a_verified_directory_with_a_manifest(tmp_path):
    path = save(make(tmp_path), 7)
    assert path.name == "step-00000007" and verify(path) is None
    files = json.loads((path / "MANIFEST.json").read_text())["files"]
    assert {".metadata", "rank-00000.pt"} <= set(files)
    assert any(name.endswith(".distcp") for name in files)
    assert set(files) == {p.name for p in path.iterdir()} - {"MANIFEST.json"}  # nothing unlisted
    assert not list(tmp_path.glob(".tmp-*")) and not list(path.glob("*.part")) and not list(path.glob("*.tmp"))


def test_manifest_checksums_computed_while_writing_match_the_bytes_on_disk(tmp_path):
    path = save(make(tmp_path), 3)
    files = json.loads((path / "MANIFEST.json").read_text())["files"]
    for name, meta in files.items():
        data = (path / name).read_bytes()
        assert meta == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}, name


def test_the_shared_state_comes_back_as_saved(tmp_path):
    common = {"step": 9, "epoch": 1, "config": {"lr": 0.1, "sizes": [3, 4], "name": "x"},
              "model": {"fc.weight": torch.randn(3, 4), "bn.num_batches_tracked": torch.tensor(7)}}
    path = make(tmp_path).save(step=9, common=common, rank_state={})
    back = load_shared_state(path)
    assert back["step"] == 9 and back["epoch"] == 1 and back["config"] == common["config"]
    assert all(torch.equal(back["model"][k], v) for k, v in common["model"].items())


def test_optimizer_momentum_survives_the_round_trip(tmp_path):
    """DCP brings dict keys back as strings; under them the optimizer would drop its momentum."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = make(tmp_path).save(step=1, common={"optimizer": opt.state_dict()}, rank_state={})
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(optimizer_state(load_shared_state(path)["optimizer"]))
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_a_checkpoint_from_another_batch_size_is_refused_at_any_world_size():
    common = {"world_size": 2, "epoch": 1, "samples_done": 640,
              "config": {"batch_size": 64, "grad_accum_steps": 1}}
    check_resumable(common, path=Path("/c/step-1"), batch_size=64, grad_accum_steps=1)  # any world size
    for kwargs, needle in (({"batch_size": 32}, "this run has batchSize 32, gradAccumSteps 1"),
                           ({"grad_accum_steps": 2}, "this run has batchSize 64, gradAccumSteps 2")):
        args = {"batch_size": 64, "grad_accum_steps": 1, **kwargs}
        with pytest.raises(ConfigError) as info:
            check_resumable(common, path=Path("/c/step-1"), **args)
        assert "spec.trainer.checkpoint.dir: checkpoint /c/step-1 was written with batchSize 64, gradAccumSteps 1" \
            in str(info.value)
        assert needle in str(info.value)


@pytest.mark.parametrize("async_save", [False, True])
def test_keep_prunes_the_oldest(tmp_path, async_save):
    ck = make(tmp_path, keep=2, async_save=async_save)
    for s in (1, 2, 3, 4):
        save(ck, s)
    ck.wait()  # with async saving, pruning runs on the background thread
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]


@pytest.mark.parametrize("victim", ["rank-00000.pt", ".metadata", "INDEX.json", "shard"])
def test_a_damaged_complete_checkpoint_stops_the_run_naming_it_and_nothing_is_pruned(tmp_path, victim):
    ck = make(tmp_path, keep=2)
    save(ck, 1)
    newest = save(ck, 2)
    if victim == "shard":
        victim = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size).name
    data = bytearray((newest / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / victim).write_bytes(bytes(data))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointUnreadable) as info:
        ck.load_latest()
    assert isinstance(info.value, ConfigError)  # exit 78: a retry would meet the same files
    msg = str(info.value)
    assert "checkpoint.dir" in msg and str(newest) in msg and victim in msg and "corrupt" in msg
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_directory_without_a_manifest_neither_counts_towards_keep_nor_is_pruned(tmp_path):
    ck = make(tmp_path, keep=2)
    (tmp_path / "step-00000009").mkdir(parents=True)  # newer than every save below, no manifest
    for s in (1, 2, 3):
        save(ck, s)
    ck.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003", "step-00000009"]


def test_an_incomplete_write_is_skipped_with_a_warning_naming_it(tmp_path):
    log = Warnings()
    ck = make(tmp_path, log=log)
    save(ck, 1)
    torn = save(ck, 2)
    (torn / "MANIFEST.json").unlink()  # what a crash before publishing leaves (under its final name)
    loaded = ck.load_latest()
    assert loaded.common["step"] == 1 and loaded.path.name == "step-00000001"
    assert any(str(torn) in w and "incomplete" in w for w in log.lines)


def test_a_complete_checkpoint_whose_index_this_version_cannot_read_is_refused(tmp_path):
    ck = make(tmp_path)
    newest = save(ck, 1)
    index = json.loads((newest / "INDEX.json").read_text())
    index["format"] = "ddpjob.dev/checkpoint-index/99"
    _rewrite_with_manifest(newest, "INDEX.json", json.dumps(index).encode())
    with pytest.raises(CheckpointUnreadable, match="checkpoint-index/99"):
        ck.load_latest()


def test_the_index_alone_reads_a_checkpoint_whose_pickled_metadata_cannot_be_unpickled(tmp_path):
    # What a torch upgrade that moves one of DCP's pickled classes does to `.metadata`.
    ck = make(tmp_path)
    newest = save(ck, 3)
    _rewrite_with_manifest(newest, ".metadata", b"\x80\x04cno_such_module\nGone\n.")
    loaded = ck.load_latest()
    assert loaded.common["step"] == 3 and torch.equal(loaded.common["w"], torch.full((4,), 3.0))


def _rewrite_with_manifest(step_dir, name, data):
    """Replace a file and record it in the manifest: the checkpoint stays complete and verified."""
    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / "MANIFEST.json").read_text())
    manifest["files"][name] = {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    (step_dir / "MANIFEST.json").write_text(json.dumps(manifest))
    assert verify(step_dir) is None


def test_a_checkpoint_of_the_older_single_file_layout_is_refused_by_name(tmp_path):
    old = tmp_path / "step-00000005"
    old.mkdir()
    (old / "common.pt").write_bytes(b"weights")
    (old / "MANIFEST.json").write_text(json.dumps(
        {"step": 5, "files": {"common.pt": {"size": 7, "sha256": "0" * 64}}}))
    with pytest.raises(CheckpointUnreadable, match="step-00000005.*no DCP .metadata"):
        make(tmp_path).load_latest()


def test_nothing_to_resume_from(tmp_path):
    assert make(tmp_path / "empty").load_latest() is None


def test_async_save_writes_the_state_as_it_was_when_save_returned(tmp_path):
    ck = make(tmp_path, async_save=True)
    w = torch.zeros(1000)
    path = ck.save(step=5, common={"step": 5, "w": w}, rank_state={"rng": torch.get_rng_state()})
    w.add_(1.0)  # training goes on while the write runs
    ck.wait()
    assert verify(path) is None
    assert torch.equal(load_shared_state(path)["w"], torch.zeros(1000))
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_saves_time_is_recorded_before_its_manifest_can_be_seen(tmp_path, monkeypatch, async_save):
    """The stop vote shares the last save's time (preempt.plan): a SIGTERM sent once a checkpoint is
    complete on disk must find its time recorded, never race the writer for it (issue 52)."""
    import os
    ck = make(tmp_path, async_save=async_save)
    at_publish = []
    replace = os.replace

    def watched(src, dst):
        if Path(dst).name in (MANIFEST, "step-00000006"):  # the manifest written, the directory published
            at_publish.append(ck.last_seconds)
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", watched)
    save(ck, 6)
    ck.wait()
    assert len(at_publish) == 2 and all(s is not None and s > 0 for s in at_publish), at_publish
    assert ck.last_seconds == at_publish[0]


def test_the_write_probe_measures_the_directory_and_leaves_nothing(tmp_path):
    assert probe_write_bandwidth(tmp_path / "new") > 0
    assert list((tmp_path / "new").iterdir()) == []


def test_async_save_failure_is_raised_by_the_next_wait(tmp_path):
    ck = make(tmp_path, async_save=True)
    ck.save(step=1, common={"step": 1, "bad": lambda: None}, rank_state={})  # unpicklable
    with pytest.raises(RuntimeError, match="writing a checkpoint under .* failed"):
        ck.wait()
    assert not (tmp_path / "step-00000001").exists()  # never published: never loaded
    assert ck.load_latest() is None


def test_sync_save_failure_is_an_ordinary_error_naming_the_checkpoint_and_cause(tmp_path):
    """DCP raises a BaseException; the trainer's `except Exception` must see it to report why."""
    ck = make(tmp_path)
    with pytest.raises(RuntimeError, match=r"writing checkpoint .*\.tmp-step-00000002 failed: .*pickle"):
        ck.save(step=2, common={"step": 2, "w": torch.ones(3), "bad": lambda: None}, rank_state={})
    assert not (tmp_path / "step-00000002").exists() and ck.load_latest() is None


def test_async_save_stages_every_dtype_and_layout_before_returning(tmp_path):
    """The host copy takes dense CPU tensors as bytes, on two threads, and the rest through torch."""
    wide = torch.randn(6, 8)
    common = {"f32": torch.randn(300, 7), "bf16": torch.randn(50).to(torch.bfloat16), "zero_d": torch.tensor(3),
              "empty": torch.empty(0, 2), "strided": wide.t(), "flags": torch.tensor([True, False]),
              "rank_like": [torch.arange(5), torch.randn(2, 2).double()]}
    expected = {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) for k, v in common.items()}
    ck = make(tmp_path, async_save=True)
    rng = torch.get_rng_state()
    rng_saved = rng.clone()
    ck.save(step=4, common=common, rank_state={"rng": rng})
    for v in common.values():  # training changes everything in place once save returns
        for t in v if isinstance(v, list) else [v]:
            if t.numel():
                t.copy_(torch.zeros_like(t) if t.dtype != torch.bool else ~t)
    rng.zero_()  # the rank state too: its file is written in the background
    ck.wait()
    back = ck.load_latest()
    for k, v in expected.items():
        got = back.common[k]
        assert all(torch.equal(a, b) for a, b in zip(got, v)) if isinstance(v, list) else torch.equal(got, v), k
    assert torch.equal(back.rank_state["rng"], rng_saved)


def test_finding_and_loading_a_checkpoint_imports_no_dcp(tmp_path):
    """A worker restarted in place imports the trainer, finds the newest checkpoint and reads it
    (or its snapshot) without importing torch.distributed.checkpoint, whose import takes as long
    as torch's (checkpointing/storage.py): only a save, or an unindexed checkpoint, imports it."""
    import subprocess
    import sys

    save(make(tmp_path), 5)
    code = f"""
import sys, torch
import ddpjob_trainer.loop
from ddpjob_trainer.checkpointing.checkpoint import Checkpointer
from ddpjob_trainer.reporting import NullReporter
ck = Checkpointer({str(tmp_path)!r}, keep=3, rank=0, group=None, barrier=lambda: None,
                  broadcast=lambda v: v, log=NullReporter(), async_save=False)
loaded = ck.load_latest()
assert loaded is not None and torch.equal(loaded.common["w"], torch.full((4,), 5.0)), loaded
print(sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
