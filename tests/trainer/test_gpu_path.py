"""The GPU path fails fast and loudly, in real torchrun processes on this GPU-less machine: what a
pod without the GPUs its job asked for does, a checkpoint dir that the nodes do not share."""
from __future__ import annotations

import pytest

from .helpers import run_local, write_job

pytestmark = pytest.mark.timeout(600)


def test_a_gpu_job_on_a_pod_without_cuda_exits_78_before_any_rank_falls_back_to_gloo(tmp_path):
    # What is faked is only the count the job expects: gpusPerNode 2, on a machine with none.
    job = write_job(tmp_path / "gpu.yaml", name="gpu", nodes=1, nproc=2, gpusPerNode=2, max_restarts=2,
                    trainer={"dataset": "digits", "model": "convnet", "epochs": 1, "maxSteps": 2})
    proc, s = run_local(job, tmp_path, timeout=240)
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert s["phase"] == "Failed" and s["restarts"] == 0 and s["exit_code"] == 78
    log = (tmp_path / "work" / "logs" / "attempt-0" / "node-0.log").read_text()
    assert "spec.gpusPerNode is 2, so each of this pod's 2 local ranks needs a GPU, but it sees no CUDA" in log, log
