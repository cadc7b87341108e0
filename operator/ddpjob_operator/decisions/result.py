"""The training's own result, as node 0's launcher reported it in its termination message.

A job's final numbers (eval accuracy over the whole validation set, steps, the step it resumed
from) exist only in the last seconds of the run, after the last metrics scrape. The in-pod
launcher writes rank 0's result file as node 0's termination message (JSON, a few hundred bytes;
the kubelet keeps up to 4 KiB); the operator copies the known, finite fields into `status.result`.
"""
from __future__ import annotations

import json
import math
from typing import Any

from ddpjob_operator.api import podinfo
from ddpjob_operator.api.group import Attempt

# Trainer result key (ddpjob_trainer.contract.RunResult) -> status.result field (CRD schema).
RESULT_FIELDS = {
    "steps": "steps",
    "total_steps": "totalSteps",
    "epochs_completed": "epochsCompleted",
    "world_size": "worldSize",
    "resumed_from_step": "resumedFromStep",
    "train_samples_per_second": "trainSamplesPerSecond",
    "eval_accuracy": "evalAccuracy",
    "eval_loss": "evalLoss",
    "eval_samples": "evalSamples",
    "eval_dataset_size": "evalDatasetSize",
}
_INTEGER = {"steps", "totalSteps", "epochsCompleted", "worldSize", "resumedFromStep", "evalSamples",
            "evalDatasetSize"}


def parse_result(message: str | None) -> dict[str, Any]:
    """status.result from a termination message; {} for anything that is not a result (a plain
    failure message, truncated JSON, a user script's own text)."""
    try:
        raw = json.loads(message or "")
    except ValueError:
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, Any] = {}
    for key, field in RESULT_FIELDS.items():
        v = raw.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            continue
        out[field] = int(v) if field in _INTEGER else round(float(v), 6)
    return out


def run_result(attempt: Attempt) -> dict[str, Any]:
    """The result that this attempt's rank 0 reported on success ({} when there is none yet): pod 0's,
    else another pod's. torchrun's c10d rendezvous numbers the nodes itself (by host name), so
    rank 0 may run in another pod than <job>-0 (docs/restarts.md)."""
    for pod in sorted(attempt.pods, key=podinfo.rank):
        if podinfo.phase(pod) != "Succeeded":
            continue
        state = podinfo.trainer_state(pod) or {}
        result = parse_result(state.get("message")) if state.get("exitCode") == 0 else {}
        if result:
            return result
    return {}
