"""Exactness across ranks under real torchrun/gloo: BatchNorm eval, resume with workers, resume at
another world size."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ddpjob_trainer.checkpointing.checkpoint import load_shared_state
from ddpjob_trainer.checkpointing.snapshot import read_cost

from .helpers import run_local, run_trainer, single_process_eval, write_job

pytestmark = pytest.mark.timeout(600)

# A distributed eval and a single-process eval of the same weights differ only by float32
# summation order and batch grouping (well under 1e-6 relative). Without BatchNorm buffer sync
# each rank evaluates with its own running statistics: 5.5e-5 in this short run, 2.9e-3 in the
# issue's longer one.
EVAL_REL_TOL = 1e-6


def test_resnet18_distributed_eval_equals_a_single_process_eval_of_its_checkpoint(tmp_path):
    trainer = {"dataset": "synthetic", "model": "resnet18", "epochs": 1, "batchSize": 8, "lr": 0.05,
               "synthetic": {"trainSize": 96, "valSize": 37, "shape": [3, 16, 16], "numClasses": 4},
               "checkpoint": {"dir": "ck", "keep": 1}}  # relative: under the run's workdir
    job = write_job(tmp_path / "bn.yaml", name="bn", nodes=1, nproc=2, trainer=trainer)
    proc, s = run_local(job, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["world_size"] == 2 and s["eval_samples"] == 37
    (ckpt,) = (tmp_path / "work" / "ck").glob("step-*")
    acc, loss, _ = single_process_eval(ckpt, trainer)
    assert s["eval_loss"] == pytest.approx(loss, rel=EVAL_REL_TOL)
    assert s["eval_accuracy"] == acc


def _images(root: Path, n: int = 12) -> Path:
    from PIL import Image

    for c, (cls, color) in enumerate((("cats", (200, 30, 30)), ("dogs", (30, 30, 200)))):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            px = [tuple(min(255, v + 7 * ((i * 5 + j * 3 + c) % 11)) for v in color) for j in range(144)]
            img = Image.new("RGB", (12, 12))
            img.putdata(px)
            img.save(root / cls / f"{i}.png")
    return root


def test_resume_at_world_size_2_with_workers_and_augmentation_is_bit_exact(tmp_path):
    """Rank 1 dies mid-epoch; the workers restart in place from the last checkpoint and end bit-identical."""
    root = _images(tmp_path / "images")
    trainer = {"dataset": "imagefolder", "dataPath": str(root), "model": "convnet", "imageSize": 8,
               "epochs": 3, "batchSize": 4, "lr": 0.05, "seed": 5, "numWorkers": 1}
    # 22 train images / 2 ranks / 4 per batch = 3 steps per epoch, 9 steps in all.
    straight = write_job(tmp_path / "a.yaml", name="straight", nodes=1, nproc=2,
                         trainer={**trainer, "checkpoint": {"dir": "ck-a", "everySteps": 2}})
    pa, a = run_local(straight, tmp_path)
    assert pa.returncode == 0, pa.stderr[-3000:]
    # Disk checkpoints only at epoch ends (steps 3, 6, 9), in-memory snapshots every 2 steps: the
    # workers restarted in place resume from the snapshot of step 4, newer than the disk's step 3.
    # (Each step sleeps, so the snapshot of step 4 is written before rank 1 dies at step 5.)
    crashy = write_job(tmp_path / "b.yaml", name="crashy", nodes=1, nproc=2, max_restarts=1,
                       trainer={**trainer, "checkpoint": {"dir": "ck-b", "snapshotEverySteps": 2}})
    pb, b = run_local(crashy, tmp_path, env={"DDPJOB_DEBUG_CRASH_RANK": "1:5", "DDPJOB_DEBUG_STEP_SLEEP": "0.2"})
    assert pb.returncode == 0, pb.stderr[-3000:]
    assert b["restarts"] == 0 and b["resumed_from_step"] == 4  # mid-epoch 1, workers restarted in place
    # Rank 0 logs it, on whichever node c10d gave rank 0. The disk checkpoint of step 3 is written in
    # the background, and a loaded machine may not have finished it when rank 1 dies at step 5 (the
    # crash waits for nothing; rehearsal 26): then there is none, never a newer one.
    # test_trainer_checkpoint_manager's resume test holds the choice between the two.
    log = "".join(p.read_text() for p in sorted((tmp_path / "work" / "logs" / "attempt-0").glob("node-*.log")))
    assert "resumed from the in-memory snapshot" in log, log[-3000:]
    assert re.search(r"resumed from the in-memory snapshot \S+ at step 4 .*; newest disk checkpoint: step (3|none)\b",
                     log), log[-3000:]
    # The resumed run's one snapshot (step 8; steps 6 and 9 end epochs), what it cost reported at the end.
    cost = read_cost(log)
    assert cost is not None and cost.taken == 1 and cost.paused > 0, log[-3000:]
    assert a["steps"] == b["steps"] == 9
    assert b["eval_loss"] == a["eval_loss"] and b["eval_accuracy"] == a["eval_accuracy"]
    wa = load_shared_state(tmp_path / "work" / "ck-a" / "step-00000009")["model"]
    wb = load_shared_state(tmp_path / "work" / "ck-b" / "step-00000009")["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # Sharded: the state is replicated, and DCP gave each rank its share of it to write.
    writers = {p.name.split("_")[2] for p in (tmp_path / "work" / "ck-a" / "step-00000009").glob("__*.distcp")
               if p.stat().st_size}
    assert writers == {"0", "1"}


def _samples_seen(log_dir: Path, epoch: int) -> list[int]:
    """Every sample index the ranks trained on in `epoch` (DDPJOB_DEBUG_SAMPLE_LOG's records)."""
    lines = [line.split() for p in sorted(log_dir.glob("rank-*.log")) for line in p.read_text().splitlines()]
    return [int(i) for step, e, *indices in lines if int(e) == epoch for i in indices]


def test_resume_grows_and_shrinks_the_world_size_mid_epoch_seeing_every_sample_once(tmp_path):
    """An epoch trained at world size 1, then 2 (grown: rank 1 has no state of its own in the
    checkpoint), then 1 again (shrunk), each resuming the last one's checkpoint mid-epoch: every
    sample of the epoch trained on exactly once, the learning rate following the world size, and
    the run ends. A changed batchSize stays refused (exit 78)."""
    ck, seen = tmp_path / "work" / "ck", tmp_path / "seen"
    seen.mkdir()
    env = {"DDPJOB_DEBUG_SAMPLE_LOG": str(seen), "DDPJOB_SNAPSHOT_DIR": str(tmp_path / "shm")}
    # digits: 1438 training samples; 32 per rank per step.
    base = {"dataset": "digits", "model": "mlp", "epochs": 1, "batchSize": 32, "lr": 0.05,
            "checkpoint": {"dir": str(ck), "everySteps": 2}}
    first = run_trainer({**base, "maxSteps": 4}, env=env)  # world size 1: samples 0-127 of the order
    assert first.returncode == 0, first.stderr[-2000:]
    # The local runner puts the relative checkpoint dir under its workdir: the same directory.
    job = write_job(tmp_path / "grown.yaml", name="grown", nodes=1, nproc=2,
                    trainer={**base, "maxSteps": 10, "checkpoint": {"dir": "ck", "everySteps": 2}})
    proc, s = run_local(job, tmp_path, env=env, timeout=300)
    assert proc.returncode == 0 and s["phase"] == "Succeeded", proc.stderr[-3000:]
    assert (s["world_size"], s["resumed_from_step"], s["steps"]) == (2, 4, 10)
    log = "".join(p.read_text() for p in sorted((tmp_path / "work" / "logs" / "attempt-0").glob("node-*.log")))
    # Linear scaling: the global batch doubled, so did the learning rate.
    assert "resized from world size 1 to 2: the 1310 samples left of epoch 0 re-split over the new ranks, " \
           "global batch 32 -> 64, lr 0.1 (lrScaling linear, first world size 1)" in log, log[-3000:]
    result = tmp_path / "result.json"
    last = run_trainer(base, env=env, result=result)  # world size 1 again, to the end
    assert last.returncode == 0, last.stderr[-2000:]
    assert "resized from world size 2 to 1: the 926 samples left of epoch 0 re-split over the new ranks, " \
           "global batch 64 -> 32, lr 0.05" in last.stdout, last.stdout[-2000:]
    done = json.loads(result.read_text())
    # 4 + 6 steps, then 926 samples at 32 a step.
    assert (done["resumed_from_step"], done["steps"], done["epochs_completed"]) == (10, 39, 1)
    assert sorted(_samples_seen(seen, epoch=0)) == list(range(1438))

    other_batch = run_trainer({**base, "batchSize": 16})
    assert other_batch.returncode == 78, other_batch.stderr[-2000:]
    assert "was written with batchSize 32, gradAccumSteps 1; this run has batchSize 16" in other_batch.stderr
