"""In-pod launcher: `python -m ddpjob_trainer.launch [opts] -- [CMD ...]`.

What Kubeflow users otherwise bolt on with init containers, done in-process:
1. non-zero node ranks wait (with a deadline) until the master's DNS name resolves and
   its port accepts, so a worker never dies because pod 0 is a second late;
2. one Prometheus endpoint per pod serves every local rank (a shared multiprocess dir);
3. CMD (default: `torchrun -m ddpjob_trainer`, configured by the PET_* env) runs; the exit code
   is 78 when any rank failed on bad configuration.

Stopping (a pod deletion sends SIGTERM; Ctrl-C sends SIGINT) is bounded: the handlers are
installed before anything else (as a container's PID 1 the launcher would otherwise *ignore*
SIGTERM until the kubelet's SIGKILL at the end of terminationGracePeriodSeconds), every process
below the launcher (torchrun's agent and its workers, which torchrun puts in sessions of their
own, and any orphan re-parented to the launcher) gets SIGTERM, then SIGKILL after
`--stop-grace` seconds (DDPJOB_STOP_GRACE_SECONDS, which the operator derives from the pod's
terminationGracePeriodSeconds; default 5). The ranks are told the grace they got (the built-in
trainer saves a last checkpoint in it when that fits: preempt.py). Exit code 128 + signal:
143 for SIGTERM, 130 for SIGINT.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

from . import contract
from .errors import EXIT_BAD_CONFIG, EXIT_TRAINING_FAILED, ConfigError
from .tracking import SYSTEM_METRICS_END_SECONDS

TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LIMIT = 4000  # characters; the kubelet truncates a termination message at 4096 bytes
DEFAULT_STOP_GRACE = contract.STOP_GRACE_DEFAULT
# After SIGKILL, how long to wait for processes to vanish before giving up on them (one stuck
# in uninterruptible kernel sleep cannot be reaped; waiting longer would only hang the caller).
KILL_WAIT = contract.LAUNCHER_KILL_WAIT
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Finding or creating the job's MLflow run before torchrun starts: importing MLflow takes seconds on
# a loaded node, a request at most 5 s (tracking.HTTP_DEFAULTS), and there are a few.
MLFLOW_SECONDS = 60.0
MLFLOW_RETRY_SECONDS = 20.0  # within it, how long node 0 tries again (a busy or restarting server)
MLFLOW_PEER_WAIT_SECONDS = 30.0  # ... and a node other than 0 looks for node 0's run
MLFLOW_END_SECONDS = 30.0  # ending a user's script's run that it left RUNNING
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# A sitecustomize that frees a run's process group before interpreter finalization (why: its
# docstring); first on every child's PYTHONPATH.
EXIT_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exitguard")


def _say(msg: str) -> None:
    print(f"[ddpjob-launch node {os.environ.get('NODE_RANK', '?')}] {msg}", file=sys.stderr, flush=True)


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
            with socket.create_connection(infos[0][4][:2], timeout=min(5.0, interval * 5)):
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


def _load_prctl() -> Callable[..., int] | None:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux (glibc)


# Resolved once in the parent: a preexec_fn runs between fork and exec, where dlopen (taking
# locks another thread of the parent may have held at fork time) could deadlock the child.
_prctl = _load_prctl()


def die_with_parent(parent: int | None = None) -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies, even by SIGKILL (Linux).

    With `parent` (the caller's pid, e.g. `functools.partial(die_with_parent, os.getpid())`), a
    parent that died before the prctl took effect kills the child at once instead of leaving it.
    Elsewhere Ctrl-C and SIGTERM still stop the group; a SIGKILLed parent may not.
    """
    if _prctl is None:
        return
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def become_subreaper() -> bool:
    """Orphans below this process (torchrun's workers once their agent is gone) are re-parented
    to it instead of init, so `stop_tree` still finds them. False where unsupported."""
    return _prctl is not None and _prctl(_PR_SET_CHILD_SUBREAPER, 1) == 0


class Stop(BaseException):
    """A stop signal arrived. A BaseException (like KeyboardInterrupt) so that no `except
    Exception` on the way swallows it before the process tree is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopSignals:
    """SIGTERM/SIGINT handling: the first signal raises Stop in the main thread while `armed`
    (disarm around cleanup that must not be interrupted); every later one only hurries the
    shutdown (no more grace)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self.armed = True

    def install(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
        if self.armed and self.count == 1:
            raise Stop(signum)

    def raise_if_stopped(self) -> None:
        """Raise Stop again for a signal that already arrived. The handler's own raise can be
        lost: when the signal lands while Python runs a weakref callback or __del__ (an import's
        module-lock cleanup, say), the exception is printed as "Exception ignored" and dropped,
        and the launcher would wait on until SIGKILL. Blocking waits call this between tries."""
        if self.signum is not None and self.armed:
            raise Stop(self.signum)

    def hurry(self) -> bool:
        """True once a second signal arrived (Ctrl-C pressed again): skip what is left of the grace."""
        return self.count > 1

    @property
    def exit_code(self) -> int | None:
        """128 + the first signal's number (130 SIGINT, 143 SIGTERM), None when none arrived."""
        return None if self.signum is None else 128 + self.signum


def stop_grace_from_env(env=os.environ) -> float:
    """DDPJOB_STOP_GRACE_SECONDS (default 5; the operator sets it from the pod's
    terminationGracePeriodSeconds): seconds between SIGTERM and SIGKILL on a stop."""
    raw = env.get(contract.ENV_STOP_GRACE, "")
    try:
        value = float(raw) if raw else DEFAULT_STOP_GRACE
    except ValueError:
        raise ConfigError(f"{contract.ENV_STOP_GRACE}: not a number of seconds: {raw!r}") from None
    if value < 0:
        raise ConfigError(f"{contract.ENV_STOP_GRACE}: must be >= 0, got {raw!r}")
    return value


def _proc_table() -> dict[int, tuple[int, str]] | None:
    """pid -> (parent pid, state letter) of every process; None without /proc (not Linux)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    table = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, the last ")" ends it.
        fields = data[data.rfind(b")") + 2:].split()
        table[int(name)] = (int(fields[1]), fields[0].decode())
    return table


def descendants(root: int, table: dict[int, tuple[int, str]] | None = None) -> dict[int, str]:
    """Every process below `root` (children, grandchildren, ...) -> its state letter ("Z": zombie)."""
    table = _proc_table() if table is None else table
    if not table:
        return {}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = table[pid][1]
            todo.extend(children.get(pid, []))
    return found


def _signal_all(pids, groups, sig: int) -> None:
    """`sig` once to each process: the groups, then the pids outside them. Twice would be a second
    Ctrl-C to a launcher (StopSignals.hurry: SIGKILL at once, no grace for a rank to end its run)."""
    done: set[int] = set()
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
            done.add(pgid)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            if os.getpgid(pid) not in done:
                os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _live_below(me: int, keep: set[int], roots: set[int], owned: Callable[[int], bool] | None) -> list[int]:
    """Live (non-zombie) processes below `me` — with `owned`, only those below one of `roots` or
    for which owned(pid) holds. Reaps zombie children that no Popen object owns (orphans
    re-parented to this subreaper), never those in `keep` (Popen reaps its own)."""
    table = _proc_table()
    below = descendants(me, table)
    if owned is not None:
        mine = set().union(*(descendants(r, table) for r in roots)) if roots else set()
        below = {p: st for p, st in below.items() if p in roots or p in mine or owned(p)}
    live = []
    for pid, state in below.items():
        if state != "Z":
            live.append(pid)
        elif table[pid][0] == me and pid not in keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return live


def stop_tree(children: Sequence[subprocess.Popen], *, grace: float, hurry: Callable[[], bool] = lambda: False,
              owned: Callable[[int], bool] | None = None, kill_wait: float = KILL_WAIT) -> list[int]:
    """Stop every process below this one: SIGTERM, up to `grace` seconds to exit, then SIGKILL.

    `children` are this process's Popen children, each the leader of its own session: their
    groups are signalled too (all that works without /proc), and they are polled, never reaped
    behind Popen's back. With `owned`, other processes below this one are only touched when they
    descend from `children` or owned(pid) is true (e.g. they carry the run's environment: orphans
    re-parented here). Processes forked while stopping are signalled as they appear. Bounded:
    returns within about grace + kill_wait seconds whatever the processes do, with the pids
    still there then (stuck in uninterruptible kernel sleep), normally [].
    """
    me = os.getpid()
    keep = {c.pid for c in children}
    groups = [c.pid for c in children if c.poll() is None]

    def alive() -> list[int]:
        running = {c.pid for c in children if c.poll() is None}
        return sorted(running.union(_live_below(me, keep, keep, owned)))

    pids = alive()
    _signal_all(pids, groups, signal.SIGTERM)
    signalled = set(pids)
    until = time.monotonic() + grace
    while pids and time.monotonic() < until and not hurry():
        time.sleep(0.05)
        pids = alive()
        fresh = [p for p in pids if p not in signalled]
        _signal_all(fresh, (), signal.SIGTERM)
        signalled.update(fresh)
    until = time.monotonic() + kill_wait
    while pids:
        _signal_all(pids, groups, signal.SIGKILL)
        if time.monotonic() >= until:
            return pids
        time.sleep(0.05)
        pids = alive()
    return []


def _write_termination(msg: str) -> None:
    try:
        with open(TERMINATION_LOG, "w") as f:
            f.write(msg[-TERMINATION_LIMIT:])
    except OSError:
        pass  # not in a pod, or no termination log mounted


def with_exit_guard(env: dict[str, str]) -> dict[str, str]:
    """`env` with EXIT_GUARD first on PYTHONPATH, the rest (the user's own entries) kept in order."""
    rest = [p for p in env["PYTHONPATH"].split(os.pathsep) if p != EXIT_GUARD] if env.get("PYTHONPATH") else []
    return {**env, "PYTHONPATH": os.pathsep.join([EXIT_GUARD, *rest])}


def default_command() -> list[str]:
    """torchrun (as ddpjob_trainer.agent: counted, attributed restarts in place) with the built-in
    trainer; torchrun reads PET_NNODES, PET_RDZV_*, PET_MAX_RESTARTS, ... itself."""
    return [sys.executable, "-m", "ddpjob_trainer.agent", "-m", "ddpjob_trainer"]


def _rank_messages(status_dir: str, kind: str) -> list[str]:
    """What the ranks of this node recorded under `kind` (bad-config, failed), by file name."""
    if not os.path.isdir(status_dir):
        return []
    paths = [os.path.join(status_dir, n) for n in os.listdir(status_dir) if n.startswith(f"{kind}-rank-")]
    out = []
    # Oldest first: the rank that failed first is the likely cause, the others its casualties.
    for path in sorted(paths, key=lambda p: (os.stat(p).st_mtime_ns, p)):
        with open(path, errors="replace") as f:
            out.append(f.read().strip())
    return out


def recorded_error(path: str) -> list[str]:
    """The exception that torch.distributed.elastic's @record wrote to `path` (directly, or copied
    there by torchrun from the first failed worker): its traceback, else its message. Empty when
    nothing was recorded (an entrypoint without @record, a crash) or the file is not that JSON."""
    try:
        with open(path, errors="replace") as f:
            data = json.load(f)
        message = data["message"]
    except (OSError, ValueError, TypeError, KeyError):
        return []
    if isinstance(message, str):
        return [message.strip()] if message.strip() else []
    if not isinstance(message, dict):
        return []
    extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
    detail = extra.get("py_callstack") or message.get("message")
    return [str(detail).strip()] if detail and str(detail).strip() else []


def failure_message(code: int, failed: list[str], *, limit: int = TERMINATION_LIMIT) -> str | None:
    """The termination message of a node whose training exited with `code`: the first line says
    so, the rest is the end of the first failed rank's traceback (its last line names the error),
    cut to `limit` characters — the kubelet keeps 4 KiB, and the start of a traceback matters least.
    None when no rank recorded why (a user's script without @record, a crash, torchrun itself): the pod's
    terminationMessagePolicy (FallbackToLogsOnError) then has the kubelet keep the log's tail."""
    if not failed:
        return None
    head = f"training exited with code {code}"
    detail = failed[0]
    room = limit - len(head) - len("\n...")
    return head + "\n" + (detail if len(detail) <= room else "..." + detail[-room:])


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
            nproc = int(env.get("NPROC_PER_NODE") or env.get(contract.PET_NPROC_PER_NODE) or "1")
            node_rank = int(env.get("NODE_RANK", "0"))
        except ValueError:
            return  # e.g. nproc "auto" in a user's own env: torchrun decides, the ranks report alone
        if env.get(contract.ENV_TELEMETRY, "1") == "0":
            return
        os.environ[contract.ENV_METRICS_DIR] = env[contract.ENV_METRICS_DIR]
        from .telemetry import Telemetry

        for local in range(max(1, nproc)):
            labels = {"ddpjob": env.get(contract.ENV_JOB_NAME, "local"), "namespace": env.get(contract.ENV_JOB_NAMESPACE, ""),
                      "rank": str(node_rank * nproc + local), "local_rank": str(local),
                      "node_rank": str(node_rank)}
            self.telemetry.append(Telemetry(labels=labels))

    def set(self, stage: str) -> None:
        now = time.time()
        for t in self.telemetry:
            t.set_stage(stage, timestamp=now)


def _serve(args: argparse.Namespace, node: _Node, metrics_dir: str) -> None:
    if not args.metrics_port:
        return
    from .telemetry import serve_node_endpoint
    try:
        node.server = serve_node_endpoint(args.metrics_port, metrics_dir)
    except OSError as exc:  # training matters more than its metrics
        _say(f"WARNING metrics port {args.metrics_port} unavailable ({exc}); continuing without metrics")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddpjob_trainer.launch")
    p.add_argument("--master-timeout", type=float,
                   default=float(os.environ.get("DDPJOB_MASTER_TIMEOUT", "600")),
                   help="seconds a worker waits for the master's DNS name and port")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get(contract.ENV_POD_METRICS_PORT, "0")),
                   help="serve this pod's metrics here (0: don't)")
    p.add_argument("--stop-grace", type=float, default=None,
                   help="on SIGTERM/SIGINT, seconds every process of the node gets before SIGKILL "
                        f"(default: {contract.ENV_STOP_GRACE} or {DEFAULT_STOP_GRACE:g})")
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


def _launch(args: argparse.Namespace, node: _Node, signals: StopSignals) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    builtin = not cmd
    cmd = cmd or default_command()

    # Fail in seconds, before any rendezvous, when the config is wrong or the image lacks what
    # it turns on.
    if builtin:
        from . import preflight
        from .config import config_from_env
        try:
            preflight.check(config_from_env())
        except ConfigError as exc:
            msg = f"bad configuration: {exc}"
            _say(msg)
            _write_termination(msg)
            return EXIT_BAD_CONFIG

    env = with_exit_guard(dict(os.environ))
    # The ranks learn the grace they have (a last checkpoint must fit in it), and torchrun's agent,
    # which gets the same SIGTERM, must not kill them sooner.
    env[contract.ENV_STOP_GRACE] = f"{args.stop_grace:g}"
    env.setdefault(contract.ENV_TORCHRUN_SHUTDOWN_TIMEOUT, str(math.ceil(args.stop_grace)))
    node_rank = int(env.get("NODE_RANK", "0"))
    addr, port = env.get("MASTER_ADDR"), int(env.get("MASTER_PORT", "29500"))
    node.scratch = tempfile.mkdtemp(prefix="ddpjob-")
    metrics_dir = env.setdefault(contract.ENV_METRICS_DIR, os.path.join(node.scratch, "metrics"))
    status_dir = env.setdefault(contract.ENV_STATUS_DIR, os.path.join(node.scratch, "status"))
    result_file = env.setdefault(contract.ENV_RESULT_FILE, os.path.join(node.scratch, "result.json"))
    error_file = env.setdefault(contract.ENV_TORCHELASTIC_ERROR_FILE, os.path.join(node.scratch, "error.json"))
    stages = _RankStages(env)
    # The master (pod 0) hosts the c10d rendezvous (PET_RDZV_ENDPOINT is MASTER_ADDR:MASTER_PORT):
    # torchrun's own connect gives up after a few short tries with an error that names no pod, so a
    # node other than 0 first waits here for pod 0's DNS name and port. Not for an endpoint of the
    # user's elsewhere (spec.env wins), nor in a local run (one loopback, the nodes start together).
    if (node_rank != 0 and addr and env.get(contract.ENV_LOCAL) != "1"
            and env.get(contract.PET_RDZV_ENDPOINT, f"{addr}:{port}") == f"{addr}:{port}"):
        stages.set("waiting_for_master")
        _say(f"waiting up to {args.master_timeout:.0f}s for master {addr}:{port}")
        # Served while waiting, so a worker stuck here is seen (and named) like any other hang.
        _serve(args, node, metrics_dir)
        try:
            wait_for_master(addr, port, timeout=args.master_timeout, check_stop=signals.raise_if_stopped)
        except TimeoutError as exc:
            _say(str(exc))
            _write_termination(str(exc))
            return EXIT_TRAINING_FAILED
        finally:
            node.stop_server()  # no thread may run while the child is forked (below)
    run_id, failed = _mlflow_run(env, node_rank=node_rank, node=node, signals=signals, stages=stages)
    if failed:
        _say(failed)
        _write_termination(failed)
        return EXIT_TRAINING_FAILED
    if run_id and node_rank == 0 and not builtin:
        node.run_env = env
    if env.get(contract.ENV_MLFLOW_SYSTEM_METRICS) == "1" and env.get(contract.ENV_MLFLOW_RUN_ID):
        # One per node (not per rank), a process of its own: its requests never wait in training.
        node.system_metrics = _tracking_child(["system-metrics", "--node-id", f"node_{node_rank}"], env, node=node,
                                              stdout=subprocess.DEVNULL, stderr=None)
    stages.set("rendezvous")
    # The child starts before the metrics server's thread does: a fork with no other thread
    # running cannot inherit a lock that thread held.
    child = subprocess.Popen(cmd, env=env, start_new_session=True,
                             preexec_fn=functools.partial(die_with_parent, os.getpid()))
    node.children.append(child)
    _serve(args, node, metrics_dir)
    code = _wait(child, signals)
    if node.system_metrics is not None:
        _end_child(node.system_metrics, seconds=SYSTEM_METRICS_END_SECONDS)   # its last samples go out
    if node.run_env is not None:
        # A user's script may never end the run the launcher made for it (the built-in trainer does).
        _run_tracking(["end", "FINISHED" if code == 0 else "FAILED"], env, node=node, signals=signals,
                      seconds=MLFLOW_END_SECONDS)
        node.run_env = None
    bad = _rank_messages(status_dir, "bad-config")
    if bad:
        _write_termination(bad[0])
        return EXIT_BAD_CONFIG
    if code != 0:
        # The built-in trainer records its ranks' failures itself; a user's script may use @record.
        msg = failure_message(code, _rank_messages(status_dir, "failed") or recorded_error(error_file))
        if msg:
            _write_termination(msg)
        return code if code > 0 else EXIT_TRAINING_FAILED
    if run_id and node_rank == 0 and not os.path.exists(result_file):
        # A user's script writes no result: the run is the one thing node 0 knows (the local runner's summary).
        with open(result_file, "w") as f:
            json.dump({"mlflow_run_id": run_id}, f)
    _report_result(result_file)
    return 0


def _run_tracking(args: list[str], env: dict[str, str], *, node: _Node, signals: StopSignals,
                  seconds: float, while_stopping: bool = False) -> tuple[str | None, str]:
    """`python -m ddpjob_trainer.tracking ARGS` within `seconds`: (its stdout, None) or (None, why not).
    A child process: MLflow's import may start threads, and torchrun is forked with none running.
    `while_stopping`: it ignores SIGTERM/SIGINT, which whatever stops this launcher (the local runner
    signals every process that appears below it) would send it too; `seconds` still bounds it."""
    child = _tracking_child(args, env, node=node, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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


def _tracking_child(args: list[str], env: dict[str, str], *, node: _Node, stdout: int, stderr: int | None,
                    while_stopping: bool = False) -> subprocess.Popen:
    """`python -m ddpjob_trainer.tracking ARGS` started as one of this node's children (in a session
    of its own, dying with the launcher)."""
    child = subprocess.Popen([sys.executable, "-m", "ddpjob_trainer.tracking", *args], env=env, text=True,
                             stdout=stdout, stderr=stderr, start_new_session=True,
                             preexec_fn=functools.partial(_tracking_child_setup, os.getpid(), while_stopping))
    node.children.append(child)
    return child


def _tracking_child_setup(parent: int, ignore_stops: bool) -> None:
    die_with_parent(parent)
    if ignore_stops:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if _prctl is not None:  # a SIGTERM when the launcher dies would be ignored now
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _mlflow_run(env: dict[str, str], *, node_rank: int, node: _Node, signals: StopSignals,
                stages: _RankStages) -> tuple[str | None, str | None]:
    """The job's MLflow run into env[MLFLOW_RUN_ID] for every rank of this node, so that a user's
    plain `mlflow` calls log into it (the built-in trainer resumes it): node 0 finds it by the job's
    tag or creates it, the other nodes look it up (node 0 created it before its torchrun opened the
    master port they waited for). Bounded; no run is a warning, unless spec.trainer.mlflow.required:
    then (None, why the attempt fails). Nothing to do for a job that does not track (DDPJOB_MLFLOW
    unset), or with MLFLOW_RUN_ID set (spec.env's, or the user's own shell under the local runner)."""
    if not env.get(contract.ENV_MLFLOW) or not env.get(contract.ENV_MLFLOW_TRACKING_URI) or env.get(contract.ENV_MLFLOW_RUN_ID):
        return None, None
    uri = contract.public_uri(env[contract.ENV_MLFLOW_TRACKING_URI])
    args = (["resolve", "--create", "--wait", str(MLFLOW_RETRY_SECONDS)] if node_rank == 0
            else ["resolve", "--wait", str(MLFLOW_PEER_WAIT_SECONDS)])
    out, why = _run_tracking(args, env, node=node, signals=signals, seconds=MLFLOW_SECONDS)
    try:
        found = json.loads(out or "")
        run_id, exp_id = str(found["run_id"]), str(found["experiment_id"])
    except (ValueError, KeyError, TypeError):
        why = why or f"unexpected answer {out!r}"
        if env.get(contract.ENV_MLFLOW) == "required":
            return None, f"spec.trainer.mlflow.required: no MLflow run at {uri}: {why}"
        _say(f"WARNING MLflow: no run at {uri} ({why}); training goes on without {contract.ENV_MLFLOW_RUN_ID}")
        return None, None
    env[contract.ENV_MLFLOW_RUN_ID] = run_id
    if node_rank == 0 and stages.telemetry:
        stages.telemetry[0].mlflow_run(run_id, exp_id)  # rank 0's series: the operator's status.mlflow
    _say(f"MLflow run {run_id} (experiment {exp_id}) at {uri}")
    return run_id, None


def _end_child(child: subprocess.Popen, *, seconds: float) -> None:
    """SIGTERM to a side process of the launcher's, SIGKILL to its session after `seconds`; bounded
    even when it is stuck in the kernel (an NVML call on a lost GPU): then stop_tree reports it."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            try:
                child.wait(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                pass


def _end_run_killed(node: _Node, signals: StopSignals, *, seconds: float) -> None:
    """A stopped job's user script left its run RUNNING (it had its grace to end it): end it KILLED,
    after the script is gone (so nothing logs into it after) and within what is left of the grace."""
    env, node.run_env = node.run_env, None
    if env is None:
        return
    run = env[contract.ENV_MLFLOW_RUN_ID]
    if seconds < 1.0:
        _say(f"WARNING MLflow: run {run} left RUNNING (no time left in the stop grace to end it KILLED)")
        return
    out, why = _run_tracking(["end", "KILLED"], env, node=node, signals=signals, seconds=seconds,
                             while_stopping=True)
    if why:
        _say(f"WARNING MLflow: run {run} not ended KILLED ({why})")
    elif '"ended": true' in (out or ""):
        _say(f"MLflow run {run} ended KILLED")


def _report_result(path: str) -> None:
    """Rank 0's result (final eval, steps, resumed-from step) as the termination message: the run's
    last numbers come after the last metrics scrape, and the operator reads them from there into
    status.result. Other nodes, and user scripts that write no result, leave it empty."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return
    if text.strip() and len(text) <= 4000:
        _write_termination(text.strip())


def main(argv: list[str] | None = None) -> int:
    """Run the pod's part of the job and return its exit code (128 + signal when stopped)."""
    signals = StopSignals().install()  # before anything else: see the module docstring
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
        _say(f"{stop}: stopping every process of this node (SIGKILL after {args.stop_grace:g}s)")
    # After a normal end this only removes what the agent left behind (its workers live in
    # sessions of their own): no orphaned worker outlives its node.
    left = stop_tree(node.children, grace=args.stop_grace if stop else 0.0, hurry=signals.hurry)
    if left:
        _say(f"WARNING processes {left} outlived SIGKILL (stuck in the kernel); exiting anyway")
    if stop is not None and node.run_env is not None and not signals.hurry():
        _end_run_killed(node, signals, seconds=args.stop_grace - (time.monotonic() - stopped_at))
    node.close()
    if stop is not None:
        _write_termination(str(stop))
    return code


if __name__ == "__main__":
    sys.exit(main())
