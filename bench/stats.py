"""Shared statistics for the benchmarks: ratio of two arms with a 95 % interval, honest wording."""
from __future__ import annotations

import math
import statistics
import subprocess
from pathlib import Path

from scipy import stats


def ratio_interval(ratios: list[float]) -> dict[str, float]:
    """Geometric-mean ratio of paired runs and its 95 % t-interval (computed on log ratios)."""
    if len(ratios) < 2:
        raise ValueError("need at least 2 pairs for an interval")
    logs = [math.log(r) for r in ratios]
    low, high = mean_interval(logs)
    return {"ratio": math.exp(statistics.mean(logs)), "low": math.exp(low), "high": math.exp(high),
            "pairs": len(ratios)}


def verdict(ci: dict[str, float], *, what: str, above_one: str = "faster", below_one: str = "slower") -> str:
    """'no difference detectable within ±x %' when the interval holds 1.0, else the direction."""
    lo, hi = ci["low"], ci["high"]
    span = f"{ci['ratio']:.3f} (95 % interval {lo:.3f}-{hi:.3f}, {ci['pairs']} pairs)"
    if lo <= 1.0 <= hi:
        x = 100 * max(1.0 - lo, hi - 1.0)
        return f"{what}: {span}: no difference detectable within ±{x:.1f} %"
    direction = above_one if lo > 1.0 else below_one
    return f"{what}: {span}: {direction} (interval excludes 1.0)"


def git_head() -> str | None:
    """The commit the benchmarked code comes from (results must come from HEAD)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def mean_interval(values: list[float]) -> tuple[float, float]:
    """The 95 % t-interval of the mean of `values` (at least 2)."""
    if len(values) < 2:
        raise ValueError("need at least 2 values for an interval")
    mean, sd = statistics.mean(values), statistics.stdev(values)
    half = float(stats.t.ppf(0.975, len(values) - 1)) * sd / math.sqrt(len(values))
    return mean - half, mean + half
