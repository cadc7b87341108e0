"""Checkpoint and resume semantics, with the real trainer as one process (same code path, faster)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from .helpers import run_trainer

pytestmark = pytest.mark.timeout(300)

BASE = {"dataset": "digits", "model": "convnet", "epochs": 2, "batchSize": 64, "lr": 0.05, "seed": 3}
# 1438 train samples / 64 = 23 steps per epoch with one process.


def _steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*"))


def test_crash_and_resume_continues_the_same_sample_order(tmp_path):
    """A run killed mid-epoch and resumed ends with exactly the weights of an uninterrupted run."""
    straight = tmp_path / "straight.json"
    r = run_trainer({**BASE, "checkpoint": {"dir": str(tmp_path / "a"), "everySteps": 5}}, result=straight)
    assert r.returncode == 0, r.stderr[-2000:]

    ck = {"dir": str(tmp_path / "b"), "everySteps": 5}
    crash = run_trainer({**BASE, "checkpoint": ck}, env={"DDPJOB_DEBUG_CRASH_RANK": "0:33"})
    assert crash.returncode != 0
    # Mid-epoch 1: the last checkpoint before the crash is step 30, unless the crash cut its
    # background write short; then only step 25 is complete (a partial one is never loaded).
    newest = _steps(tmp_path / "b")[-1]
    assert newest in (25, 30)
    resumed = tmp_path / "resumed.json"
    r2 = run_trainer({**BASE, "checkpoint": ck}, env={"DDPJOB_ATTEMPT": "1"}, result=resumed)
    assert r2.returncode == 0, r2.stderr[-2000:]
    a, b = json.loads(straight.read_text()), json.loads(resumed.read_text())
    assert b["resumed_from_step"] == newest
    assert b["steps"] == a["steps"] == 46
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-9, abs=1e-12)
    assert b["eval_accuracy"] == a["eval_accuracy"]


def test_a_corrupt_complete_checkpoint_stops_the_job_and_an_incomplete_one_is_skipped(tmp_path):
    ck = {"dir": str(tmp_path / "ck"), "everySteps": 10, "keep": 2}
    r = run_trainer({**BASE, "epochs": 1, "checkpoint": ck})
    assert r.returncode == 0, r.stderr[-2000:]
    assert _steps(tmp_path / "ck") == [20, 23]
    # A half-written checkpoint from a crash: a temp dir and a dir without a manifest. Skipped.
    (tmp_path / "ck" / ".tmp-step-00000024").mkdir()
    (tmp_path / "ck" / "step-00000030").mkdir()
    result = tmp_path / "r.json"
    r2 = run_trainer({**BASE, "epochs": 1, "checkpoint": ck}, result=result)
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert json.loads(result.read_text())["resumed_from_step"] == 23
    assert "step-00000030: no MANIFEST.json" in r2.stderr
    # A complete checkpoint whose shard no longer matches its checksum: the job stops (exit 78,
    # not retried) naming it, and neither it nor the older one is pruned by a fresh start.
    newest = max((tmp_path / "ck" / "step-00000023").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    r3 = run_trainer({**BASE, "checkpoint": ck})
    assert r3.returncode == 78, r3.stderr[-2000:]
    assert "step-00000023 is complete but cannot be read" in r3.stderr and newest.name in r3.stderr
    assert "corrupt" in r3.stderr
    assert _steps(tmp_path / "ck") == [20, 23, 30]  # 30: no manifest, left alone


@pytest.mark.parametrize("async_save", [True, False])
def test_only_the_newest_k_checkpoints_are_kept(tmp_path, async_save):
    ck = {"dir": str(tmp_path / "ck"), "everySteps": 4, "keep": 2, "asyncSave": async_save}
    r = run_trainer({**BASE, "epochs": 1, "checkpoint": ck})
    assert r.returncode == 0, r.stderr[-2000:]
    assert _steps(tmp_path / "ck") == [20, 23]
    assert not list((tmp_path / "ck").glob(".tmp-*"))


def test_imagefolder_trains_and_an_empty_folder_names_the_path(tmp_path):
    from PIL import Image

    root = tmp_path / "images"
    for cls, color in (("cats", (200, 30, 30)), ("dogs", (30, 30, 200))):
        (root / cls).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (20, 20), tuple(min(255, c + 5 * i) for c in color)).save(root / cls / f"{i}.png")
    ok = run_trainer({"dataset": "imagefolder", "dataPath": str(root), "model": "convnet",
                      "imageSize": 16, "epochs": 1, "batchSize": 4})
    assert ok.returncode == 0, ok.stderr[-2000:]
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = run_trainer({"dataset": "imagefolder", "dataPath": str(empty), "model": "convnet", "epochs": 1})
    assert bad.returncode == 78
    assert f"spec.trainer.dataPath: {empty}" in bad.stderr
