#!/usr/bin/env python3
"""CPU of reading one pod's metrics body in the operator's scrape (benchmark, not a test).

The body is a real trainer endpoint's: 8 ranks written by the real telemetry (one process per
local rank, as under torchrun) and served by the multiprocess collector (bench/metrics_overhead's
writer). Arms, interleaved block by block (CPU time of this process):
- `ours`: decisions/samples.parse_metrics, which reads only the samples the scraper uses;
- `prometheus_client`: prometheus_client's parser over the whole body (how parse_metrics read it
  before: every line, histogram buckets and all, became objects first).
Prints the medians, ours/prometheus_client with its 95 % interval, and what a 256-rank job's
scrapes (32 such pods, every 15 s) cost per minute; writes bench/results/scrape_parse_cost.json.

    .venv/bin/python bench/scrape_parse_cost.py [--blocks 10] [--reads 100]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "operator"))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ddpjob_operator.decisions.samples import parse_metrics  # noqa: E402
from metrics_overhead import RANK_WRITER, _env  # noqa: E402
from provenance import Provenance  # noqa: E402
from stats import ratio_interval, verdict  # noqa: E402

RESULTS = REPO / "bench" / "results" / "scrape_parse_cost.json"
LOCAL_RANKS = 8
PODS_256 = 256 // LOCAL_RANKS
SCRAPES_PER_MIN = 60 / 15  # the chart's default scrape interval


def body() -> str:
    with tempfile.TemporaryDirectory() as d:
        for r in range(LOCAL_RANKS):
            subprocess.run([sys.executable, "-c", RANK_WRITER, str(r)], env=_env(d), check=True)
        reg = CollectorRegistry()
        MultiProcessCollector(reg, path=d)
        return generate_latest(reg).decode()


def theirs(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--reads", type=int, default=100)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    prov = Provenance("api", "operator", "bench", out=args.out)
    text = body()
    assert len(parse_metrics(text)) == LOCAL_RANKS
    arms = {"ours": parse_metrics, "prometheus_client": theirs}
    per: dict[str, list[float]] = {k: [] for k in arms}
    for fn in arms.values():
        fn(text)
    for b in range(args.blocks):
        for name in (list(arms) if b % 2 == 0 else list(arms)[::-1]):
            t0 = time.process_time()
            for _ in range(args.reads):
                arms[name](text)
            per[name].append((time.process_time() - t0) / args.reads)
    ci = ratio_interval([o / t for o, t in zip(per["ours"], per["prometheus_client"])])
    res = {"benchmark": "scrape_parse_cost",
           "body": {"local_ranks": LOCAL_RANKS, "bytes": len(text), "lines": text.count("\n")},
           "blocks": args.blocks, "reads_per_block": args.reads,
           "ms_per_pod_body": {k: {"median": round(1e3 * statistics.median(v), 3), "min": round(1e3 * min(v), 3),
                                   "max": round(1e3 * max(v), 3)} for k, v in per.items()},
           "cpu_s_per_min_256_ranks": {k: round(statistics.median(v) * PODS_256 * SCRAPES_PER_MIN, 3)
                                       for k, v in per.items()},
           "ratio_ours_prometheus_client": {k: round(v, 3) if isinstance(v, float) else v for k, v in ci.items()},
           "verdict": verdict(ci, what="parse CPU, ours/prometheus_client", above_one="costlier", below_one="cheaper")}
    for k, v in res["ms_per_pod_body"].items():
        print(f"{k:18s} {v['median']:7.3f} ms per 8-rank body [{v['min']}-{v['max']}]; a 256-rank job's scrapes: "
              f"{res['cpu_s_per_min_256_ranks'][k]} CPU-s/min")
    print(res["verdict"])
    print(f"wrote {prov.write(res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
