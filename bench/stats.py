"""Shared statistics for the benchmarks: ratio of two arms with a 95 % interval, honest wording."""
from __future__ import annotations

import math
import statistics
import subprocess
from pathlib import Path

# Two-sided 97.5 % quantiles of Student's t for n - 1 degrees of freedom (n = 2..30).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
         18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 29: 2.045}


def _t975(df: int) -> float:
    if df in _T975:
        return _T975[df]
    return _T975[max(k for k in _T975 if k <= df)] if df < 30 else 1.96


def ratio_interval(ratios: list[float]) -> dict[str, float]:
    """Geometric-mean ratio of paired runs and its 95 % t-interval (computed on log ratios)."""
    if len(ratios) < 2:
        raise ValueError("need at least 2 pairs for an interval")
    logs = [math.log(r) for r in ratios]
    mean, sd = statistics.mean(logs), statistics.stdev(logs)
    half = _t975(len(logs) - 1) * sd / math.sqrt(len(logs))
    return {"ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half),
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
