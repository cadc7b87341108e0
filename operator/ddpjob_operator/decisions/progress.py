"""Fold per-rank samples into `status.progress` (pure; the local runner's progress bar uses it too),
and settle it when no attempt is stepping: a finished job's progress tells where it ended, and no
ETA outlives the attempt whose pace it came from.

Field names (declared in the CRD; also listed in PROGRESS_FIELDS):
  epoch, step, totalSteps, percent, loss, samplesPerSecond, eta, etaSeconds,
  lastStepTime, evalAccuracy, evalLoss, ranksReporting, slowestRank
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Mapping

from ddpjob_operator.base.objmeta import format_time
from ddpjob_operator.decisions.samples import ABSURD, RankSample

PROGRESS_FIELDS = (
    "epoch", "step", "totalSteps", "percent", "loss", "samplesPerSecond",
    "eta", "etaSeconds", "lastStepTime", "evalAccuracy", "evalLoss", "ranksReporting", "slowestRank",
)
# status.progress.unavailable: why no progress can be read (e.g. every pod is on a simulated node).
UNAVAILABLE = "unavailable"
# The ETA is a forecast from the pace of the attempt that is stepping now: it is taken from the
# latest scrape alone (a scrape without one, as a new attempt's before it has a rate, blanks it)
# and it is dropped whenever no attempt steps (job_status: every phase but Running, and a Running
# job whose in-place restart or replaced pod has not stepped again).
ETA_FIELDS = ("eta", "etaSeconds")
# What holds only at the moment of one scrape, taken from the latest alone: a kept value would
# outlive its truth (slowestRank is absent while every rank is at the same step).
OF_THE_SCRAPE = (*ETA_FIELDS, "slowestRank")
# status.result field -> status.progress field that a succeeded job's progress takes from it: the
# final evaluation, and the final attempt's throughput over its whole run.
RESULT_TO_PROGRESS = {"evalAccuracy": "evalAccuracy", "evalLoss": "evalLoss",
                      "trainSamplesPerSecond": "samplesPerSecond"}

Prev = tuple[float, Mapping[int, RankSample]]
MAX_ETA_SECONDS = 10 * 365 * 86400  # ten years: past this no ETA is shown


def human_duration(seconds: float) -> str:
    """Seconds -> '1h02m', '4m10s', '35s' (short, for a kubectl column)."""
    s = int(round(max(0.0, seconds)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{sec}s"


def percent(step: int, total: int) -> float:
    """step of total in percent, one decimal, at most 100."""
    return round(min(100.0, 100.0 * step / total), 1)


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _rate_from_step_time(samples: Mapping[int, RankSample]) -> float | None:
    """Aggregate samples/s estimated from each rank's samples per second of stepping."""
    rates = [s.samples_total / s.step_seconds_sum for s in samples.values()
             if s.step_seconds_sum > 0 and s.samples_total > 0]
    return sum(rates) if rates else None


def laggard(samples: Mapping[int, RankSample]) -> tuple[int, int] | None:
    """(the rank furthest behind, lowest on ties; steps it is behind the furthest ahead), or None
    when no rank reported a step."""
    steps = {r: s.step for r, s in samples.items() if s.step is not None}
    if not steps:
        return None
    slowest = min(steps, key=lambda r: (steps[r], r))
    return slowest, max(steps.values()) - steps[slowest]


def compute_progress(samples: Mapping[int, RankSample], *, now: float,
                     prev: Prev | None = None) -> dict:
    """status.progress from one scrape of every rank; prev=(prev_now, prev_samples) gives rates.

    step is the minimum over ranks (the job is as far as its slowest rank); loss is the
    mean over ranks; samplesPerSecond is the aggregate over ranks; {} when nothing reported.
    """
    ranks = [s for s in samples.values() if s.step is not None]
    if not ranks:
        return {}
    out: dict = {"ranksReporting": len(ranks)}
    step = min(s.step for s in ranks)
    out["step"] = step
    lag = laggard(samples)
    if lag is not None and lag[1] > 0:  # none is named while every rank is at the same step
        out["slowestRank"] = lag[0]
    epochs = [s.epoch for s in ranks if s.epoch is not None]
    if epochs:
        out["epoch"] = min(epochs)
    totals = [s.total_steps for s in ranks if s.total_steps]
    total = max(totals) if totals else None
    if total:
        out["totalSteps"] = total
        out["percent"] = percent(step, total)
    for field, values in (("loss", [s.loss for s in ranks]), ("evalAccuracy", [s.eval_accuracy for s in ranks]),
                          ("evalLoss", [s.eval_loss for s in ranks])):
        if finite := [v for v in values if _finite(v)]:
            out[field] = round(statistics.fmean(finite), 6)
    stamps = [s.last_step_timestamp for s in ranks if _finite(s.last_step_timestamp) and s.last_step_timestamp > 0]
    if stamps:
        out["lastStepTime"] = format_time(max(stamps))

    rate = None
    seconds_per_step = None
    if prev is not None:
        prev_now, prev_samples = prev
        dt = now - prev_now
        common = [r for r in samples if r in prev_samples and samples[r].step is not None]
        if dt > 0 and common:
            d_samples = sum(samples[r].samples_total - prev_samples[r].samples_total for r in common)
            if d_samples >= 0:  # negative = a counter reset (restart): fall back below
                # Scale up when some ranks are missing from either scrape.
                rate = d_samples * len(ranks) / len(common) / dt
            prev_steps = [prev_samples[r].step for r in common if prev_samples[r].step is not None]
            if prev_steps:
                d_step = step - min(prev_steps)
                if d_step > 0:
                    seconds_per_step = dt / d_step
    if rate is None:
        rate = _rate_from_step_time(samples)
    if rate is not None:
        out["samplesPerSecond"] = round(rate, 2)
    if seconds_per_step is None:
        # One iteration = data wait + step; synchronous training runs at the slowest rank's pace.
        means = [(s.step_seconds_sum + s.data_wait_seconds_total) / s.step_seconds_count
                 for s in ranks if s.step_seconds_count > 0]
        seconds_per_step = max(means) if means else None
    if total and seconds_per_step is not None:
        remaining = max(0, total - step) * seconds_per_step
        # Inputs are bounded one by one, but their product is not: an ETA past MAX_ETA_SECONDS
        # means nothing to a user and would not fit the status' int64.
        if math.isfinite(remaining) and remaining <= MAX_ETA_SECONDS:
            out["etaSeconds"] = int(round(remaining))
            out["eta"] = human_duration(remaining)
    return out


def without_eta(progress: Mapping[str, Any]) -> dict[str, Any]:
    """progress with no ETA (ETA_FIELDS)."""
    return {k: v for k, v in progress.items() if k not in ETA_FIELDS}


def _lasting(progress: Mapping[str, Any]) -> dict[str, Any]:
    """progress without what held only at the moment of its scrape (OF_THE_SCRAPE)."""
    return {k: v for k, v in progress.items() if k not in OF_THE_SCRAPE}


def merge_scrape(kept: Mapping[str, Any], scraped: Mapping[str, Any]) -> dict[str, Any]:
    """status.progress after a scrape: the scrape's fields over the kept ones (a rank that restarted
    reports no loss or evaluation until it has one again: the last known stay), but those
    OF_THE_SCRAPE only from the scrape."""
    return {**_lasting(kept), **scraped}


def _at_step(progress: Mapping[str, Any], step: int, total: int | None) -> dict[str, Any]:
    """progress at `step` (of `total`, else of its own totalSteps), its percent to match."""
    out = {**progress, "step": step}
    total = total or out.get("totalSteps")
    if total:
        out["totalSteps"] = total
        out["percent"] = percent(step, total)
    return out


def succeeded(progress: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """The progress of a job that succeeded, from its status.result (the trainer's own numbers,
    written after the last scrape): the last step (100 % of totalSteps), the final evaluation's
    accuracy and loss, the final attempt's throughput; no ETA, and no rank behind (all ended).
    Without a result (a command that writes none) the last scraped step stays, for lack of a
    truer one, without an ETA. `loss` (training) stays the last scraped: the result has none."""
    out = _lasting(progress)
    if result.get("steps") is not None:
        out = _at_step(out, int(result["steps"]), result.get("totalSteps"))
        out.pop(UNAVAILABLE, None)  # the result tells what no scrape could
    out.update({field: result[key] for key, field in RESULT_TO_PROGRESS.items() if result.get(key) is not None})
    return out


def stopped(progress: Mapping[str, Any], failure_steps: Iterable[int]) -> dict[str, Any]:
    """The progress of a job that failed: where it stopped, the newest of the last scraped step and
    the steps its failed pods wrote in their termination messages (which outlive the last scrape);
    no ETA."""
    out = without_eta(progress)
    last = int(out.get("step", -1))
    newer = [s for s in failure_steps if last < s <= ABSURD]
    return _at_step(out, max(newer), None) if newer else out
