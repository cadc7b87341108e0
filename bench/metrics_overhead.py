"""Cost of the trainer's Prometheus telemetry (benchmark, not a test).

1. Step time of the built-in convnet on digits-sized batches (CPU) with telemetry on vs off
   (DDPJOB_TELEMETRY=0 turns it off), steps alternating on/off so machine drift hits both alike.
   Telemetry is charged everything it causes in the loop: step_started() and step() per step;
   the loss is read to the host only at log steps in both arms (the loop's log line needs it
   either way). Goal: < 1 % difference, stated with a 95 % interval over blocks. Also the cost
   of one `Telemetry.step()` + `step_started()` pair on its own.
2. Exposition of one pod endpoint covering 8 local ranks (8 processes' multiprocess files):
   time of an HTTP GET of serve_node_endpoint's /metrics and of the collector alone.

Prints ratios; writes bench/results/metrics_overhead.json.
Usage: .venv/bin/python bench/metrics_overhead.py [--blocks 10] [--steps 50]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import Provenance
from stats import ratio_interval, verdict

RESULTS = Path(__file__).resolve().parent / "results" / "metrics_overhead.json"

STEP_BENCH = textwrap.dedent("""
    import json, os, statistics, sys, time, timeit
    import torch, torch.nn.functional as F
    from ddpjob_trainer.models import build_model
    from ddpjob_trainer.telemetry import Telemetry
    blocks, steps = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0); torch.set_num_threads(1)
    model = build_model("convnet", (1, 8, 8), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    on = Telemetry.from_env(enabled=True)
    off = Telemetry.from_env(enabled=False)
    def one_step(t, i):
        # As the built-in loop does: step_started() before the batch, step() after it; the loss
        # is read to the host only at log steps (every 10 here), in both arms alike, since the
        # loop reads it for its log line whether telemetry is on or not.
        t.step_started(step=i + 1)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        read = loss.item() if i % 10 == 0 else None
        t.step(step=i + 1, epoch=0, loss=read, samples=32, step_seconds=0.01,
               data_wait_seconds=0.0, timestamp=time.time())
    def run(t, n):
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            one_step(t, i)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    run(on, steps); run(off, steps)                      # warm-up
    pairs = []
    for b in range(blocks):
        # Alternate every step (on, off, on, ...), so drift of this shared machine hits both alike.
        ton, toff = [], []
        for i in range(2 * steps):
            t = on if (i + b) % 2 == 0 else off
            t0 = time.perf_counter()
            one_step(t, i)
            (ton if t is on else toff).append(time.perf_counter() - t0)
        pairs.append((statistics.median(ton), statistics.median(toff)))
    n = 20000
    def calls(t):
        t.step_started(step=2)
        t.step(step=1, epoch=0, loss=None, samples=32, step_seconds=0.01, data_wait_seconds=0.0, timestamp=1.0)
    call = timeit.timeit(lambda: calls(on), number=n) / n
    call_off = timeit.timeit(lambda: calls(off), number=n) / n
    print(json.dumps({"pairs": pairs, "call_seconds": call, "call_seconds_disabled": call_off}))
""")

RANK_WRITER = textwrap.dedent("""
    import os, sys
    from ddpjob_trainer.telemetry import Telemetry
    r = int(sys.argv[1])
    t = Telemetry(labels={"ddpjob": "bench", "namespace": "default", "rank": str(r), "local_rank": str(r),
                          "node_rank": "0"})
    t.set_total_steps(1000); t.set_restart_count(0); t.step_started(step=101)
    for i in range(1, 101):
        t.step(step=i, epoch=0, loss=0.5, samples=32, step_seconds=0.01 * (1 + i % 7),
               data_wait_seconds=0.001, timestamp=1e9 + i)
    t.eval(accuracy=0.9, loss=0.3); t.checkpoint(1.0)
""")

EXPOSE_BENCH = textwrap.dedent("""
    import json, socket, statistics, sys, time, urllib.request
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from ddpjob_trainer.telemetry import serve_node_endpoint
    d, n = sys.argv[1], int(sys.argv[2])
    reg = CollectorRegistry(); MultiProcessCollector(reg, path=d)
    coll = []
    for _ in range(n):
        t0 = time.perf_counter(); body = generate_latest(reg); coll.append(time.perf_counter() - t0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    server = serve_node_endpoint(port, d, addr="127.0.0.1")
    http = []
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read()
        http.append(time.perf_counter() - t0)
    server.shutdown()
    print(json.dumps({"collect_seconds": statistics.median(coll), "http_seconds": statistics.median(http),
                      "bytes": len(text), "series": sum(1 for l in text.decode().splitlines()
                                                         if l and not l.startswith("#"))}))
""")


def _env(metrics_dir: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "DDPJOB_METRICS_DIR")}
    if metrics_dir:
        env["DDPJOB_METRICS_DIR"] = metrics_dir
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def bench_steps(blocks: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-c", STEP_BENCH, str(blocks), str(steps)], env=_env(d),
                             check=True, capture_output=True, text=True)
    r = json.loads(out.stdout)
    ratios = [on / off for on, off in r["pairs"]]
    on = statistics.median(p[0] for p in r["pairs"])
    off = statistics.median(p[1] for p in r["pairs"])
    return {"blocks": blocks, "steps_per_block": steps, "step_seconds_on": on, "step_seconds_off": off,
            "ratio_on_off_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_on_off": ratio_interval(ratios),
            "verdict": verdict(ratio_interval(ratios), what="step time telemetry on/off",
                       above_one="telemetry slower", below_one="telemetry faster"),
            "telemetry_call_seconds": r["call_seconds"],
            "telemetry_call_seconds_disabled": r["call_seconds_disabled"],
            "call_share_of_step": r["call_seconds"] / off}


def bench_exposition(ranks: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        for r in range(ranks):  # one process per local rank, as under torchrun
            subprocess.run([sys.executable, "-c", RANK_WRITER, str(r)], env=_env(d), check=True)
        out = subprocess.run([sys.executable, "-c", EXPOSE_BENCH, d, str(repeats)], env=_env(None),
                             check=True, capture_output=True, text=True)
    return {"local_ranks": ranks, "repeats": repeats, **json.loads(out.stdout)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    prov = Provenance("api", "trainer", "bench", out=args.out)
    steps = bench_steps(args.blocks, args.steps)
    expo = bench_exposition(args.ranks, args.repeats)
    print(f"step time  telemetry on {steps['step_seconds_on'] * 1e3:.3f} ms  off {steps['step_seconds_off'] * 1e3:.3f} ms"
          f"  ratio on/off {steps['ratio_on_off_median']:.4f} (blocks {steps['ratio_min']:.3f}..{steps['ratio_max']:.3f};"
          f" goal < 1.01)")
    print(steps["verdict"])
    print(f"one Telemetry.step_started() + step() pair {steps['telemetry_call_seconds'] * 1e6:.1f} us"
          f" = {100 * steps['call_share_of_step']:.3f} % of a step (disabled: "
          f"{steps['telemetry_call_seconds_disabled'] * 1e6:.2f} us)")
    print(f"endpoint with {expo['local_ranks']} local ranks: HTTP GET {expo['http_seconds'] * 1e3:.2f} ms,"
          f" collect {expo['collect_seconds'] * 1e3:.2f} ms, {expo['series']} series, {expo['bytes']} bytes")
    print(f"wrote {prov.write({'benchmark': 'metrics_overhead', 'steps': steps, 'exposition': expo})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
