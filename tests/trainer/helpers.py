"""Run the real CLI and the real trainer as subprocesses, with deadlines."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DDPJOB = [sys.executable, "-m", "ddpjob_cli"]


def write_job(path: Path, *, name: str, trainer: dict, nodes: int = 2, nproc: int | str = 1,
              max_restarts: int = 0, **spec) -> Path:
    """A DDPJob YAML for the built-in trainer."""
    obj = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
           "spec": {"nodes": nodes, "nprocPerNode": nproc, "gpusPerNode": 0, "image": "trainer:test",
                    "trainer": trainer, "failurePolicy": {"maxRestarts": max_restarts}, **spec}}
    path.write_text(yaml.safe_dump(obj))
    return path


def run_local(job_file: Path, tmp: Path, *, env: dict | None = None, timeout: float = 300,
              extra: list[str] | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """`ddpjob run FILE --local` to completion; returns the process and the summary JSON."""
    summary = tmp / f"summary-{job_file.stem}.json"
    proc = subprocess.run(
        [*DDPJOB, "run", str(job_file), "--local", "--no-progress", "--summary-json", str(summary),
         "--workdir", str(tmp / "work"), *(extra or [])],
        env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    data = json.loads(summary.read_text()) if summary.exists() else {}
    return proc, data


def run_trainer(trainer: dict, *, env: dict | None = None, timeout: float = 180,
                result: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m ddpjob_trainer` as one process (no torchrun): same loop, world size 1."""
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    e.update({"DDPJOB_TRAINER_CONFIG": json.dumps(trainer), "DDPJOB_TELEMETRY": "0",
              "OMP_NUM_THREADS": "1", **(env or {})})
    if result:
        e["DDPJOB_RESULT_FILE"] = str(result)
    return subprocess.run([sys.executable, "-m", "ddpjob_trainer"], env=e, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def single_process_eval(ckpt_dir: Path, trainer: dict) -> tuple[float, float, int]:
    """Accuracy, mean loss and count of a checkpoint's weights over the whole validation set,
    evaluated here in one process in one batch (the reference a distributed eval must equal)."""
    import torch
    import torch.nn.functional as F

    from ddpjob_trainer.checkpointing.checkpoint import load_shared_state
    from ddpjob_trainer.config import parse_config
    from ddpjob_trainer.data import build_data
    from ddpjob_trainer.models import build_model

    data = build_data(parse_config(trainer))
    model = build_model(trainer.get("model", "convnet"), data.input_shape, data.num_classes)
    model.load_state_dict(load_shared_state(ckpt_dir)["model"])
    model.eval()
    x = torch.stack([data.val[i][0] for i in range(len(data.val))])
    y = torch.stack([data.val[i][1] for i in range(len(data.val))])
    with torch.no_grad():
        logits = model(x)
    loss = F.cross_entropy(logits, y, reduction="sum").double().item() / len(y)
    return (logits.argmax(1) == y).double().mean().item(), loss, len(y)
