"""The training's own result, as node 0's launcher reported it in its termination message.

A job's final numbers (eval accuracy over the whole validation set, steps, the step it resumed
from) exist only in the last seconds of the run, after the last metrics scrape. The in-pod
launcher writes rank 0's result file as node 0's termination message (JSON, a few hundred bytes;
the kubelet keeps up to 4 KiB); the operator copies the known, finite fields into `status.result`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from ddpjob_api.contract import RunResult
from ddpjob_operator.base import podinfo
from ddpjob_operator.base.group import Attempt

# The numbers of the trainer's result (the contract's RunResult: its fields and their types) are
# status.result's fields, camelCase (the CRD's; tests/unit/test_contract.py holds the two equal).
_TYPES = {f.name: str(f.type).split(" |")[0] for f in dataclasses.fields(RunResult)}
RESULT_FIELDS = {key: key.split("_")[0] + "".join(w.capitalize() for w in key.split("_")[1:])
                 for key, kind in _TYPES.items() if kind in ("int", "float")}
_INTEGER = {RESULT_FIELDS[key] for key, kind in _TYPES.items() if kind == "int"}


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
