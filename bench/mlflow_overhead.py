"""Cost of MLflow tracking to training (issue 29; benchmark, not a test).

Steps/s of the built-in convnet on digits-sized batches (CPU, one thread) with the trainer's MLflow
tracker on (a healthy local `mlflow server`: sqlite, loopback) vs off, the tracker fed exactly what
the loop gives it: params once, then at every log step (every 10 steps) the loop's metrics dict
(loss read to the host in both arms). Blocks of steps alternate on/off so that drift of this
shared machine hits both alike; the tracker's thread runs throughout, so whatever it costs lands
in the blocks that cause it or the ones right after. Goal: ratio of steps/s on/off >= 0.99,
stated with a 95 % interval over block pairs.

Writes bench/results/mlflow_overhead.json.
Usage: .venv/bin/python bench/mlflow_overhead.py [--blocks 10] [--steps 200]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))
from stats import git_head, ratio_interval, verdict  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "mlflow_overhead.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.nn.functional as F

    from ddpjob_trainer import tracking
    from ddpjob_trainer.models import build_model
    from tests.support.mlflow_server import MlflowServer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_model("convnet", (1, 8, 8), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))

    with tempfile.TemporaryDirectory() as root:
        server = MlflowServer(Path(root))
        try:
            server.wait_healthy()
            server.runs("warm-up")
            tracker = tracking.Tracker(tracking_uri=server.uri, experiment="bench", run_name="overhead",
                                       key=None, tags={"bench": "mlflow_overhead"}, warn=print,
                                       count_drop=lambda reason: None)
            assert tracker.ready.wait(60) and tracker.run_id, tracker.error
            tracker.params({"model": "convnet", "batch_size": 32, "checkpoint": {"dir": "/ckpt"}})
            step = 0

            def block(on: bool, n: int) -> float:
                nonlocal step
                t0 = time.perf_counter()
                for _ in range(n):
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    step += 1
                    if step % 10 == 0:
                        metrics = {"train_loss": loss.item(), "lr": 0.01, "step_seconds": 0.01,
                                   "data_wait_seconds": 0.0, "samples_per_second": 3200.0}
                        if on:
                            tracker.metrics(metrics, step=step)
                return n / (time.perf_counter() - t0)

            block(True, args.steps)
            block(False, args.steps)  # warm-up
            pairs = []
            for b in range(args.blocks):
                order = (True, False) if b % 2 == 0 else (False, True)
                rate = {on: block(on, args.steps) for on in order}
                pairs.append((rate[True], rate[False]))
            closed = tracker.close("FINISHED")
            lost = tracker.counts()
        finally:
            server.stop()
    ci = ratio_interval([on / off for on, off in pairs])
    result = {"what": "steps/s with the MLflow tracker on (healthy local server) / off", "git_head": git_head(),
              "machine": platform.node(), "cpus": os.cpu_count(), "blocks": args.blocks, "steps_per_block": args.steps,
              "steps_per_second_on": statistics.median(p[0] for p in pairs),
              "steps_per_second_off": statistics.median(p[1] for p in pairs),
              "ratio_on_off": ci, "run_ended": closed, "calls_lost": lost,
              "verdict": verdict(ci, what="steps/s MLflow on/off", above_one="faster with MLflow",
                                 below_one="slower with MLflow")}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(result["verdict"])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
