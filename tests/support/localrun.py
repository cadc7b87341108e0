"""Real `ddpjob run --local` processes for tests that need live trainer metrics endpoints."""
from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import types
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import psutil
import yaml

from ddpjob_cli import local

REPO_ROOT = Path(__file__).resolve().parents[2]
DDPJOB = Path(sys.executable).parent / "ddpjob"

# A user's own DDP script (a `command:` job) reporting through the telemetry API, where one rank's
# input pipeline is slow: that rank's peers wait for it in all-reduce every step.
SLOW_INPUT_SCRIPT = '''
import os, time
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from ddpjob_trainer import telemetry

dist.init_process_group("gloo")
rank, slow = dist.get_rank(), int(os.environ.get("SLOW_INPUT_RANK", "-1"))
steps = 4000

def batches():
    for _ in range(steps):
        if rank == slow:
            time.sleep(0.2)                     # this rank's data loader is slow
        yield torch.randn(32, 64), torch.randint(0, 10, (32,))

model = DDP(nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
tm = telemetry.Telemetry.from_env()
tm.set_total_steps(steps)
for x, y in tm.track(batches()):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    tm.record_loss(loss)
    time.sleep(0.02)
dist.destroy_process_group()
'''


def free_ports(n: int, *, consecutive: bool = False) -> list[int]:
    """n free loopback ports (consecutive ones when asked: node N serves on base + N), below the
    ephemeral range so that no outgoing connection takes one before its server binds it."""
    if consecutive:
        base = local.free_ports(n)
        return list(range(base, base + n))
    ports: list[int] = []
    while len(ports) < n:
        p = local.free_port()
        if p not in ports:
            ports.append(p)
    return ports


def pids_with_env(entry: str, *, prefix: bool = False) -> list[int]:
    """Live processes whose environment holds `entry` (e.g. "DDPJOB_NAME=digits"), or an entry
    starting with it when `prefix`."""
    key, _, value = entry.partition("=")
    pids = []
    for p in psutil.process_iter(["environ"]):  # None where it is gone meanwhile or not ours to read
        have = (p.info["environ"] or {}).get(key)
        if have is not None and (have.startswith(value) if prefix else have == value):
            pids.append(p.pid)
    return pids


def write_digits_job(directory: Path, *, epochs: int, restart_on_hang: bool = True,
                     hang_timeout: int | None = None) -> Path:
    """examples/digits.yaml with another epoch count (long enough for the checks); a test that
    freezes a rank to watch the stall passes restart_on_hang=False (else its agent restarts it),
    and the hang timeout its agents judge by (they capture the ranks' stacks at half of it)."""
    from ddpjob_cli.local import load_job_file

    job = load_job_file(REPO_ROOT / "examples" / "digits.yaml")
    job["spec"]["trainer"]["epochs"] = epochs
    job["spec"].setdefault("failurePolicy", {})["restartOnHang"] = restart_on_hang
    if hang_timeout is not None:
        job["spec"]["hangTimeoutSeconds"] = hang_timeout
    spec = directory / "digits.yaml"
    spec.write_text(yaml.safe_dump(job))
    return spec


def write_slow_input_job(directory: Path, *, name: str) -> Path:
    """A 2-node `command:` job running SLOW_INPUT_SCRIPT (SLOW_INPUT_RANK picks the slow rank)."""
    (directory / "slow_input.py").write_text(SLOW_INPUT_SCRIPT)
    spec = directory / "custom.yaml"
    spec.write_text(yaml.safe_dump({
        "apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
        "spec": {"nodes": 2, "nprocPerNode": 1, "gpusPerNode": 0, "image": "reg/trainer:1",
                 "command": ["torchrun", "slow_input.py"], "failurePolicy": {"maxRestarts": 0}}}))
    return spec


def stop_local_run(proc: subprocess.Popen, workdir: Path) -> None:
    """Stop `ddpjob run` like Ctrl-C does (it stops its nodes), then make sure no node of it survives."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    # Nodes run in sessions of their own; any left (a frozen rank) is found by its work dir.
    for pid in pids_with_env(f"DDPJOB_RESULT_FILE={workdir}/", prefix=True):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


@contextmanager
def local_run(spec: Path, root: Path, **env_extra: str) -> Iterator[types.SimpleNamespace]:
    """`ddpjob run SPEC --local` with node metrics on base, base+1; stopped (and its log shown) after.

    The test process's own DDPJOB_* variables never leak into the run; `env_extra` adds knobs.
    """
    base = free_ports(2, consecutive=True)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPJOB_")}
    env.update(env_extra)
    log_path, workdir = root / "run.log", root / "wd"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(DDPJOB), "run", str(spec), "--local", "--metrics-port-base", str(base),
                                 "--no-progress", "--workdir", str(workdir)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield types.SimpleNamespace(base=base, ports=[base, base + 1], proc=proc, log=log_path)
        finally:
            stop_local_run(proc, workdir)
            print(f"--- training log ({log_path}) ---\n{log_path.read_text()[-3000:]}")
            # Each node's launcher log (e.g. a metrics port it could not bind) explains a missing rank.
            for node_log in sorted((workdir / "logs").glob("attempt-*/*")):
                if node_log.is_file():
                    print(f"--- {node_log.relative_to(workdir)} ---\n{node_log.read_text(errors='replace')[-1500:]}")


def rank_samples(ports: list[int]) -> dict:
    """What the ranks of a local run report now on their loopback metrics ports ({rank:
    samples.RankSample}, parsed as the operator parses them; a port that does not answer adds none)."""
    from ddpjob_operator.decisions.samples import merge, parse_metrics

    parts = []
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                parts.append(parse_metrics(r.read().decode()))
        except (OSError, http.client.HTTPException):  # refused, or cut short by the rank's exit
            continue
    return merge(parts)


def wait_ranks(run: types.SimpleNamespace, pred: Callable[[dict], bool], desc: str, *, timeout: float = 240) -> dict:
    """Wait until the run's ranks report what `pred` asks of rank_samples: a test that sets a short
    timeout on a moment (a freeze) waits for the moment itself, however long a cold start takes
    to reach it. Gives up at once when the run ended."""
    from tests.support.cluster import wait_for

    def check():
        if run.proc.poll() is not None:
            return {"training exited": run.proc.returncode}
        samples = rank_samples(run.ports)
        return samples if pred(samples) else None
    got = wait_for(check, timeout=timeout, interval=0.5, desc=f"local run: {desc}")
    assert "training exited" not in got, f"training ended before {desc}: {got}\n{run.log.read_text()[-3000:]}"
    return got


def in_stage(stage: str, ranks: tuple[int, ...] = (0, 1)) -> Callable[[dict], bool]:
    """A wait_ranks predicate: every one of `ranks` reports `stage`."""
    return lambda samples: all(r in samples and samples[r].stage == stage for r in ranks)
