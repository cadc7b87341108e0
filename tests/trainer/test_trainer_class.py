"""The built-in trainer as a class people extend: a subclass changes the loss without copying the
loop, `train_step` leaves the loss on the device (the host reads it only at log steps), and `fit`
resumes where manual steps left off. One real process with a real (single-rank gloo) group."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.trainer.helpers import REPO

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import torch.nn.functional as F
    from ddpjob_trainer.config import parse_config
    from ddpjob_trainer.dist import process_group
    from ddpjob_trainer.loop import Trainer
    from ddpjob_trainer.reporting import NullReporter
    from ddpjob_trainer.telemetry import Telemetry

    class Smoothed(Trainer):
        calls = 0

        def loss(self, logits, targets):
            Smoothed.calls += 1
            return F.cross_entropy(logits, targets, label_smoothing=0.1)

    cfg = parse_config(json.loads(sys.argv[1]))
    with process_group(timeout_seconds=60) as ctx:
        t = Smoothed(cfg, ctx, log=NullReporter(), telemetry=Telemetry.from_env(enabled=False))
        t.sampler.set_epoch(0, start=0)
        out = t.train_step(iter(t.loader))
        first = {"step": t.state.step, "samples_done": t.state.samples_done, "samples": out.samples,
                 "loss_is_tensor": isinstance(out.loss_sum, torch.Tensor), "calls": Smoothed.calls}
        result = t.fit()
    print(json.dumps({"first": first, "calls": Smoothed.calls, "steps": result.steps,
                      "total_steps": result.total_steps, "eval_samples": result.eval_samples}))
""")


def test_a_subclass_changes_the_loss_and_fit_continues_after_a_manual_step(tmp_path):
    trainer = {"epochs": 1, "batchSize": 64, "gradAccumSteps": 2, "seed": 3}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update({"OMP_NUM_THREADS": "1", "DDPJOB_TELEMETRY": "0"})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(trainer)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # One step = gradAccumSteps micro-batches, each through the subclass's loss.
    assert got["first"] == {"step": 1, "samples_done": 128, "samples": 128, "loss_is_tensor": True, "calls": 2}
    assert got["steps"] == got["total_steps"] > 1
    micro_batches = -(-1438 // 64)  # digits' 1438 training samples at 64 per batch, one epoch
    assert got["calls"] == micro_batches
    assert got["eval_samples"] == 359
