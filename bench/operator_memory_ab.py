#!/usr/bin/env python3
"""The operator's memory with and without a setting of its environment, in interleaved pairs.

Runs bench/operator_memory.py --pairs times as A (the operator as it is) then B (with each
--operator-env NAME=VALUE), writing each run's result into --runs DIR (a-1.json, b-1.json, ...),
and then the pairs' ratios B/A, with a 95 % interval, of the slope (KiB per pod) and of the RSS at
the largest step, into --out. With --combine-only the runs already in DIR are combined (what a run
interrupted before its table, or the runs' own commit, leaves). Each run records its commit; the
table is only as clean as they are. Not a test: nothing here asserts sizes.

    .venv/bin/python bench/operator_memory_ab.py --operator-env MALLOC_ARENA_MAX=2 --pairs 2 \\
        --steps 2000,10000 --runs bench/results/operator_memory_arena --out bench/results/operator_memory_arena.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from provenance import Provenance  # noqa: E402
from stats import ratio_interval  # noqa: E402


def figures(run: dict) -> dict[str, float]:
    """What one run says: its line's slope and intercept, its RSS at its largest step (MiB)."""
    return {"slope_kib_per_pod": run["fit"]["slope_kib_per_pod"], "intercept_mib": run["fit"]["intercept_mib"],
            "rss_largest_mib": round(run["steps"][-1]["rss_kib"] / 1024, 1), "pods_largest": run["steps"][-1]["pods"]}


def table(runs: Path) -> dict:
    """The pairs in `runs` (a-N.json with b-N.json), each arm's figures and the ratios B/A."""
    pairs = sorted(int(p.stem[2:]) for p in runs.glob("a-*.json") if (runs / f"b-{p.stem[2:]}.json").exists())
    if not pairs:
        raise SystemExit(f"{runs}: no a-N.json with its b-N.json")
    arms = {arm: [json.loads((runs / f"{arm}-{n}.json").read_text()) for n in pairs] for arm in ("a", "b")}
    out: dict = {"pairs": pairs, "operator_env_b": arms["b"][0].get("operator_env"),
                 "commits": sorted({r.get("provenance", {}).get("commit", "?")[:12] for rs in arms.values() for r in rs}),
                 "runs": {arm: [figures(r) for r in rs] for arm, rs in arms.items()}}
    for key in ("slope_kib_per_pod", "rss_largest_mib"):
        a = [f[key] for f in out["runs"]["a"]]
        b = [f[key] for f in out["runs"]["b"]]
        ratios = [y / x for x, y in zip(a, b)]
        out[key] = {"a_median": statistics.median(a), "b_median": statistics.median(b),
                    "ratios_b_over_a": [round(r, 3) for r in ratios],
                    **({"b_over_a": {k: round(v, 3) if isinstance(v, float) else v
                                     for k, v in ratio_interval(ratios).items()}} if len(ratios) > 1 else {})}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--operator-env", action="append", default=[], metavar="NAME=VALUE",
                    help="arm B's setting (bench/operator_memory.py --operator-env); repeatable")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", default="2000,10000")
    ap.add_argument("--runs", type=Path, required=True, help="where each run's result goes (a-N.json, b-N.json)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--combine-only", action="store_true", help="combine the runs already in --runs")
    args = ap.parse_args()
    if not args.combine_only:
        if not args.operator_env:
            ap.error("--operator-env: arm B needs a setting")
        args.runs.mkdir(parents=True, exist_ok=True)
        for n in range(1, args.pairs + 1):
            for arm, extra in (("a", []), ("b", [x for kv in args.operator_env for x in ("--operator-env", kv)])):
                subprocess.run([sys.executable, str(REPO / "bench/operator_memory.py"), "--steps", args.steps,
                                *extra, "--out", str(args.runs / f"{arm}-{n}.json")], check=True)
    prov = Provenance("bench", out=args.out)
    result = table(args.runs)
    prov.write(result)
    print(json.dumps({k: result[k] for k in ("slope_kib_per_pod", "rss_largest_mib")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
