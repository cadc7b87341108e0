"""Shared statistics for the benchmarks: ratio of two arms with a 95 % interval, honest wording."""
from __future__ import annotations

import math
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Callable, TypeVar

from scipy import stats


def ratio_interval(ratios: list[float]) -> dict[str, float]:
    """Geometric-mean ratio of paired runs and its 95 % t-interval (computed on log ratios)."""
    if len(ratios) < 2:
        raise ValueError("need at least 2 pairs for an interval")
    logs = [math.log(r) for r in ratios]
    mean = mean_interval(logs)
    return {"ratio": math.exp(mean["mean"]), "low": math.exp(mean["low"]), "high": math.exp(mean["high"]),
            "pairs": len(ratios)}


T = TypeVar("T")


def mean_interval(values: list[float]) -> dict[str, float]:
    """Arithmetic mean and its 95 % t-interval (for quantities that may be near 0, e.g. a cost share)."""
    if len(values) < 2:
        raise ValueError("need at least 2 values for an interval")
    mean, sd = statistics.mean(values), statistics.stdev(values)
    half = float(stats.t.ppf(0.975, len(values) - 1)) * sd / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(values)}


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def others_load(fn: Callable[[], T]) -> tuple[T, float]:
    """fn()'s result and how many cores the rest of the machine kept busy meanwhile, on average:
    the machine's busy CPU time less fn's children's (waited-for processes: fn must run its work
    as subprocesses and wait for them). On a shared machine this is what competed with the run."""
    busy0, ours0, t0 = _busy_cpu_seconds(), _children_cpu_seconds(), time.monotonic()
    out = fn()
    busy1, ours1, t1 = _busy_cpu_seconds(), _children_cpu_seconds(), time.monotonic()
    return out, max(0.0, (busy1 - busy0) - (ours1 - ours0)) / max(t1 - t0, 1e-9)


def _children_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def verdict(ci: dict[str, float], *, what: str, above_one: str = "faster", below_one: str = "slower") -> str:
    """'no difference detectable within ±x %' when the interval holds 1.0, else the direction."""
    lo, hi = ci["low"], ci["high"]
    span = f"{ci['ratio']:.3f} (95 % interval {lo:.3f}-{hi:.3f}, {ci['pairs']} pairs)"
    if lo <= 1.0 <= hi:
        x = 100 * max(1.0 - lo, hi - 1.0)
        return f"{what}: {span}: no difference detectable within ±{x:.1f} %"
    direction = above_one if lo > 1.0 else below_one
    return f"{what}: {span}: {direction} (interval excludes 1.0)"
