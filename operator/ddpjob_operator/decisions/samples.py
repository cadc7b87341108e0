"""What the trainer pods report: their Prometheus exposition parsed into one `RankSample` per
rank (pure: the local runner and the CLI use it too), and the `MonitorReport` one scrape of a job
comes to. The HTTP fetch is `cluster/scrape.py`; the monitor there fills the report.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Iterable, Iterator

from ddpjob_api.contract import (CHECKPOINT_SECONDS, COMPUTE_SECONDS, DATA_WAIT_SECONDS, EPOCH, EVAL_ACCURACY,
                                    EVAL_LOSS, FIRST_STEP_TIMESTAMP, GOODPUT_SECONDS, GPU_MEMORY_ALLOCATED, GPU_MEMORY_MAX_ALLOCATED,
                                    LAST_STEP_TIMESTAMP, LOSS, METRIC_PREFIX, MLFLOW_RUN_INFO, RANK_GOODPUT_CATEGORIES,
                                    RESTART_COUNT,
                                    RESUMED_FROM_STEP, SAMPLES, STACK_CAPTURE, STACK_FRAMES_CHARS, STACK_TRIGGERS,
                                    STAGE, STAGE_START_TIMESTAMP, STAGES, STEP, STEP_SECONDS, STEP_STARTED,
                                    TOTAL_STEPS, WORKER_FAILURE)

# metric name (without prefix, as the parser reports the sample) -> RankSample attribute: the
# metric's own name (a counter's with _total, a histogram's with _sum and _count), but for times.
_GAUGES = {
    **{name: name for name in (STEP, EPOCH, TOTAL_STEPS, LOSS, STEP_STARTED, EVAL_ACCURACY, EVAL_LOSS,
                               CHECKPOINT_SECONDS, RESTART_COUNT, GPU_MEMORY_ALLOCATED, GPU_MEMORY_MAX_ALLOCATED,
                               RESUMED_FROM_STEP, SAMPLES + "_total", DATA_WAIT_SECONDS + "_total")},
    **{name + end: name + end for name in (STEP_SECONDS, COMPUTE_SECONDS) for end in ("_sum", "_count")},
    LAST_STEP_TIMESTAMP: "last_step_timestamp",
    STAGE_START_TIMESTAMP: "stage_started_at",
    FIRST_STEP_TIMESTAMP: "first_step_timestamp",
}
# `stage{stage=S} 1` names a rank's stage; a name not in STAGES is dropped, so a pod cannot put
# text of its choosing into a condition message.
# What a worker failure's series says (its value is the failure's time); the operator bounds and
# redacts each before any reaches status (decisions/inplace.py).
FAILURE_LABELS = ("restart", "exit_code", "signal", "error", "restarted", "step")
# What a stack capture's series says (its value is the capture's time): `waiting` must look like a
# Python function's name, `trigger` be one of STACK_TRIGGERS, `frames` is cut to its bound; at most
# STACK_CAPTURES_READ per rank are read (the newest), however many a pod exports.
CAPTURE_LABELS = ("restart", "trigger", "waiting", "frames")
_FUNCTION = re.compile(r"^[A-Za-z_][A-Za-z0-9_<>.]{0,63}$")
STACK_CAPTURES_READ = 16
# `mlflow_run_info{run_id, experiment_id} 1`: ids go into status and a URL, so only id-shaped ones
# (MLflow's are hex and digits) are kept.
_MLFLOW_ID = re.compile(r"^[0-9A-Za-z_-]{1,64}$")

# A pod controls its exposition, so every value is bounded before it can reach status: a value
# outside these ranges (or NaN/±Inf) is dropped as if the rank had not reported it. 1e12 steps or
# seconds is far beyond any real run yet keeps every derived number a plain finite JSON float.
ABSURD = 1e12
_BOUNDS: dict[str, tuple[float, float]] = {
    "loss": (-ABSURD, ABSURD),
    "eval_loss": (-ABSURD, ABSURD),
    "eval_accuracy": (0.0, 100.0),
    "gpu_memory_allocated_bytes": (0.0, 1e18),
    "gpu_memory_max_allocated_bytes": (0.0, 1e18),
}
_DEFAULT_BOUNDS = (0.0, ABSURD)

@dataclass(slots=True)  # one per rank per job, all kept: no __dict__ each (a third of the size)
class RankSample:
    """What one rank reported in one scrape (None = not reported yet)."""

    rank: int
    local_rank: int | None = None
    node_rank: int | None = None
    ddpjob: str | None = None
    namespace: str | None = None
    step: int | None = None
    epoch: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    samples_total: float = 0.0
    step_seconds_sum: float = 0.0
    step_seconds_count: float = 0.0
    compute_seconds_sum: float = 0.0     # device (GPU) forward time per step; 0 on CPU
    compute_seconds_count: float = 0.0
    data_wait_seconds_total: float = 0.0
    last_step_timestamp: float | None = None
    step_started: int | None = None
    eval_accuracy: float | None = None
    eval_loss: float | None = None
    checkpoint_seconds: float | None = None
    restart_count: int | None = None
    gpu_memory_allocated_bytes: float | None = None
    gpu_memory_max_allocated_bytes: float | None = None
    stage: str | None = None             # one of STAGES
    stage_started_at: float | None = None  # Unix time (the pod's clock) the stage began
    mlflow_run_id: str | None = None     # the job's MLflow run (rank 0 reports it)
    mlflow_experiment_id: str | None = None
    first_step_timestamp: float | None = None  # this worker process's first step (Unix time)
    resumed_from_step: int | None = None
    # The failures of this rank's workers the pod's agent saw (contract.WORKER_FAILURE): label
    # dicts (FAILURE_LABELS) with "time", the failure's Unix time.
    worker_failures: list[dict[str, str | float]] = field(default_factory=list)
    # Seconds of this rank's time by category (contract.GOODPUT_SECONDS; only its known categories).
    goodput: dict[str, float] = field(default_factory=dict)
    # The stack captures of this rank's workers its pod's agent made (contract.STACK_CAPTURE): label
    # dicts (CAPTURE_LABELS) with "time", newest last.
    stack_captures: list[dict[str, str | float]] = field(default_factory=list)
    pod: str | None = None       # filled in by the scraper, not the exposition
    node: str | None = None


# The attributes read as integers (the rest are floats), as RankSample declares them.
_INTS = {f.name for f in fields(RankSample) if str(f.type).startswith("int")}


def _int_or_none(v: str | None) -> int | None:
    try:
        return int(v) if v not in (None, "") else None
    except ValueError:
        return None


# The samples read (their names without METRIC_PREFIX); a pod's other series, a histogram's buckets
# (most of a trainer's lines) and HELP/TYPE comments are skipped before their labels are parsed.
_GOODPUT = GOODPUT_SECONDS + "_total"
_READ = frozenset(_GAUGES) | {STAGE, MLFLOW_RUN_INFO, WORKER_FAILURE, _GOODPUT, STACK_CAPTURE}
_ONLY_AT_ONE = frozenset({STAGE, MLFLOW_RUN_INFO})   # info-style series: only those at 1 say anything
# A sample line of the Prometheus text format: name{labels} value [timestamp]. A label value may
# hold any character, braces too, but no unescaped quote; the labels end at the line's last brace.
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_ESCAPE = re.compile(r"\\(.)")
_ESCAPED = {"n": "\n", "\\": "\\", '"': '"'}


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"unreadable labels: {text[:200]!r}")
        value = m.group(2)
        if "\\" in value:
            value = _ESCAPE.sub(lambda e: _ESCAPED.get(e.group(1), e.group(0)), value)
        out[m.group(1)] = value
        pos = m.end()
    return out


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name without METRIC_PREFIX, labels, value) of each trainer sample the scraper reads.
    Not prometheus_client's parser: that reads every line of every family into objects, about 7 ms
    per 8-rank pod, a 256-rank job's scrape 0.2 CPU-s; this reads only these lines' labels, and
    each distinct label set once (a rank's gauges all carry the same: the returned dicts are shared)."""
    seen: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if not line.startswith(METRIC_PREFIX):
            continue  # comments, blank lines, other metrics
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise ValueError(f"unreadable metrics line: {line[:200]!r}")
        short = m.group(1)[len(METRIC_PREFIX):]
        if short not in _READ:
            continue
        value = float(m.group(3))
        if short in _ONLY_AT_ONE and value != 1:
            continue  # a stage the rank is not in (6 of every rank's 7 stage lines)
        text_labels = m.group(2) or ""
        labels = seen.get(text_labels)
        if labels is None:
            labels = seen[text_labels] = _labels(text_labels)
        yield short, labels, value


def parse_metrics(text: str) -> dict[int, RankSample]:
    """Prometheus text exposition -> {global rank: RankSample}; non-trainer metrics are ignored."""
    out: dict[int, RankSample] = {}
    for short, labels, value in _samples(text):
        attr = _GAUGES.get(short)
        mlflow = (short == MLFLOW_RUN_INFO and value == 1
                  and all(_MLFLOW_ID.match(labels.get(k) or "") for k in ("run_id", "experiment_id")))
        failure = short == WORKER_FAILURE and _sane("time", value) is not None
        goodput = short == _GOODPUT and labels.get("category") in RANK_GOODPUT_CATEGORIES and _sane(short, value) is not None
        captured = short == STACK_CAPTURE and _sane("time", value) is not None and _capture_ok(labels)
        if (attr is None and not mlflow and not failure and not goodput and not captured
                and not (short == STAGE and value == 1 and labels.get("stage") in STAGES)):
            continue
        rank = _int_or_none(labels.get("rank"))
        if rank is None:
            continue
        rs = out.get(rank)
        if rs is None:
            rs = out[rank] = RankSample(
                rank=rank,
                local_rank=_int_or_none(labels.get("local_rank")),
                node_rank=_int_or_none(labels.get("node_rank")),
                ddpjob=labels.get("ddpjob") or None,
                namespace=labels.get("namespace") or None,
            )
        if goodput:
            rs.goodput[labels["category"]] = value
            continue
        if captured:
            rs.stack_captures.append({**{k: labels.get(k, "") for k in CAPTURE_LABELS}, "time": value})
            rs.stack_captures.sort(key=lambda c: c["time"])
            del rs.stack_captures[:-STACK_CAPTURES_READ]
            continue
        if failure:
            rs.worker_failures.append({**{k: labels.get(k, "") for k in FAILURE_LABELS}, "time": value})
            continue
        if mlflow:
            rs.mlflow_run_id, rs.mlflow_experiment_id = labels["run_id"], labels["experiment_id"]
            continue
        if attr is None:
            rs.stage = labels["stage"]
            continue
        sane = _sane(attr, value)
        if sane is None:
            continue  # keep the default: a hostile value must not displace "not reported"
        setattr(rs, attr, int(sane) if attr in _INTS else sane)
    return out


def _capture_ok(labels: dict[str, str]) -> bool:
    """A stack capture's labels are what an agent writes (the rest of a pod's text is dropped)."""
    waiting = labels.get("waiting", "")
    return (labels.get("trigger") in STACK_TRIGGERS and (not waiting or bool(_FUNCTION.match(waiting)))
            and len(labels.get("frames", "")) <= STACK_FRAMES_CHARS and labels.get("restart", "").isdigit())


def _sane(attr: str, raw: object) -> float | None:
    """The value when finite and within the attribute's plausible range, else None."""
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    lo, hi = _BOUNDS.get(attr, _DEFAULT_BOUNDS)
    if not math.isfinite(value) or not lo <= value <= hi:
        return None
    if attr in ("step_seconds_count", "compute_seconds_count") and 0 < value < 1:
        return None  # a count is whole; a tiny one would make the mean step time overflow
    return value


def merge(parts: Iterable[dict[int, RankSample]]) -> dict[int, RankSample]:
    """Union of several endpoints' samples (one per pod) keyed by global rank."""
    out: dict[int, RankSample] = {}
    for part in parts:
        out.update(part)
    return out


@dataclass
class MonitorReport:
    """What one observation of a job found (cluster/monitor.py's Monitor.observe)."""

    progress: dict | None      # status.progress; None = nothing scraped this time (keep the old one)
    conditions: list[dict]     # Straggler / Stalled, metav1.Condition style, merge by type
    events: list[tuple[str, str, str]]   # (Normal|Warning, reason, message) new since the last report
    stalled: bool              # the Stalled condition holds
    unreachable: bool = False  # running pods, none answered: the caller may scrape this job less often
    mlflow_run: tuple[str, str] | None = None  # (run id, experiment id) the ranks report (status.mlflow)
    # This scrape's samples by rank (their worker failures and first steps: decisions/inplace.py).
    ranks: dict[int, RankSample] = field(default_factory=dict)
    # Stalled for health.GROUP_RESTART_TIMEOUTS hang timeouts: no pod's agent restarted it in place,
    # so failurePolicy.restartOnHang restarts the group (decisions/lifecycle.py).
    hang_overdue: bool = False
    # (capture record, pod, node) of the stack captures the pods' endpoints served since the last
    # report (contract.STACKS_PATH): what the operator keeps in the job's ConfigMap (decisions/stacks.py).
    stacks: list[tuple[dict, str, str | None]] = field(default_factory=list)
