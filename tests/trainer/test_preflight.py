"""The real launcher, as a pod's node 0 of a two-node job whose other node never comes: a feature
the environment cannot run ends it with exit 78 naming the field, in seconds, before any
rendezvous (which would wait for the missing node far longer than the deadline here)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 90  # the probe imports torch._inductor: seconds on a loaded 2-core machine


def launch_node0(trainer: dict, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    e.update({"DDPJOB_TRAINER_CONFIG": json.dumps(trainer), "DDPJOB_TELEMETRY": "0", "NODE_RANK": "0",
              "PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "1",
              "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "TMPDIR": str(tmp_path), **env})
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ddpjob_trainer.launch"], env=e, capture_output=True, text=True,
                          timeout=DEADLINE, cwd=tmp_path)
    return proc, time.monotonic() - t0


def test_mlflow_without_the_client_exits_78_naming_the_field_before_rendezvous(tmp_path):
    # The venv has the client (the trainer extra): an image without it is a PYTHONPATH whose `mlflow`
    # is not there, as Python says when it is missing.
    hidden = tmp_path / "no-mlflow" / "mlflow"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'mlflow\'", name="mlflow")\n')
    proc, took = launch_node0({"dataset": "digits", "maxSteps": 2, "mlflow": {"trackingUri": "file:///tmp/x"}},
                              tmp_path, PYTHONPATH=str(hidden.parent))
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "bad configuration: spec.trainer.mlflow: this image cannot run MLflow tracking" in proc.stderr, proc.stderr
    assert "No module named 'mlflow'" in proc.stderr and "torch.distributed.run" not in proc.stderr
    assert took < 30, f"took {took:.1f}s: the pre-flight should cost one small import"


def test_compile_without_a_compiler_on_path_exits_78_naming_the_field(tmp_path):
    # Only the interpreter's own directory: no g++, gcc or clang.
    proc, _ = launch_node0({"dataset": "digits", "maxSteps": 2, "compile": True}, tmp_path,
                           PATH=str(Path(sys.executable).parent))
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "bad configuration: spec.trainer.compile: this image cannot run torch.compile" in proc.stderr, proc.stderr
    assert "no C++ compiler for inductor (g++ is not on PATH" in proc.stderr
