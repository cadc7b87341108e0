"""One node's launch, start to end (`main`): see the package's docstring."""
from __future__ import annotations

import argparse
import functools
import math
import os
import subprocess
import sys
import shutil
import socket
import tempfile
import time
from typing import Callable, cast

from .. import debug
from ddpjob_api import contract
from ..agent import steps_reached
from ..errors import EXIT_BAD_CONFIG, EXIT_TRAINING_FAILED, ConfigError
from ..tracking import SYSTEM_METRICS_END_SECONDS
from . import runs
from .procs import become_subreaper, die_with_parent, end_child, stop_tree
from .report import (failure_message, name_the_run, rank_messages, recorded_error, report_result, say,
                     write_termination)
from .signals import Stop, StopSignals, stop_grace_from_env

# A sitecustomize that frees a run's process group before interpreter finalization (why: its
# docstring); first on every child's PYTHONPATH.
EXIT_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exitguard")


def with_exit_guard(env: dict[str, str]) -> dict[str, str]:
    """`env` with EXIT_GUARD first on PYTHONPATH, the rest (the user's own entries) kept in order."""
    rest = [p for p in env["PYTHONPATH"].split(os.pathsep) if p != EXIT_GUARD] if env.get("PYTHONPATH") else []
    return {**env, "PYTHONPATH": os.pathsep.join([EXIT_GUARD, *rest])}


AGENT = [sys.executable, "-m", "ddpjob_trainer.agent"]


def default_command() -> list[str]:
    """torchrun (as ddpjob_trainer.agent: counted, attributed restarts in place) with the built-in
    trainer; torchrun reads PET_NNODES, PET_RDZV_*, PET_MAX_RESTARTS, ... itself."""
    return [*AGENT, "-m", "ddpjob_trainer"]


def counted(cmd: list[str], *, which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """A user's own torchrun (`torchrun ARGS`, `python -m torch.distributed.run ARGS`) run as
    ddpjob_trainer.agent ARGS: torchrun itself, same flags and env, whose restarts in place are
    then marked, counted and attributed like the built-in trainer's. Only a torchrun of this
    launcher's own environment (its interpreter's directory): another venv's has its own packages
    and torch, which the agent must not replace. Anything else (a shell that calls torchrun, a
    plain script) runs as given."""
    prog = os.path.basename(cmd[0]) if cmd else ""
    if prog == "torchrun":
        args, python = cmd[1:], _interpreter(which(cmd[0]), which)
    elif prog.startswith("python") and cmd[1:3] == ["-m", "torch.distributed.run"]:
        args, python = cmd[3:], which(cmd[0])
    else:
        return cmd
    ours = os.path.dirname(os.path.abspath(sys.executable))
    return [*AGENT, *args] if python and os.path.dirname(os.path.abspath(python)) == ours else cmd


def _interpreter(script: str | None, which: Callable[[str], str | None]) -> str | None:
    """The Python a console script's shebang names (`#!/usr/bin/env python3` looked up), else None."""
    try:
        with open(script or "", "rb") as f:
            line = f.readline(512).decode(errors="replace")
    except OSError:
        return None
    words = line[2:].split() if line.startswith("#!") else []
    if words[:1] and os.path.basename(words[0]) == "env":
        return which(words[1]) if len(words) > 1 else None
    return words[0] if words else None


# A node other than 0 waits for the master (pod 0, the c10d rendezvous's host) before torchrun.
def wait_for_master(addr: str, port: int, *, timeout: float, interval: float = 1.0,
                    check_stop: Callable[[], None] = lambda: None) -> None:
    """Block until addr resolves and addr:port accepts TCP, or raise TimeoutError saying which failed.
    `check_stop` runs between tries (StopSignals.raise_if_stopped: a stop that was lost is seen)."""
    deadline = time.monotonic() + timeout
    last = "not tried"
    resolved = False
    while True:
        try:
            infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
            resolved = True
            sockaddr = cast("tuple[str, int]", infos[0][4][:2])  # an AF_INET(6) address: host, port
            with socket.create_connection(sockaddr, timeout=min(5.0, interval * 5)):
                return
        except socket.gaierror as exc:
            last = f"DNS name {addr} does not resolve ({exc.strerror})"
        except OSError as exc:
            last = f"{addr}:{port} refuses connections ({exc.strerror or exc})"
        if time.monotonic() >= deadline:
            what = "port" if resolved else "DNS name"
            raise TimeoutError(f"master {addr}:{port} not reachable after {timeout:.0f}s "
                               f"(waiting for its {what}): {last}")
        check_stop()
        time.sleep(interval)


class _Node:
    """What one launch holds until it ends: the child, the metrics server, a scratch dir."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []
        self.server = None
        self.scratch: str | None = None
        # A user's script's run, which node 0's launcher made and so ends (the built-in trainer ends its own).
        self.run_env: dict[str, str] | None = None
        self.system_metrics: subprocess.Popen | None = None  # spec.trainer.mlflow.systemMetrics' process

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()  # the port is served again by the next server at once
            self.server = None

    def close(self) -> None:
        self.stop_server()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


class _RankStages:
    """The stage of the ranks this node is about to start (before any of them runs), written
    under the labels each rank's own telemetry will use: rank = node rank x nproc + local rank."""

    def __init__(self, env: dict[str, str]) -> None:
        self.telemetry = []
        try:
            nproc = int(env.get(contract.ENV_NPROC_PER_NODE) or env.get(contract.PET_NPROC_PER_NODE) or "1")
            node_rank = int(env.get(contract.ENV_NODE_RANK, "0"))
        except ValueError:
            return  # e.g. nproc "auto" in a user's own env: torchrun decides, the ranks report alone
        if env.get(contract.ENV_TELEMETRY, "1") == "0":
            return
        os.environ[contract.ENV_METRICS_DIR] = env[contract.ENV_METRICS_DIR]
        from ..telemetry import Telemetry, rank_labels

        self.telemetry = [Telemetry(labels=rank_labels(env, rank=node_rank * nproc + local, local_rank=local,
                                                       node_rank=node_rank)) for local in range(max(1, nproc))]

    def mlflow_run(self, run_id: str, experiment_id: str) -> None:
        """The job's MLflow run on rank 0's series (on node 0): the operator's status.mlflow."""
        if self.telemetry and self.telemetry[0].labels["rank"] == "0":
            self.telemetry[0].mlflow_run(run_id, experiment_id)

    def set(self, stage: str) -> None:
        now = time.time()
        for t in self.telemetry:
            t.set_stage(stage, timestamp=now)


def _serve(args: argparse.Namespace, node: _Node, metrics_dir: str, stacks_dir: str) -> None:
    if not args.metrics_port:
        return
    from ..telemetry import serve_node_endpoint
    try:
        node.server = serve_node_endpoint(args.metrics_port, metrics_dir, stacks_dir=stacks_dir)
    except OSError as exc:  # training matters more than its metrics
        say(f"WARNING metrics port {args.metrics_port} unavailable ({exc}); continuing without metrics")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {contract.LAUNCHER_MODULE}")
    p.add_argument("--master-timeout", type=float,
                   default=float(os.environ.get("DDPJOB_MASTER_TIMEOUT", "600")),
                   help="seconds a worker waits for the master's DNS name and port")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get(contract.ENV_POD_METRICS_PORT, "0")),
                   help="serve this pod's metrics here (0: don't)")
    p.add_argument("--stop-grace", type=float, default=None,
                   help="on SIGTERM/SIGINT, seconds every process of the node gets before SIGKILL "
                        f"(default: {contract.ENV_STOP_GRACE} or {contract.STOP_GRACE_DEFAULT:g})")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.stop_grace is None:
        try:
            args.stop_grace = stop_grace_from_env()
        except ConfigError as exc:
            p.error(str(exc))
    elif args.stop_grace < 0:
        p.error(f"--stop-grace must be >= 0, got {args.stop_grace}")
    return args


def _wait(child: subprocess.Popen, signals: StopSignals, *, poll: float = 1.0) -> int:
    """child.wait(), seeing a stop signal whose Stop was lost within `poll` seconds."""
    while True:
        try:
            return child.wait(timeout=poll)
        except subprocess.TimeoutExpired:
            signals.raise_if_stopped()


def _failed(why: str, code: int) -> int:
    """Say why the node fails before training ran, as its termination message too; the exit code."""
    say(why)
    write_termination(why)
    return code


def _launch(args: argparse.Namespace, node: _Node, signals: StopSignals) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    builtin = not cmd
    cmd = counted(cmd) if cmd else default_command()

    # Fail in seconds, before any rendezvous, when the config is wrong or the image lacks what
    # it turns on.
    if builtin:
        from . import preflight
        from ..config import config_from_env
        try:
            preflight.check(config_from_env())
        except ConfigError as exc:
            return _failed(f"bad configuration: {exc}", EXIT_BAD_CONFIG)

    env = with_exit_guard(dict(os.environ))
    # The ranks learn the grace they have (a last checkpoint must fit in it), and torchrun's agent,
    # which gets the same SIGTERM, must not kill them sooner.
    env[contract.ENV_STOP_GRACE] = f"{args.stop_grace:g}"
    env.setdefault(contract.ENV_TORCHRUN_SHUTDOWN_TIMEOUT, str(math.ceil(args.stop_grace)))
    # The ranks' starting counts from this process's start: the container's, in a pod.
    from ..telemetry import process_start
    env[contract.ENV_NODE_STARTED] = f"{process_start() or time.time():.3f}"
    node_rank = int(env.get(contract.ENV_NODE_RANK, "0"))
    addr, port = env.get(contract.ENV_MASTER_ADDR), int(env.get(contract.ENV_MASTER_PORT, contract.DEFAULT_MASTER_PORT))
    node.scratch = tempfile.mkdtemp(prefix="ddpjob-")
    metrics_dir = env.setdefault(contract.ENV_METRICS_DIR, os.path.join(node.scratch, "metrics"))
    status_dir = env.setdefault(contract.ENV_STATUS_DIR, os.path.join(node.scratch, "status"))
    # Each worker's stack dump and the agent's captures (stacks.py), served at contract.STACKS_PATH.
    stacks_dir = env.setdefault(contract.ENV_STACKS_DIR, os.path.join(node.scratch, "stacks"))
    result_file = env.setdefault(contract.ENV_RESULT_FILE, os.path.join(node.scratch, "result.json"))
    error_file = env.setdefault(contract.ENV_TORCHELASTIC_ERROR_FILE, os.path.join(node.scratch, "error.json"))
    stages = _RankStages(env)
    # The master (pod 0) hosts the c10d rendezvous (PET_RDZV_ENDPOINT is MASTER_ADDR:MASTER_PORT):
    # torchrun's own connect gives up after a few short tries with an error that names no pod, so a
    # node other than 0 first waits here for pod 0's DNS name and port. Not for an endpoint of the
    # user's elsewhere (spec.env wins), nor in a local run (one loopback, the nodes start together),
    # nor in a per-step job (spec.faultTolerance), whose every pod hosts its own.
    if (node_rank != 0 and addr and env.get(contract.ENV_LOCAL) != "1" and not env.get(contract.ENV_FT_LIGHTHOUSE)
            and env.get(contract.PET_RDZV_ENDPOINT, f"{addr}:{port}") == f"{addr}:{port}"):
        stages.set("waiting_for_master")
        say(f"waiting up to {args.master_timeout:.0f}s for master {addr}:{port}")
        # Served while waiting, so a worker stuck here is seen (and named) like any other hang.
        _serve(args, node, metrics_dir, stacks_dir)
        try:
            wait_for_master(addr, port, timeout=args.master_timeout, check_stop=signals.raise_if_stopped)
        except TimeoutError as exc:
            return _failed(str(exc), EXIT_TRAINING_FAILED)
        finally:
            node.stop_server()  # no thread may run while the child is forked (below)
    run_id, failed = runs.mlflow_run(env, node_rank=node_rank, children=node.children, signals=signals,
                                     on_run=stages.mlflow_run)
    if failed:
        return _failed(failed, EXIT_TRAINING_FAILED)
    if run_id and node_rank == 0 and not builtin:
        node.run_env = env
    if env.get(contract.ENV_MLFLOW_SYSTEM_METRICS) == "1" and env.get(contract.ENV_MLFLOW_RUN_ID):
        # One per node (not per rank), a process of its own: its requests never wait in training.
        node.system_metrics = runs.tracking_child(["system-metrics", "--node-id", f"node_{node_rank}"], env,
                                                 children=node.children, stdout=subprocess.DEVNULL, stderr=None)
    stages.set("rendezvous")
    # The child starts before the metrics server's thread does: a fork with no other thread
    # running cannot inherit a lock that thread held.
    child = subprocess.Popen(cmd, env=env, start_new_session=True,
                             preexec_fn=functools.partial(die_with_parent, os.getpid()))
    node.children.append(child)
    _serve(args, node, metrics_dir, stacks_dir)
    code = _wait(child, signals)
    if node.system_metrics is not None:
        end_child(node.system_metrics, seconds=SYSTEM_METRICS_END_SECONDS)   # its last samples go out
    if node.run_env is not None:
        # A user's script may never end the run the launcher made for it (the built-in trainer does).
        runs.run_tracking(["end", "FINISHED" if code == 0 else "FAILED"], env, children=node.children,
                          signals=signals, seconds=runs.MLFLOW_END_SECONDS)
        node.run_env = None
    bad = rank_messages(status_dir, "bad-config")
    if bad:
        write_termination(bad[0])
        return EXIT_BAD_CONFIG
    if code != 0:
        # The built-in trainer records its ranks' failures itself; a user's script may use @record.
        reached = steps_reached(metrics_dir).values()
        why = failure_message(code, rank_messages(status_dir, "failed") or recorded_error(error_file),
                              step=max(reached) if reached else None)
        if why:
            write_termination(why)
        return code if code > 0 else EXIT_TRAINING_FAILED
    if run_id and node_rank == 0:
        name_the_run(result_file, run_id)
    report_result(result_file)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the pod's part of the job and return its exit code (128 + signal when stopped)."""
    debug.delay_launcher_start()  # a test's stand-in for a slow start (off unless set)
    signals = StopSignals().install()  # before anything else: see the package's docstring
    become_subreaper()
    args = _parse(argv)
    node = _Node()
    stop: Stop | None = None
    try:
        code = _launch(args, node, signals)
    except Stop as exc:
        stop, code = exc, 128 + exc.signum
    finally:
        signals.armed = False  # a later signal only hurries the stop below
    stopped_at = time.monotonic()
    if stop is not None:
        say(f"{stop}: stopping every process of this node (SIGKILL after {args.stop_grace:g}s)")
    # After a normal end this only removes what the agent left behind (its workers live in
    # sessions of their own): no orphaned worker outlives its node.
    left = stop_tree(node.children, grace=args.stop_grace if stop else 0.0, hurry=signals.hurry)
    if left:
        say(f"WARNING processes {left} outlived SIGKILL (stuck in the kernel); exiting anyway")
    if stop is not None and node.run_env is not None and not signals.hurry():
        env, node.run_env = node.run_env, None
        runs.end_run_killed(env, children=node.children, signals=signals,
                            seconds=args.stop_grace - (time.monotonic() - stopped_at))
    node.close()
    if stop is not None:
        write_termination(str(stop))
    return code

