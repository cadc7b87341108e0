"""The job's MLflow run, handled by the launcher in child processes (`python -m
ddpjob_trainer.tracking`): found or created before torchrun starts, so that every rank logs
into it, and ended for a user's script that leaves it RUNNING. A child process, because MLflow's
import may start threads and torchrun is forked with none running."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable

from ddpjob_api import contract
from .procs import die_with_parent
from .report import say
from .signals import STOP_SIGNALS, StopSignals

# Finding or creating the job's MLflow run before torchrun starts: importing MLflow takes seconds on
# a loaded node, a request at most 5 s (tracking.HTTP_DEFAULTS), and there are a few.
MLFLOW_SECONDS = 60.0
MLFLOW_RETRY_SECONDS = 20.0  # within it, how long node 0 tries again (a busy or restarting server)
MLFLOW_PEER_WAIT_SECONDS = 30.0  # ... and a node other than 0 looks for node 0's run
MLFLOW_END_SECONDS = 30.0  # ending a user's script's run that it left RUNNING


def tracking_child(args: list[str], env: dict[str, str], *, children: list[subprocess.Popen], stdout: int,
                   stderr: int | None, while_stopping: bool = False) -> subprocess.Popen:
    """`python -m ddpjob_trainer.tracking ARGS` started as one of this node's `children` (in a
    session of its own, dying with the launcher)."""
    child = subprocess.Popen([sys.executable, "-m", "ddpjob_trainer.tracking", *args], env=env, text=True,
                             stdout=stdout, stderr=stderr, start_new_session=True,
                             preexec_fn=functools.partial(_tracking_child_setup, os.getpid(), while_stopping))
    children.append(child)
    return child


def _tracking_child_setup(parent: int, ignore_stops: bool) -> None:
    if ignore_stops:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    # A SIGTERM when the launcher dies would be ignored by a child that ignores stops.
    die_with_parent(parent, signal.SIGKILL if ignore_stops else signal.SIGTERM)


def run_tracking(args: list[str], env: dict[str, str], *, children: list[subprocess.Popen], signals: StopSignals,
                 seconds: float, while_stopping: bool = False) -> tuple[str | None, str]:
    """`python -m ddpjob_trainer.tracking ARGS` within `seconds`: (its stdout, "") or (None, why not).
    `while_stopping`: it ignores SIGTERM/SIGINT, which whatever stops this launcher (the local runner
    signals every process that appears below it) would send it too; `seconds` still bounds it."""
    child = tracking_child(args, env, children=children, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           while_stopping=while_stopping)
    deadline = time.monotonic() + seconds
    while True:
        try:
            out, err = child.communicate(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            signals.raise_if_stopped()
            if time.monotonic() >= deadline or signals.hurry():
                os.killpg(child.pid, signal.SIGKILL)
                child.communicate()
                return None, ("cut short by a second stop signal" if signals.hurry()
                              else f"no answer within {seconds:.0f}s")
    if child.returncode != 0:
        return None, (err.strip().splitlines() or [f"exit code {child.returncode}"])[-1]
    return out, ""


def mlflow_run(env: dict[str, str], *, node_rank: int, children: list[subprocess.Popen], signals: StopSignals,
               on_run: Callable[[str, str], None]) -> tuple[str | None, str | None]:
    """The job's MLflow run into env[MLFLOW_RUN_ID] for every rank of this node, so that a user's
    plain `mlflow` calls log into it (the built-in trainer resumes it): node 0 finds it by the job's
    tag or creates it, the other nodes look it up (node 0 created it before its torchrun opened the
    master port they waited for); on_run(run id, experiment id) learns it. Bounded; no run is a
    warning, unless spec.trainer.mlflow.required: then (None, why the attempt fails). Nothing to do
    for a job that does not track (DDPJOB_MLFLOW unset), or with MLFLOW_RUN_ID set (spec.env's, or
    the user's own shell under the local runner)."""
    if not env.get(contract.ENV_MLFLOW) or not env.get(contract.ENV_MLFLOW_TRACKING_URI) or env.get(contract.ENV_MLFLOW_RUN_ID):
        return None, None
    uri = contract.public_uri(env[contract.ENV_MLFLOW_TRACKING_URI])
    args = (["resolve", "--create", "--wait", str(MLFLOW_RETRY_SECONDS)] if node_rank == 0
            else ["resolve", "--wait", str(MLFLOW_PEER_WAIT_SECONDS)])
    out, why = run_tracking(args, env, children=children, signals=signals, seconds=MLFLOW_SECONDS)
    try:
        found = json.loads(out or "")
        run_id, exp_id = str(found["run_id"]), str(found["experiment_id"])
    except (ValueError, KeyError, TypeError):
        why = why or f"unexpected answer {out!r}"
        if env.get(contract.ENV_MLFLOW) == "required":
            return None, f"spec.trainer.mlflow.required: no MLflow run at {uri}: {why}"
        say(f"WARNING MLflow: no run at {uri} ({why}); training goes on without {contract.ENV_MLFLOW_RUN_ID}")
        return None, None
    env[contract.ENV_MLFLOW_RUN_ID] = run_id
    on_run(run_id, exp_id)
    say(f"MLflow run {run_id} (experiment {exp_id}) at {uri}")
    return run_id, None


def end_run_killed(env: dict[str, str], *, children: list[subprocess.Popen], signals: StopSignals,
                   seconds: float) -> None:
    """A stopped job's user script left its run RUNNING (it had its grace to end it): end it KILLED,
    after the script is gone (so nothing logs into it after) and within what is left of the grace."""
    run = env[contract.ENV_MLFLOW_RUN_ID]
    if seconds < 1.0:
        say(f"WARNING MLflow: run {run} left RUNNING (no time left in the stop grace to end it KILLED)")
        return
    out, why = run_tracking(["end", "KILLED"], env, children=children, signals=signals, seconds=seconds,
                            while_stopping=True)
    if why:
        say(f"WARNING MLflow: run {run} not ended KILLED ({why})")
    elif '"ended": true' in (out or ""):
        say(f"MLflow run {run} ended KILLED")
