"""Every collective the trainer issues, under a group that takes only its device's tensors (as NCCL).

On HEAD before this test existed, the run below died at its very end: the throughput all-reduce
was made on a CPU tensor, which NCCL refuses, so every GPU job failed after its last checkpoint.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import REPO

pytestmark = pytest.mark.timeout(600)

HARNESS = Path(__file__).with_name("device_only_group.py")


def _run(trainer: dict, tmp: Path) -> tuple[dict, dict]:
    result = tmp / "result.json"
    proc = subprocess.run([sys.executable, str(HARNESS), json.dumps(trainer), str(result)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "DDPJOB_TELEMETRY": "0"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    return counts, json.loads(result.read_text())


def test_train_checkpoint_resume_and_eval_use_only_device_tensors(tmp_path):
    ck = {"dir": str(tmp_path / "ck"), "everySteps": 3, "keep": 2}
    base = {"dataset": "digits", "model": "convnet", "batchSize": 64, "logEverySteps": 2,
            "checkpoint": ck}
    # Epoch end (eval + checkpoint), a mid-epoch checkpoint, the final throughput all-reduce.
    counts, first = _run({**base, "epochs": 2, "maxSteps": 14}, tmp_path)
    assert first["steps"] == 14
    assert counts["barrier"] >= 4 and counts["broadcast"] >= 1 and counts["allreduce"] >= 14
    # A resumed run: the checkpoint choice is broadcast, the model loaded onto the device.
    counts, resumed = _run({**base, "epochs": 2, "maxSteps": 16}, tmp_path)
    assert resumed["resumed_from_step"] == 14 and resumed["steps"] == 16


@pytest.mark.parametrize("buffer_sync", ["average", "broadcast"])
def test_batchnorm_buffer_sync_uses_only_device_tensors(tmp_path, buffer_sync):
    counts, r = _run({"dataset": "synthetic", "model": "resnet18", "epochs": 1, "batchSize": 8,
                      "maxSteps": 2, "logEverySteps": 1, "ddp": {"bufferSync": buffer_sync},
                      "synthetic": {"trainSize": 32, "valSize": 8, "shape": [3, 16, 16]},
                      "checkpoint": {"dir": str(tmp_path / "ck")}}, tmp_path)
    assert r["steps"] == 2
    # resnet18 has 20 BatchNorm buffers; they are synced once (eval and checkpoint share it).
    assert counts["broadcast" if buffer_sync == "broadcast" else "allreduce"] >= 20
