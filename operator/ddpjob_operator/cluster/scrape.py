"""Read a trainer pod's Prometheus endpoint into one `RankSample` per rank.

`parse_metrics` is pure (the local runner uses it too); `fetch_all` scrapes many
endpoints concurrently with a bound and a per-request timeout, so one slow pod never
holds up the others.
"""
from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass, field
from typing import Iterable

from ddpjob_trainer.contract import (CHECKPOINT_SECONDS, COMPUTE_SECONDS, DATA_WAIT_SECONDS, EPOCH, EVAL_ACCURACY,
                                    EVAL_LOSS, FIRST_STEP_TIMESTAMP, GPU_MEMORY_ALLOCATED, GPU_MEMORY_MAX_ALLOCATED,
                                    LAST_STEP_TIMESTAMP, LOSS, METRIC_PREFIX, MLFLOW_RUN_INFO, RESTART_COUNT,
                                    RESUMED_FROM_STEP, SAMPLES, STAGE, STAGE_START_TIMESTAMP, STAGES, STEP,
                                    STEP_SECONDS, STEP_STARTED, TOTAL_STEPS, WORKER_FAILURE)
from prometheus_client.parser import text_string_to_metric_families

PREFIX = METRIC_PREFIX

# metric name (without prefix, as the parser reports the sample) -> RankSample attribute
_GAUGES = {
    STEP: "step",
    EPOCH: "epoch",
    TOTAL_STEPS: "total_steps",
    LOSS: "loss",
    SAMPLES + "_total": "samples_total",
    DATA_WAIT_SECONDS + "_total": "data_wait_seconds_total",
    LAST_STEP_TIMESTAMP: "last_step_timestamp",
    STEP_STARTED: "step_started",
    EVAL_ACCURACY: "eval_accuracy",
    EVAL_LOSS: "eval_loss",
    CHECKPOINT_SECONDS: "checkpoint_seconds",
    RESTART_COUNT: "restart_count",
    STEP_SECONDS + "_sum": "step_seconds_sum",
    STEP_SECONDS + "_count": "step_seconds_count",
    COMPUTE_SECONDS + "_sum": "compute_seconds_sum",
    COMPUTE_SECONDS + "_count": "compute_seconds_count",
    GPU_MEMORY_ALLOCATED: "gpu_memory_allocated_bytes",
    GPU_MEMORY_MAX_ALLOCATED: "gpu_memory_max_allocated_bytes",
    STAGE_START_TIMESTAMP: "stage_started_at",
    FIRST_STEP_TIMESTAMP: "first_step_timestamp",
    RESUMED_FROM_STEP: "resumed_from_step",
}
# `stage{stage=S} 1` names a rank's stage; a name not in STAGES is dropped, so a pod cannot put
# text of its choosing into a condition message.
_INTS = {"step", "epoch", "total_steps", "restart_count", "step_started", "resumed_from_step"}
# What a worker failure's series says (its value is the failure's time); the operator bounds and
# redacts each before any reaches status (decisions/inplace.py).
FAILURE_LABELS = ("restart", "exit_code", "signal", "error", "restarted")
# `mlflow_run_info{run_id, experiment_id} 1`: ids go into status and a URL, so only id-shaped ones
# (MLflow's are hex and digits) are kept.
_MLFLOW_ID = re.compile(r"^[0-9A-Za-z_-]{1,64}$")

# A pod controls its exposition, so every value is bounded before it can reach status: a value
# outside these ranges (or NaN/±Inf) is dropped as if the rank had not reported it. 1e12 steps or
# seconds is far beyond any real run yet keeps every derived number a plain finite JSON float.
_ABSURD = 1e12
_BOUNDS: dict[str, tuple[float, float]] = {
    "loss": (-_ABSURD, _ABSURD),
    "eval_loss": (-_ABSURD, _ABSURD),
    "eval_accuracy": (0.0, 100.0),
    "gpu_memory_allocated_bytes": (0.0, 1e18),
    "gpu_memory_max_allocated_bytes": (0.0, 1e18),
}
_DEFAULT_BOUNDS = (0.0, _ABSURD)

# Default cap on one metrics body: a trainer's exposition is a few KiB per rank.
MAX_BODY_BYTES = 4 * 1024 * 1024
_CHUNK = 64 * 1024


class BodyTooLarge(Exception):
    """A metrics response grew past the cap; the scrape is abandoned before it is held in memory."""


@dataclass
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
    # dicts (restart, exit_code, signal, error, restarted) with "time", the failure's Unix time.
    worker_failures: list[dict[str, str | float]] = field(default_factory=list)
    pod: str | None = None       # filled in by the scraper, not the exposition
    node: str | None = None

    @property
    def mean_step_seconds(self) -> float | None:
        """Mean step wall time since the process started."""
        if self.step_seconds_count > 0:
            return self.step_seconds_sum / self.step_seconds_count
        return None


def _int_or_none(v: str | None) -> int | None:
    try:
        return int(v) if v not in (None, "") else None
    except ValueError:
        return None


def parse_metrics(text: str) -> dict[int, RankSample]:
    """Prometheus text exposition -> {global rank: RankSample}; non-trainer metrics are ignored."""
    out: dict[int, RankSample] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX):
            continue
        for s in family.samples:
            short = s.name[len(PREFIX):]
            attr = _GAUGES.get(short)
            mlflow = (short == MLFLOW_RUN_INFO and s.value == 1
                      and all(_MLFLOW_ID.match(s.labels.get(k) or "") for k in ("run_id", "experiment_id")))
            failure = short == WORKER_FAILURE and _sane("time", s.value) is not None
            if attr is None and not mlflow and not failure and not (short == STAGE and s.value == 1 and s.labels.get("stage") in STAGES):
                continue
            rank = _int_or_none(s.labels.get("rank"))
            if rank is None:
                continue
            rs = out.get(rank)
            if rs is None:
                rs = out[rank] = RankSample(
                    rank=rank,
                    local_rank=_int_or_none(s.labels.get("local_rank")),
                    node_rank=_int_or_none(s.labels.get("node_rank")),
                    ddpjob=s.labels.get("ddpjob") or None,
                    namespace=s.labels.get("namespace") or None,
                )
            if failure:
                rs.worker_failures.append({**{k: s.labels.get(k, "") for k in FAILURE_LABELS}, "time": s.value})
                continue
            if mlflow:
                rs.mlflow_run_id, rs.mlflow_experiment_id = s.labels["run_id"], s.labels["experiment_id"]
                continue
            if attr is None:
                rs.stage = s.labels["stage"]
                continue
            value = _sane(attr, s.value)
            if value is None:
                continue  # keep the default: a hostile value must not displace "not reported"
            setattr(rs, attr, int(value) if attr in _INTS else value)
    return out


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


def _parse_each(texts: list[str]) -> list[dict[int, RankSample] | Exception]:
    out: list[dict[int, RankSample] | Exception] = []
    for text in texts:
        try:
            out.append(parse_metrics(text))
        except Exception as exc:  # noqa: BLE001  (a broken exposition is that pod's problem)
            out.append(exc)
    return out


async def parse_all_async(texts: list[str]) -> list[dict[int, RankSample] | Exception]:
    """`parse_metrics` of every body, in one worker-thread call per pass (not one per pod): large
    (but allowed) bodies must not stall the loop. A body that does not parse gives its exception."""
    return await asyncio.to_thread(_parse_each, texts) if texts else []


def merge(parts: Iterable[dict[int, RankSample]]) -> dict[int, RankSample]:
    """Union of several endpoints' samples (one per pod) keyed by global rank."""
    out: dict[int, RankSample] = {}
    for part in parts:
        out.update(part)
    return out


@dataclass
class ScrapeResult:
    """One endpoint's outcome: text on success, error otherwise."""

    url: str
    text: str | None = None
    error: str | None = None
    oversized: bool = False  # the body passed the cap (a pod misbehaving, worth a warning)


async def _read_capped(resp: object, *, max_bytes: int) -> bytes:
    """The body, read in chunks and abandoned as soon as it passes `max_bytes`."""
    length = getattr(resp, "content_length", None)
    if length is not None and length > max_bytes:
        raise BodyTooLarge(f"Content-Length {length} over the {max_bytes}-byte cap")
    buf = bytearray()
    async for chunk in resp.content.iter_chunked(_CHUNK):  # type: ignore[attr-defined]
        buf += chunk
        if len(buf) > max_bytes:
            raise BodyTooLarge(f"body over the {max_bytes}-byte cap")
    return bytes(buf)


def session(*, concurrency: int, keepalive: float):
    """A long-lived aiohttp session for `fetch_all`: connections kept open `keepalive` seconds
    between scrapes (longer than the scrape interval, so each pod's connection is reused)."""
    import aiohttp  # comes with kopf; imported here so parse_metrics users need not have it

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(1, concurrency),
                                                                keepalive_timeout=keepalive))


async def fetch_all(urls: list[str], *, concurrency: int = 16, timeout: float = 5.0,
                    semaphore: asyncio.Semaphore | None = None, session=None,
                    max_bytes: int = MAX_BODY_BYTES) -> list[ScrapeResult]:
    """GET every URL concurrently (at most `concurrency` at once, or as `semaphore` allows across
    callers), each with its own deadline and a body of at most `max_bytes`; never raises. With
    `session` (see session()) its kept-alive connections are used; else a session for this call."""
    if max_bytes < 1:
        raise ValueError(f"fetch_all: max_bytes must be positive, got {max_bytes}")
    import aiohttp  # comes with kopf; imported here so parse_metrics users need not have it

    sem = semaphore or asyncio.Semaphore(max(1, concurrency))
    # The deadline covers connect + read of one request; time spent queued on the semaphore is not
    # counted against it, so a slow pod delays nobody but itself.
    per_request = aiohttp.ClientTimeout(total=timeout)

    async def one(session: "aiohttp.ClientSession", url: str) -> ScrapeResult:
        async with sem:
            try:
                async with session.get(url, timeout=per_request) as resp:
                    if resp.status != 200:
                        return ScrapeResult(url=url, error=f"HTTP {resp.status}")
                    body = await _read_capped(resp, max_bytes=max_bytes)
                    return ScrapeResult(url=url, text=body.decode(resp.charset or "utf-8",
                                                                  errors="replace"))
            except BodyTooLarge as exc:
                return ScrapeResult(url=url, error=f"BodyTooLarge: {exc}", oversized=True)
            except Exception as exc:  # noqa: BLE001  (any failure is one pod's problem, not the job's)
                return ScrapeResult(url=url, error=f"{type(exc).__name__}: {exc}".rstrip(": "))

    if not urls:
        return []
    if session is not None:
        return list(await asyncio.gather(*(one(session, u) for u in urls)))
    connector = aiohttp.TCPConnector(limit=max(1, concurrency), force_close=True)
    async with aiohttp.ClientSession(connector=connector) as own:
        return list(await asyncio.gather(*(one(own, u) for u in urls)))
