"""GPU acceptance run: the built-in trainer on this machine's NVIDIA GPUs, no Kubernetes.

What it runs (one node, one rank per GPU, the in-pod launcher and torchrun, as a pod does):
  1. train:   NCCL, bf16 (precision "bf16": refused where the GPU lacks it natively), channels_last,
              torch.compile, async checkpoint saves, to step --steps;
  2. resume:  the same job to twice as many steps, which must resume from the first run's last
              checkpoint;
  3. inplace: on to three times as many steps, with one restart in place allowed (torchrun's
              --max-restarts): local rank 0's worker process is SIGKILLed halfway, torchrun starts
              the workers again in the same launcher (a new CUDA context, a new NCCL communicator),
              and they resume from the newest saved state and finish. Also timed: from the kill to
              the restarted workers' first logged step.
  4. peer:    PAIRS pairs (--pairs), the order alternating: the built-in trainer through the
              launcher and bench/plain_ddp.py under torchrun, a plain DDP loop on the same GPUs
              with the same model, batch, precision and channels_last, PEER_STEPS_FACTOR x --steps
              steps, no checkpoints and no compile in either (a compile's first step would swamp
              the difference): the trainer's samples/s over the loop's, geometric mean and 95 %
              interval (bench/stats.py); on a GPU it must be at least trainer_overhead.MIN_RATIO.
After each of runs 1-3 the ranks' metrics directory is served on loopback by the pods' own endpoint code
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
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from provenance import Provenance  # noqa: E402
from stats import ratio_interval, verdict  # noqa: E402

EXIT_NO_GPU = 2
RUNS = ("train", "resume", "inplace")
# The peer comparison: its runs' steps per --steps (the ratio a GPU run must reach is the CPU
# tier's guard's, trainer_overhead.MIN_RATIO).
PEER_STEPS_FACTOR = 5
STEP_LINE = re.compile(r"\bstep (\d+)/\d+")


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


def _worker(launcher: int) -> int | None:
    """The training worker of local rank 0 under the launcher (`python -m ddpjob_trainer`)."""
    import psutil

    for proc in psutil.Process(launcher).children(recursive=True):
        try:
            cmd, env = proc.cmdline(), proc.environ()
        except psutil.Error:  # gone meanwhile
            continue
        if cmd[-2:] == ["-m", "ddpjob_trainer"] and env.get("LOCAL_RANK") == "0":
            return proc.pid
    return None


def run_trainer(config: dict, *, nproc: int, cpu: bool, work: Path, name: str, timeout: float,
                kill_at_step: int | None = None) -> dict:
    """One run through the in-pod launcher; its exit code, result, metrics exposition and log.
    kill_at_step: on a GPU, SIGKILL local rank 0's worker once a step >= it is logged; on CPU (steps
    of milliseconds: the run could end before a kill lands) rank 0 exits 1 at that step by the
    trainer's own fault injection (DDPJOB_DEBUG_CRASH_RANK, first start only). torchrun may restart
    the workers once; the recovery is timed from the failure to the restarted workers' first step."""
    metrics_dir, result = work / f"{name}-metrics", work / f"{name}-result.json"
    from ddpjob_api import contract

    env = dict(os.environ)
    # The rendezvous a pod gets (builders/envvars.py): c10d at node 0, one id per run, a fresh store
    # per round, and the in-place restart budget (none unless this run kills a worker).
    env.update({contract.PET_NNODES: "1", contract.PET_NPROC_PER_NODE: str(nproc),
                contract.PET_RDZV_BACKEND: "c10d", contract.PET_RDZV_ENDPOINT: f"127.0.0.1:{_port()}",
                contract.PET_RDZV_ID: f"gpu-check-{name}", contract.ENV_TORCH_NO_SHARED_RDZV_STORE: "1",
                contract.PET_MAX_RESTARTS: "1" if kill_at_step is not None else "0", "NODE_RANK": "0",
                "DDPJOB_TRAINER_CONFIG": json.dumps(config), "DDPJOB_NAME": "gpu-check",
                "DDPJOB_METRICS_DIR": str(metrics_dir), "DDPJOB_RESULT_FILE": str(result),
                # every local rank needs a GPU: the launcher's and trainer's checks run as in a pod
                "DDPJOB_GPUS_PER_NODE": "0" if cpu else str(nproc),
                "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))})
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    crash = cpu and kill_at_step is not None
    if crash:
        env["DDPJOB_DEBUG_CRASH_RANK"] = f"0:{kill_at_step}"
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "ddpjob_trainer.launch", "--metrics-port", "0", "--"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    killed: dict = {}
    code: int | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the launcher's output ends when it exits; the deadline below bounds it
            lines.append(line)
            if time.monotonic() - t0 > timeout:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            if crash and not killed and (m := contract.INPLACE_MARKER_RE.match(line.strip())) and m.group(2) == "1":
                # The crash happened (torchrun starts the workers again): time from here.
                killed = {"pid": None, "after_step": kill_at_step, "at": time.monotonic()}
                continue
            step = STEP_LINE.search(line)
            if step is None or kill_at_step is None:
                continue
            if crash:
                if killed and "first_step" not in killed:
                    killed["first_step"] = int(step.group(1))
                    killed["recovery_s"] = round(time.monotonic() - killed.pop("at"), 2)
                continue
            if not killed and int(step.group(1)) >= kill_at_step and (pid := _worker(proc.pid)):
                os.kill(pid, signal.SIGKILL)
                killed = {"pid": pid, "after_step": int(step.group(1)), "at": time.monotonic()}
            elif killed and "first_step" not in killed and _worker(proc.pid) not in (None, killed["pid"]):
                killed["first_step"] = int(step.group(1))
                killed["recovery_s"] = round(time.monotonic() - killed.pop("at"), 2)
        code = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        lines.append(f"gpu-check: timed out after {timeout:.0f}s\n")
    log = "".join(lines)
    (work / f"{name}.log").write_text(log)
    return {"exit_code": code, "seconds": round(time.monotonic() - t0, 1), "killed": killed or None,
            "result": json.loads(result.read_text()) if result.exists() else None,
            "metrics": scrape_dir(metrics_dir) if metrics_dir.exists() else "", "log_tail": log[-3000:]}


def run_plain(config: dict, *, nproc: int, cpu: bool, work: Path, name: str, timeout: float) -> dict:
    """bench/plain_ddp.py under torchrun on the same devices: its samples/s (rank 0's JSON line)."""
    from trainer_overhead import plain_command  # the CPU guard's peer arm, the same command

    argv, env = plain_command(nproc, config)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    # Rank 0 prints its line after the all-reduce of every rank's samples and seconds: the measurement
    # is whole even where a rank then dies in gloo's teardown ("terminate called without an active
    # exception", once in a CPU test run), whose exit code is kept beside it.
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith('{"train_samples_per_second"')), None)
    return {"exit_code": proc.returncode,
            "samples_per_second": json.loads(line)["train_samples_per_second"] if line else None}


def peer(config: dict, *, pairs: int, nproc: int, cpu: bool, work: Path, timeout: float) -> dict:
    """The trainer against the plain loop: `pairs` pairs, the arm run first alternating."""
    out: dict = {"pairs": [], "config": config}
    for i in range(pairs):
        pair = {}
        for arm in ("ours", "plain") if i % 2 == 0 else ("plain", "ours"):
            name = f"peer-{i}-{arm}"
            if arm == "ours":
                run = run_trainer(config, nproc=nproc, cpu=cpu, work=work, name=name, timeout=timeout)
                pair[arm] = {"exit_code": run["exit_code"],
                             "samples_per_second": (run["result"] or {}).get("train_samples_per_second")}
            else:
                pair[arm] = run_plain(config, nproc=nproc, cpu=cpu, work=work, name=name, timeout=timeout)
        out["pairs"].append(pair)
        if not (pair["ours"]["samples_per_second"] and pair["plain"]["samples_per_second"]):
            return out  # an arm failed: its log says why, and no ratio
    ratios = [p["ours"]["samples_per_second"] / p["plain"]["samples_per_second"] for p in out["pairs"]]
    out["ratio"] = ratio_interval(ratios) if len(ratios) >= 2 else {"ratio": ratios[0], "pairs": 1}
    return out


def peer_config(config: dict, *, steps: int) -> dict:
    """The acceptance run's job for the peer pairs: longer, no checkpoints, no compile."""
    return {**{k: v for k, v in config.items() if k != "checkpoint"}, "maxSteps": steps, "compile": False}


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
    from ddpjob_operator.decisions.samples import parse_metrics
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


def peer_checks(result: dict | None, *, cpu: bool) -> list[tuple[str, bool, str]]:
    """Both arms of every pair trained; on a GPU the trainer keeps MIN_RATIO of the loop's rate."""
    from trainer_overhead import MIN_RATIO  # the CPU guard's floor
    if result is None:
        return [("peer: ran", False, "not run (an earlier run failed)")]
    failed = [f"pair {i} {arm} exit {p[arm]['exit_code']} (see peer-{i}-{arm}.log)"
              for i, p in enumerate(result["pairs"]) for arm in ("ours", "plain")
              if not p[arm]["samples_per_second"]]
    out = [("peer: the trainer and the plain DDP loop both trained, every pair", not failed,
            "; ".join(failed) or f"{len(result['pairs'])} pairs")]
    ci = result.get("ratio")
    if ci is not None:
        said = verdict(ci, what="samples/s trainer/plain") if "low" in ci else f"{ci['ratio']:.3f} (1 pair)"
        out.append((f"peer: the trainer's samples/s at least {MIN_RATIO}x the plain loop's",
                    cpu or ci["ratio"] >= MIN_RATIO, said + (" (informational on CPU)" if cpu else "")))
    return out


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
        target = steps * (RUNS.index(name) + 1)
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
    inplace = runs.get("inplace")
    if inplace is not None:
        killed = inplace.get("killed") or {}
        out.append(("inplace: a worker died mid-run (SIGKILL on a GPU, an injected crash on CPU)", bool(killed),
                    f"{killed or 'no worker died'}"))
        out.append(("inplace: the restarted workers stepped again in the same launcher", "first_step" in killed,
                    f"first step {killed.get('first_step')} {killed.get('recovery_s')} s after the kill"))
        got = (inplace.get("result") or {}).get("resumed_from_step")
        # Not from scratch: from the resume run's last checkpoint or anything saved since.
        out.append(("inplace: resumed from saved state, not from scratch", (got or 0) >= 2 * steps,
                    f"resumed_from_step {got}"))
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
    ap.add_argument("--pairs", type=int, default=3, help="trainer/plain-loop pairs of the peer comparison (0: none)")
    ap.add_argument("--out", default=None, help="JSON (default bench/results/gpu_check[_cpu].json)")
    ap.add_argument("--workdir", default=None, help="checkpoints and logs (default: a temp dir, kept on failure)")
    args = ap.parse_args(argv)
    out = args.out or HERE / "results" / ("gpu_check_cpu.json" if args.cpu else "gpu_check.json")
    # On a lent GPU machine without git: DDPJOB_BENCH_COMMIT names the commit the tree is a copy of.
    prov = Provenance("api", "trainer", "operator", "bench", out=out, argv=["bench/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])

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
    for name, n in zip(RUNS, (steps, 2 * steps, 3 * steps)):
        inplace = name == "inplace"
        # Every step logged in the in-place run: the kill and the recovery are read off the log.
        run = run_trainer({**config, "maxSteps": n, **({"logEverySteps": 1} if inplace else {})}, nproc=nproc,
                          cpu=args.cpu, work=work, name=name, timeout=args.timeout,
                          kill_at_step=2 * steps + max(1, steps // 2) if inplace else None)
        run["ranks"] = per_rank(run.pop("metrics"))
        runs[name] = run
        if run["exit_code"] != 0:
            break
    results = checks(runs, cpu=args.cpu, nproc=nproc, steps=steps)
    compared = None
    if args.pairs and all(r["exit_code"] == 0 for r in runs.values()):
        compared = peer(peer_config(config, steps=PEER_STEPS_FACTOR * steps), pairs=args.pairs, nproc=nproc,
                        cpu=args.cpu, work=work, timeout=args.timeout)
    if args.pairs:
        results += peer_checks(compared, cpu=args.cpu)
    ok = all(passed for _, passed, _ in results)

    print(table(runs))
    print()
    for what, passed, detail in results:
        print(f"{'PASS' if passed else 'FAIL'}  {what}" + (f"  ({detail})" if detail else ""))
    print(f"\ngpu-check: {'PASSED' if ok else 'FAILED'}; logs and checkpoints in {work}")

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)], "nproc": nproc,
           "mode": "cpu" if args.cpu else "gpu"}
    written = prov.write({"env": env, "config": config, "passed": ok, "peer": compared,
                          "checks": [{"what": w, "passed": p, "detail": d} for w, p, d in results],
                          "runs": {k: {**v, "ranks": {str(r): x for r, x in v["ranks"].items()}}
                                   for k, v in runs.items()}})
    print(f"wrote {written}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
