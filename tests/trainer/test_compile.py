"""spec.trainer.compile compiles the model for real, and its checkpoints stay those of the plain model."""
from __future__ import annotations

from ddpjob_trainer.checkpointing.checkpoint import load_shared_state

from .helpers import run_trainer


def test_compile_generates_kernels_and_checkpoints_keep_the_plain_models_keys(tmp_path):
    cache, ck = tmp_path / "inductor", tmp_path / "ck"
    r = run_trainer({"dataset": "digits", "model": "mlp", "epochs": 1, "maxSteps": 3, "batchSize": 32, "seed": 3,
                     "compile": True, "checkpoint": {"dir": str(ck), "everySteps": 3}},
                    env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # Inductor writes each kernel's source under its cache dir: none means nothing was compiled
    # (torch.compile around the DDP wrapper, as before, compiled nothing).
    assert list(cache.rglob("*.py")), f"inductor generated no code under {cache}"
    (newest,) = sorted(ck.glob("step-*"))[-1:]
    keys = load_shared_state(newest)["model"].keys()
    assert keys and not any("_orig_mod" in k for k in keys), sorted(keys)
