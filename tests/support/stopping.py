"""Helpers for the tests that stop a run with a signal at a chosen moment on a loaded machine
(issue 18: `ddpjob run --local` and the in-pod launcher stop within seconds, whatever they do).

The moments, each detected from outside the way a user would see it:
- "agents":     a torchrun agent exists and is starting (importing torch);
- "import":     a worker process exists and is importing torch;
- "step":       training is under way (a rank reports step >= 3 on its metrics endpoint);
- "checkpoint": a checkpoint is being written (its `.tmp-step-*` directory exists).
"""
from __future__ import annotations

import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import psutil
from ddpjob_api import contract

from tests.support.localrun import pids_with_env

MOMENTS = ("agents", "import", "step", "checkpoint")
# A behaviour bound, not a performance figure: a local run's stop path sends SIGKILL after
# contract.STOP_GRACE_DEFAULT (5 s) of grace, so anything near this means the stop did not happen
# at all (the old failure took over 60 s).
STOP_BOUND_SECONDS = 15.0
# A pod's launcher gets the grace the operator derives from terminationGracePeriodSeconds (23 s of
# Kubernetes' default 30), which a rank may spend on its last checkpoint, and keeps the rest for
# itself: the bound it has to keep is the kubelet's SIGKILL at the end of the grace period. On CI's
# loaded cores a rank saving at SIGTERM used more than 15 s of its 23 (stop 68's CI), as it may.
POD_STOP_BOUND_SECONDS = float(contract.POD_TERMINATION_GRACE_DEFAULT)
_STEP = re.compile(r"^ddpjob_trainer_step\{[^}]*\} (\S+)$", re.M)


@contextmanager
def cpu_load(processes: int | None = None) -> Iterator[list[subprocess.Popen]]:
    """A busy process for each core that the machine does not already keep busy (or `processes`)
    for the duration: the loaded machine on which a stop that merely usually works would fail.
    Where the other tests already load every core (make test's sessions side by side: a load of
    6-10 on CI's two cores), more busy loops would only take CPU from them."""
    cores = os.cpu_count() or 1
    busy = min(cores, int(os.getloadavg()[0]))  # runnable processes, the last minute's average
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(cores - busy if processes is None else processes)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


def run_processes(marker: str) -> list[int]:
    """Live processes of one run: every node process carries DDPJOB_RESULT_FILE under its work
    dir (a unique path), which torchrun passes on to its workers."""
    return [p for p in pids_with_env(f"DDPJOB_RESULT_FILE={marker}", prefix=True) if not _zombie(p)]


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


# torchrun's agent: `python -m ddpjob_trainer.agent` under the launcher, torch's own elsewhere.
AGENT_MODULES = ("torch.distributed.run", "ddpjob_trainer.agent")


def is_agent(cmd: list[str]) -> bool:
    return any(m in cmd for m in AGENT_MODULES)


def is_worker(cmd: list[str]) -> bool:
    """A training process of the built-in trainer (not its launcher, not torchrun's agent)."""
    return "ddpjob_trainer" in cmd and not is_agent(cmd) and "ddpjob_trainer.launch" not in cmd


def agents(marker: str) -> list[int]:
    """torchrun's agents. (Not the launchers: one signalled in the first milliseconds of its life,
    before Python has run a line of it, dies of the signal's default action, or as a container's
    PID 1 never sees it; the kubelet's SIGKILL at the end of the grace period bounds that case.)"""
    return [p for p in run_processes(marker) if is_agent(cmdline(p))]


def workers(marker: str) -> list[int]:
    """The training processes (not launchers, not torchrun agents)."""
    out = []
    for p in run_processes(marker):
        if is_worker(cmdline(p)):
            out.append(p)
    return out


def max_step(ports: list[int]) -> int:
    """The highest step any rank reports on these loopback metrics ports (0 when none answers)."""
    best = 0
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except (OSError, http.client.HTTPException):  # refused, or cut short by the rank's exit
            continue
        best = max([best, *(int(float(v)) for v in _STEP.findall(text))])
    return best


def moment_reached(moment: str, *, marker: str, ports: list[int], ckpt_dir: Path) -> Callable[[], bool]:
    """A predicate that turns true at `moment` (see the module docstring)."""
    if moment == "agents":
        return lambda: bool(agents(marker))
    if moment == "import":
        return lambda: bool(workers(marker))
    if moment == "step":
        return lambda: max_step(ports) >= 3
    if moment == "checkpoint":
        return lambda: ckpt_dir.is_dir() and any(p.name.startswith(".tmp-") for p in ckpt_dir.iterdir())
    raise ValueError(f"unknown moment {moment!r}; one of {MOMENTS}")


def wait_for_moment(reached: Callable[[], bool], *, alive: Callable[[], bool], timeout: float,
                    what: str, interval: float = 0.01) -> None:
    """Poll until `reached()`; AssertionError when the run ended first or after `timeout`."""
    deadline = time.monotonic() + timeout
    while not reached():
        assert alive(), f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(interval)


def wait_gone(marker: str, *, until: float) -> list[int]:
    """Wait (until the monotonic deadline) for every process of the run to be gone; the ones left."""
    left = run_processes(marker)
    while left and time.monotonic() < until:
        time.sleep(0.1)
        left = run_processes(marker)
    return left


def describe(pids: list[int]) -> list[str]:
    return [f"{p}: {' '.join(cmdline(p))[:160]}" for p in pids]


def kill_run(proc: subprocess.Popen, marker: str) -> None:
    """Whatever the test's outcome, leave nothing of the run behind: SIGKILL its top process
    (its whole group when it leads one) and every process carrying its marker."""
    if proc.poll() is None:
        try:
            leads_group = os.getpgid(proc.pid) == proc.pid
        except ProcessLookupError:
            leads_group = False
        if leads_group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait()
    for pid in run_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pid1_prefix() -> list[str]:
    """`unshare` arguments that make a command PID 1 of a new PID namespace, as a container's
    entrypoint is (PID 1 ignores every signal it has no handler for); [] where not allowed."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return []
    probe = subprocess.run(["unshare", "-fp", "--mount-proc", "true"], capture_output=True, timeout=30)
    return ["unshare", "-fp", "--mount-proc"] if probe.returncode == 0 else []


def first_child(pid: int, *, timeout: float = 30) -> int:
    """The first child of `pid` (e.g. the PID 1 that `unshare -f` starts), waiting for it to exist."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            kids = psutil.Process(pid).children()
        except psutil.NoSuchProcess:
            kids = []
        if kids:
            return kids[0].pid
        assert time.monotonic() < deadline, f"process {pid} started no child within {timeout:.0f}s"
        time.sleep(0.01)
