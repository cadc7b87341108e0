"""GPU acceptance run: the built-in trainer on this machine's NVIDIA GPUs, no Kubernetes.

What it runs (one node, one rank per GPU, the in-pod launcher and torchrun, as a pod does):
  1. train:  NCCL, bf16 (precision "bf16": refused where the GPU lacks it natively), channels_last,
             torch.compile, async checkpoint saves, to step --steps;
  2. resume: the same job to twice as many steps, which must resume from the first run's last
             checkpoint.
After each run the ranks' metrics directory is served on loopback by the pods' own endpoint code
and scraped: per rank the steps, step time, device compute time (CUDA events), GPU memory and GPU
UUID. Prints one table and the checks, writes bench/results/gpu_check.json.

Exit codes: 0 every check passed, 1 a check failed (listed), 2 no NVIDIA GPU visible.
`--cpu` runs the same plumbing on CPU with gloo (no bf16, no compile; the GPU-only checks turn into
"absent on CPU"): the fast test in tests/trainer/test_gpu_check.py runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from stats import git_head  # noqa: E402

EXIT_NO_GPU = 2
RUNS = ("train", "resume")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_config(*, cpu: bool, steps: int, ckpt_dir: str) -> dict:
    """The job's spec.trainer: resnet18 on synthetic images on GPUs; a small convnet on CPU."""
    if cpu:
        model, shape, batch = "convnet", [3, 16, 16], 16
        speed = {"precision": "fp32", "compile": False, "channelsLast": False}
    else:
        model, shape, batch = "resnet18", [3, 64, 64], 64
        speed = {"precision": "bf16", "compile": True, "channelsLast": True}
    return {"dataset": "synthetic", "model": model, "epochs": 1000, "maxSteps": steps, "batchSize": batch,
            "lr": 0.01, "scheduler": "constant", "seed": 0, "logEverySteps": 5, "numWorkers": 0 if cpu else 2,
            **speed,
            "synthetic": {"trainSize": 4096, "valSize": 128, "shape": shape, "numClasses": 10, "seed": 1},
            "checkpoint": {"dir": ckpt_dir, "everySteps": max(1, steps // 2), "asyncSave": True, "keep": 2}}


def run_trainer(config: dict, *, nproc: int, cpu: bool, work: Path, name: str, timeout: float) -> dict:
    """One run through the in-pod launcher; its exit code, result, metrics exposition and log."""
    metrics_dir, result = work / f"{name}-metrics", work / f"{name}-result.json"
    env = dict(os.environ)
    env.update({"PET_NNODES": "1", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": str(nproc),
                "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(_port()), "NODE_RANK": "0",
                "DDPJOB_TRAINER_CONFIG": json.dumps(config), "DDPJOB_NAME": "gpu-check",
                "DDPJOB_METRICS_DIR": str(metrics_dir), "DDPJOB_RESULT_FILE": str(result),
                # every local rank needs a GPU: the launcher's and trainer's checks run as in a pod
                "DDPJOB_GPUS_PER_NODE": "0" if cpu else str(nproc),
                "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))})
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "ddpjob_trainer.launch", "--metrics-port", "0", "--"],
                              env=env, capture_output=True, text=True, timeout=timeout)
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, log = None, f"timed out after {timeout:.0f}s\n{exc.stdout or ''}{exc.stderr or ''}"
    (work / f"{name}.log").write_text(log if isinstance(log, str) else str(log))
    return {"exit_code": code, "seconds": round(time.monotonic() - t0, 1),
            "result": json.loads(result.read_text()) if result.exists() else None,
            "metrics": scrape_dir(metrics_dir) if metrics_dir.exists() else "", "log_tail": log[-3000:]}


def scrape_dir(metrics_dir: Path) -> str:
    """The ranks' metrics as a pod serves them: the node endpoint over the dir, read on loopback."""
    from ddpjob_trainer.telemetry import serve_node_endpoint

    port = _port()
    server = serve_node_endpoint(port, str(metrics_dir), addr="127.0.0.1")
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()


def per_rank(text: str) -> dict[int, dict]:
    """Table columns per rank from one exposition (the operator's own parser, plus gpu_info)."""
    from ddpjob_operator.cluster.scrape import parse_metrics
    from ddpjob_trainer.telemetry import GPU_INFO
    from prometheus_client.parser import text_string_to_metric_families

    gpus = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == GPU_INFO:
            for s in fam.samples:
                if s.value == 1:
                    gpus[int(s.labels["rank"])] = (s.labels.get("uuid"), s.labels.get("name"))
    out = {}
    for r, s in sorted(parse_metrics(text).items()):
        uuid, name = gpus.get(r, (None, None))
        out[r] = {"step": s.step, "total_steps": s.total_steps,
                  "step_ms": _ms(s.step_seconds_sum, s.step_seconds_count),
                  "compute_ms": _ms(s.compute_seconds_sum, s.compute_seconds_count),
                  "compute_steps": int(s.compute_seconds_count),
                  "data_wait_ms": _ms(s.data_wait_seconds_total, s.step_seconds_count),
                  "gpu_peak_mib": (round(s.gpu_memory_max_allocated_bytes / 2**20)
                                   if s.gpu_memory_max_allocated_bytes is not None else None),
                  "gpu_uuid": uuid, "gpu_name": name,
                  "checkpoint_s": round(s.checkpoint_seconds, 3) if s.checkpoint_seconds is not None else None}
    return out


def _ms(total: float, count: float) -> float | None:
    return round(1000 * total / count, 2) if count else None


def checks(runs: dict[str, dict], *, cpu: bool, nproc: int, steps: int) -> list[tuple[str, bool, str]]:
    """(what, passed, detail) for everything the acceptance run stands for."""
    out = []
    for name in RUNS:
        run = runs.get(name)
        if run is None:
            out.append((f"{name}: ran", False, "not run (an earlier run failed)"))
            continue
        out.append((f"{name}: exit code 0", run["exit_code"] == 0,
                    f"exit {run['exit_code']}" + ("" if run["exit_code"] == 0 else f"; see {name}.log")))
        ranks = run["ranks"]
        out.append((f"{name}: every rank exported metrics", sorted(ranks) == list(range(nproc)),
                    f"ranks {sorted(ranks)}"))
        target = steps if name == "train" else 2 * steps
        done = {r: v["step"] for r, v in ranks.items()}
        out.append((f"{name}: every rank reached step {target}", bool(done) and set(done.values()) == {target},
                    f"steps {done}"))
        if cpu:
            out.append((f"{name}: no device series on CPU", all(
                v["compute_steps"] == 0 and v["gpu_uuid"] is None and v["gpu_peak_mib"] is None
                for v in ranks.values()), "compute time, GPU memory and gpu_info absent"))
        else:
            out.append((f"{name}: device compute time per rank", bool(ranks) and all(
                v["compute_steps"] > 0 for v in ranks.values()),
                ", ".join(f"rank {r} {v['compute_steps']} steps" for r, v in ranks.items())))
            out.append((f"{name}: GPU memory per rank", bool(ranks) and all(
                (v["gpu_peak_mib"] or 0) > 0 for v in ranks.values()), ""))
            uuids = [v["gpu_uuid"] for v in ranks.values()]
            out.append((f"{name}: one GPU UUID per rank, all different",
                        bool(uuids) and None not in uuids and len(set(uuids)) == len(uuids), str(uuids)))
    resume = runs.get("resume") or {}
    got = (resume.get("result") or {}).get("resumed_from_step")
    out.append(("resume: from the first run's last checkpoint", got == steps, f"resumed_from_step {got}"))
    return out


def table(runs: dict[str, dict]) -> str:
    cols = ("run", "rank", "gpu", "steps", "step ms", "device fwd ms", "data wait ms", "peak MiB",
            "ckpt s", "samples/s")
    rows = []
    for name, run in runs.items():
        sps = (run.get("result") or {}).get("train_samples_per_second")
        for r, v in run["ranks"].items():
            gpu = f"{v['gpu_name']} {v['gpu_uuid'][:12]}" if v["gpu_uuid"] else "-"
            rows.append((name, r, gpu, v["step"], v["step_ms"], v["compute_ms"], v["data_wait_ms"],
                         v["gpu_peak_mib"], v["checkpoint_s"], round(sps) if (sps and r == 0) else None))
    cells = [[str(c) for c in cols]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the same plumbing on CPU/gloo (no bf16, no compile)")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; 2 with --cpu)")
    ap.add_argument("--steps", type=int, default=None, help="steps of the first run (default 40; 6 with --cpu)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--out", default=None, help="JSON (default bench/results/gpu_check[_cpu].json)")
    ap.add_argument("--workdir", default=None, help="checkpoints and logs (default: a temp dir, kept on failure)")
    args = ap.parse_args(argv)

    import torch

    gpus = 0 if args.cpu else torch.cuda.device_count()
    if not args.cpu and gpus < 1:
        print("gpu-check: no NVIDIA GPU visible to torch (torch.cuda.device_count() is 0, torch "
              f"{torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). "
              "Run it on a machine with a GPU, or with --cpu for the same plumbing on gloo.", file=sys.stderr)
        return EXIT_NO_GPU
    nproc = args.nproc or (2 if args.cpu else gpus)
    if not args.cpu and nproc > gpus:
        ap.error(f"--nproc {nproc} > the {gpus} GPUs visible: one rank per GPU")
    steps = args.steps or (6 if args.cpu else 40)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    config = trainer_config(cpu=args.cpu, steps=steps, ckpt_dir=str(work / "checkpoints"))

    runs: dict[str, dict] = {}
    for name, n in zip(RUNS, (steps, 2 * steps)):
        run = run_trainer({**config, "maxSteps": n}, nproc=nproc, cpu=args.cpu, work=work, name=name,
                          timeout=args.timeout)
        run["ranks"] = per_rank(run.pop("metrics"))
        runs[name] = run
        if run["exit_code"] != 0:
            break
    results = checks(runs, cpu=args.cpu, nproc=nproc, steps=steps)
    ok = all(passed for _, passed, _ in results)

    print(table(runs))
    print()
    for what, passed, detail in results:
        print(f"{'PASS' if passed else 'FAIL'}  {what}" + (f"  ({detail})" if detail else ""))
    print(f"\ngpu-check: {'PASSED' if ok else 'FAILED'}; logs and checkpoints in {work}")

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)], "nproc": nproc,
           "mode": "cpu" if args.cpu else "gpu", "git": git_head()}
    out = Path(args.out or HERE / "results" / ("gpu_check_cpu.json" if args.cpu else "gpu_check.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "config": config, "passed": ok,
                               "checks": [{"what": w, "passed": p, "detail": d} for w, p, d in results],
                               "runs": {k: {**v, "ranks": {str(r): x for r, x in v["ranks"].items()}}
                                        for k, v in runs.items()}}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
