"""`ddpjob run FILE --local`: the DDPJob's nodes as processes on this machine.

Each simulated node is the same in-pod launcher the operator's pods run, with the env
from `envvars.pod_env` (MASTER_ADDR=127.0.0.1) and the pod's command (`pods.container_command`).
When a node fails, the operator's own decision (`lifecycle.decide`, via `localpolicy`) says what
next: restart the whole group (resuming from the checkpoint) within failurePolicy.maxRestarts, or
fail at once (exit code 78: bad configuration; activeDeadlineSeconds passed). Progress and health come from scraping the nodes' metrics,
with the same parsing and health logic the operator uses; so do the restarts in place (a worker
that died and was restarted where it is, every node's workers with it), which `Books` records and
logs as the operator's restartHistory and events do (decisions/inplace.py), and where the run's
time went (decisions/goodput.py), which the summary and its last line carry.

Ctrl-C (SIGINT) and SIGTERM stop the run within seconds, whatever the nodes are doing
(importing torch, training, writing a checkpoint): every process below the runner gets
SIGTERM, then SIGKILL after DDPJOB_STOP_GRACE_SECONDS (default 5); a second Ctrl-C skips the
rest of the grace. The exit code is 128 + the signal: 130 for SIGINT, 143 for SIGTERM; the
summary's phase is "Interrupted". The runner is a child subreaper, so a worker orphaned by its
torchrun agent (which gives workers sessions of their own) is still found and stopped.
"""
from __future__ import annotations

import copy
import datetime as dt
import functools
import hashlib
import http.client
import importlib.util
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import click
import psutil
import yaml

from ddpjob_api import contract, names
from ddpjob_api.contract import EXIT_BAD_CONFIG
from ddpjob_api.phases import FailReason, Phase, Signal
from ddpjob_trainer.launch import (ConfigError, Stop, StopSignals, become_subreaper, check_trainer_config, die_with_parent,
                                   rank_messages, stop_grace_from_env, stop_tree)

from ddpjob_operator.builders import envvars, pods
from ddpjob_operator.builders.lighthouse import lighthouse_command
from ddpjob_api.spec import JobSpec, from_manifest
from ddpjob_operator.decisions import goodput, inplace

from .localpolicy import Tally, after_failure, next_tally

SCRAPE_INTERVAL = 1.0
LOOPBACK = "127.0.0.1"


class LocalRunError(Exception):
    """The file cannot be run (not a DDPJob, invalid spec): nothing was started."""


def load_job_file(path: str | os.PathLike) -> dict[str, Any]:
    """The first DDPJob document in a YAML file."""
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except yaml.YAMLError as exc:
        raise LocalRunError(f"{path}: not valid YAML ({exc})") from None
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "DDPJob":
            return doc
    raise LocalRunError(f"{path}: no document with kind: DDPJob")


def validate(obj: dict[str, Any]) -> JobSpec:
    """The same schema and rules as the API server, plus the trainer config; raise naming the field."""
    from ddpjob_api.validation import apply_defaults, validate_manifest

    obj.setdefault("metadata", {}).setdefault("name", "local")
    errors = validate_manifest(obj)
    if errors:
        raise LocalRunError("invalid DDPJob:\n  " + "\n  ".join(errors))
    job = from_manifest(apply_defaults(obj))
    if job.uses_builtin_trainer:
        try:
            check_trainer_config(job.trainer)
        except ConfigError as exc:
            raise LocalRunError(f"invalid DDPJob: {exc}") from None
    return job


def require_trainer(job: JobSpec) -> None:
    """The built-in trainer's packages are an extra (`pip install ddpjob` is the CLI and operator):
    say which to install before any node starts, not in a node's traceback. They are the
    distributions of the `trainer` extra (pyproject, their one list) not installed here."""
    if not job.uses_builtin_trainer:
        return
    try:
        requires = metadata.requires("ddpjob") or []
    except metadata.PackageNotFoundError:  # imported from a source tree, not installed
        requires = ['torch; extra == "trainer"']
    wanted = [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in requires
              if re.search(r"""extra\s*==\s*["']trainer["']""", r)]
    missing = []
    for name in wanted:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise LocalRunError(f"the built-in trainer needs {', '.join(missing)}, not installed here: "
                            "pip install 'ddpjob[trainer]'")


_EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICK = 10000  # below the usual well-known service ports people run locally


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive unused loopback ports.

    Picked below the kernel's ephemeral range when there is room: a port from that range (what
    bind(0) returns) can be taken as the source port of any outgoing connection between this check
    and the node's own bind, which then fails (seen in CI: a node's metrics port lost that way).
    """
    rng = random.SystemRandom()
    top = _ephemeral_low() - count
    if top > _LOWEST_PICK:
        for _ in range(500):
            base = rng.randrange(_LOWEST_PICK, top)
            if all(_bindable(p) for p in range(base, base + count)):
                return base
    for _ in range(500):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if all(_bindable(p) for p in range(base, base + count)):
            return base
    raise LocalRunError(f"no {count} consecutive free loopback port(s)")


def free_port() -> int:
    """An unused TCP port on loopback (see free_ports)."""
    return free_ports(1)


def local_trainer_config(trainer: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Absolute checkpoint dirs (a PVC mount in a pod) move under the workdir on a laptop."""
    trainer = copy.deepcopy(trainer)
    ck = trainer.get("checkpoint")
    if ck and ck.get("dir"):
        d = Path(ck["dir"])
        ck["dir"] = str(workdir / d.relative_to(d.anchor) if d.is_absolute() else workdir / d)
    return trainer


@dataclass
class Attempt:
    """The outcome of running the group once."""

    ok: bool
    exit_code: int = 0
    failed_rank: int | None = None
    interrupted: bool = False
    result: dict[str, Any] = field(default_factory=dict)
    returncodes: dict[int, int | None] = field(default_factory=dict)  # per node rank; None: running
    replaced: int = 0  # nodes of a per-step job replaced alone (spec.faultTolerance)
    failed_log: Path | None = None  # the failed node's log (a replaced node's is its replacement's)


def node_command(job: JobSpec, *, metrics_port: int) -> list[str]:
    """What the job's pods run (pods.container_command, the one command builder: `launcher: false`
    and spec.args mean the same here), with this environment's Python and this node's port."""
    command, args = pods.container_command(job)
    launcher = pods.LAUNCHER
    if command[:len(launcher)] == launcher:
        command = [sys.executable, *launcher[1:-1], "--metrics-port", str(metrics_port), "--",
                   *command[len(launcher):]]
    return command + list(args or [])


def status_dir(workdir: Path, attempt: int, rank: int) -> Path:
    """Where node `rank`'s ranks record why they failed in an attempt (contract.ENV_STATUS_DIR)."""
    return workdir / "status" / f"attempt-{attempt}" / f"node-{rank}"


def local_uid(job: JobSpec, workdir: Path) -> str:
    """DDPJOB_UID of a local run: the same for every attempt, and for a later run with the same
    --workdir (which resumes its checkpoints, and so its MLflow run)."""
    digest = hashlib.sha256(f"{job.namespace}/{job.name}\0{workdir.resolve()}".encode()).hexdigest()
    return f"local-{digest[:24]}"


def node_env(job: JobSpec, rank: int, *, master_port: int, metrics_port: int, attempt: int,
             workdir: Path, result_file: Path, lighthouse: str | None = None) -> dict[str, str]:
    """os.environ + exactly the operator's pod env, pointed at loopback (a per-step job's: at the
    local Lighthouse, `lighthouse`, each node its own master port: each is a torchrun world)."""
    env = dict(os.environ)
    ft: dict[str, Any] = {"ft_host": LOOPBACK, "ft_lighthouse": lighthouse} if lighthouse else {}
    env.update(envvars.env_dict(envvars.pod_env(
        job, rank, master_addr=LOOPBACK, master_port=master_port,
        metrics_port=metrics_port, attempt=attempt, rdma_devices=False, **ft)))
    if job.uses_builtin_trainer:
        env[contract.ENV_TRAINER_CONFIG] = json.dumps(local_trainer_config(job.trainer, workdir))
    env[contract.ENV_RESULT_FILE] = str(result_file)
    env[contract.ENV_LOCAL] = "1"
    # c10d numbers the nodes in the order of their addresses (then agent pids), and every local node
    # has the same host name: each gets its own loopback address, ordered like the node ranks
    # (127.0.0.101, .102, ...: equal lengths sort as numbers), so rank r runs on node r as in pods.
    env[contract.PET_LOCAL_ADDR] = f"127.0.0.{101 + rank}"
    # A local job has no API server's uid: its name and work dir are what a resume shares.
    if not job.uid:
        env[contract.ENV_JOB_UID] = local_uid(job, workdir)
    # `torchrun` in a user's command must be this environment's.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    # N processes sharing this machine's cores: one thread pool each would oversubscribe.
    env.setdefault(contract.ENV_OMP_THREADS, str(max(1, (os.cpu_count() or 1) // job.world_size)))
    return env


def _in_workdir(pid: int, workdir: Path) -> bool:
    """The process carries this run's DDPJOB_RESULT_FILE (one under `workdir`)."""
    try:
        return psutil.Process(pid).environ().get(contract.ENV_RESULT_FILE, "").startswith(f"{workdir}{os.sep}")
    except psutil.Error:
        return False


def _stop_nodes(nodes: list[subprocess.Popen], *, workdir: Path, signals: StopSignals, grace: float,
                display: "Display") -> None:
    """Stop every node's launcher and everything below it (bounded); a signal meanwhile only hurries it.

    Besides the nodes' trees, any process re-parented to the runner that carries this run's
    DDPJOB_RESULT_FILE (a worker whose agent and launcher died first) is stopped; nothing else
    the caller of run_local may have started is touched."""
    signals.armed = False
    try:
        left = stop_tree(nodes, grace=grace, hurry=signals.hurry,
                         owned=functools.partial(_in_workdir, workdir=workdir))
        if left:
            display.say(f"WARNING processes {left} outlived SIGKILL (stuck in the kernel); not waiting for them")
    finally:
        signals.armed = True


def _stop_node(node: subprocess.Popen, rank: int, *, workdir: Path) -> None:
    """What a failed node left (its tree, and its orphans: processes of this run with its NODE_RANK),
    before it is replaced; the other nodes are not touched."""
    def orphan(pid: int) -> bool:
        try:
            env = psutil.Process(pid).environ()
        except psutil.Error:
            return False
        return env.get(contract.ENV_RESULT_FILE, "").startswith(f"{workdir}{os.sep}") and \
            env.get(contract.ENV_NODE_RANK) == str(rank)
    stop_tree([node], grace=0.0, owned=orphan)


class LocalLighthouse:
    """A per-step job's torchft Lighthouse as a process on loopback, with the command and quorum
    timing of the operator's Lighthouse pod (builders.lighthouse), this environment's Python and two
    free ports (the Lighthouse's and, the next one, its id's). Kept up as the operator keeps its pod:
    one that exits is started again at the same address (keep_up), and the groups' next quorum
    reaches the new one (its quorum ids are told apart by its id: ddpjob_trainer.lighthouse)."""

    def __init__(self, job: JobSpec, *, workdir: Path) -> None:
        if importlib.util.find_spec("torchft") is None:
            raise LocalRunError(f"spec.faultTolerance needs torchft, not installed in {sys.executable}: "
                                "pip install 'ddpjob[trainer]' (torchft 0.2.0: CPython 3.11 on x86_64)")
        port = free_ports(2)
        self.cmd = lighthouse_command(job)
        self.cmd[0] = sys.executable
        self.cmd[self.cmd.index("--bind") + 1] = f"{LOOPBACK}:{port}"
        self.cmd[self.cmd.index("--id-bind") + 1] = f"{LOOPBACK}:{port + 1}"
        self.url = f"http://{LOOPBACK}:{port}"
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.started = 0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        name = "lighthouse.log" if not self.started else f"lighthouse-{self.started}.log"
        self.started += 1
        self.next_start = time.monotonic() + 1.0
        with open(self.logs / name, "wb") as log:
            return subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True,
                                    preexec_fn=functools.partial(die_with_parent, os.getpid()))

    def keep_up(self, say: Callable[[str], None]) -> None:
        """Start it again if it exited, at most once a second (one that cannot start is not
        started in a tight loop: the groups' quorums time out, and their nodes fail)."""
        code = self.proc.poll()
        if code is not None and time.monotonic() >= self.next_start:
            say(f"the Lighthouse exited with code {code}: starting it again at {self.url} "
                f"(log {self.logs}/lighthouse-{self.started}.log)")
            self.proc = self._start()

    def stop(self) -> None:
        stop_tree([self.proc], grace=0.0, owned=lambda pid: False)


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None:
        return "(no log)"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# A node's metrics or stacks read that fails is one missed read, never the runner's end: refused,
# timed out, not parseable, or cut short (http.client.IncompleteRead: its launcher exited mid-answer).
READ_ERRORS = (OSError, ValueError, http.client.HTTPException)


def stall_stacks(ports: list[int]) -> str:
    """Every rank's newest captured stack (its agent's, contract.STACKS_PATH of each node), as the
    operator keeps them in a job's ConfigMap: what the runner prints on a stall."""
    newest: dict[int, tuple[dict, int]] = {}
    for node, port in enumerate(ports):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{contract.STACKS_PATH}", timeout=2) as r:
                records = json.loads(r.read().decode())
        except READ_ERRORS:
            continue
        for rec in records if isinstance(records, list) else []:
            rank = rec.get("rank") if isinstance(rec, dict) else None
            if isinstance(rank, int) and (rank not in newest or newest[rank][0]["time"] < rec["time"]):
                newest[rank] = (rec, node)
    if not newest:
        return "no stack captured (a worker without the dump registered, or its agent not the launcher's)"
    return "stacks, each rank's newest:\n" + "".join(
        contract.stack_capture_text(rec, where=f" (node {node})") for rank, (rec, node) in sorted(newest.items()))


class Display:
    """Progress bar on a terminal, periodic lines otherwise; warnings above the bar."""

    def __init__(self, *, enabled: bool, job: JobSpec) -> None:
        from ddpjob_operator.decisions.health import HealthTracker

        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.bar = None
        self.job = job
        self.health = HealthTracker.for_spec(job.spec)
        self.prev = None
        self.last_line = 0.0

    def say(self, msg: str) -> None:
        """A line that does not break the bar."""
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            click.echo(msg, err=True)

    def update(self, ports: list[int], *, attempt: int = 0) -> dict[int, Any]:
        """Scrape every node once (node r's samples named as the operator names its pod) and
        redraw; the samples by rank."""
        from ddpjob_operator.decisions.progress import compute_progress
        from ddpjob_operator.decisions.samples import merge, parse_metrics

        parts = []
        for node, port in enumerate(ports):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=0.5) as r:
                    part = parse_metrics(r.read().decode())
            except READ_ERRORS:
                continue
            for sample in part.values():
                sample.pod = names.pod_name(self.job.name, node, attempt)
            parts.append(part)
        samples = merge(parts)
        now = time.time()
        prog = compute_progress(samples, now=now, prev=self.prev)
        self.prev = (now, samples)
        for f in self.health.update(samples, now):
            self.say(("WARNING " if f.active else "cleared ") + f"{f.reason}: {f.message}")
            if f.active and f.kind == Signal.STALLED:
                self.say(stall_stacks(ports))
        if prog and self.enabled:
            self._draw(prog, now)
        return samples

    def _draw(self, prog: dict[str, Any], now: float) -> None:
        step, total = prog.get("step", 0), prog.get("totalSteps")
        post = f"loss {prog['loss']:.4f}" if prog.get("loss") is not None else ""
        if prog.get("samplesPerSecond"):
            post += f", {prog['samplesPerSecond']:.0f} samples/s"
        if self.tty:
            from tqdm import tqdm

            if self.bar is None:
                self.bar = tqdm(total=total, unit="step", desc=self.job.name, dynamic_ncols=True)
            if total and self.bar.total != total:
                self.bar.total = total
            self.bar.n = step
            self.bar.set_postfix_str(post, refresh=False)
            self.bar.refresh()
        elif now - self.last_line >= 5:
            self.last_line = now
            click.echo(f"{self.job.name}: step {step}/{total or '?'} {post}", err=True)

    def close(self) -> None:
        """Remove the bar."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Books:
    """What the operator keeps in a job's status, kept for a local run from the nodes' scrapes with
    the operator's own functions: the restart history (inplace.update: each restart in place,
    each group restart, and how each recovered), logged as the operator's events say it, and the
    goodput ledger (goodput.advance)."""

    def __init__(self, job: JobSpec, *, say: Any, created: float) -> None:
        self.job, self.say, self.created = job, say, created
        self.status: dict[str, Any] = {}
        self.attempt = 0
        self.spawned: float | None = None
        self.samples: dict[int, Any] = {}
        self.counted = 0   # group restarts charged to failurePolicy.maxRestarts

    @property
    def in_place_restarts(self) -> int:
        return int(self.status.get("inPlaceRestarts") or 0)

    @property
    def history(self) -> list[dict[str, Any]]:
        return list(self.status.get("restartHistory") or [])

    @property
    def ledger(self) -> dict[str, Any]:
        """status.goodput without the running totals."""
        return {k: v for k, v in (self.status.get("goodput") or {}).items() if k != "accounting"}

    def started(self, attempt: int) -> None:
        """The attempt's nodes were all started (a pod's scheduling, here)."""
        self.attempt, self.spawned = attempt, time.time()

    def observe(self, samples: dict[int, Any]) -> None:
        """One scrape of the attempt's nodes."""
        if samples:
            self.samples = samples
        self._account(samples, now=time.time())

    def group_restart(self, *, ended: int, attempt: int, counted: int, reason: str, message: str) -> None:
        """The operator's pass that restarts the group: its history entry, the new attempt."""
        self.counted = counted
        self._account(self.samples, now=time.time(), group=(ended, reason, message), attempt=attempt)
        self.samples, self.spawned = {}, None

    def close(self) -> None:
        """The run ended: no time after now."""
        self._account({}, now=time.time(), ended=True)

    def _account(self, samples: dict[int, Any], *, now: float, group: tuple[int, str, str] | None = None,
                 attempt: int | None = None, ended: bool = False) -> None:
        prev, job = self.status, self.job
        up = inplace.update(prev, attempt=self.attempt, ranks=samples, with_log=True, group=group,
                            now=dt.datetime.fromtimestamp(now, dt.timezone.utc))
        status = {**prev, "restartHistory": up.history, "inPlaceRestarts": up.in_place_restarts}
        for e in up.new:
            self.say(inplace.restarting_message(e, used=self.counted + up.in_place_restarts,
                                                max_restarts=job.spec.failure_policy.max_restarts))
        for e in inplace.newly_recovered(prev, status):
            self.say(inplace.recovered_message(e))
        last = max((s.last_step_timestamp for s in self.samples.values() if s.last_step_timestamp), default=None)
        status["goodput"] = goodput.advance(prev.get("goodput"), goodput.Observed(
            now=now, created=self.created, ended=now if ended else None, attempt=self.attempt if attempt is None else attempt,
            restarted=attempt is not None, scheduled_at=self.spawned if attempt is None else None,
            stepped_at=goodput.stepped_at(samples), history=up.history, recovered=inplace.recoveries(prev, status, training_stopped=True),
            stalls=goodput.new_stalls(prev.get("restartHistory") or [], up.history, last),
            ranks=goodput.rank_counters(samples), step_seconds=goodput.step_seconds(samples)))
        if attempt is not None:
            self.attempt = attempt
        self.status = status


def run_attempt(job: JobSpec, *, attempt: int, workdir: Path, cwd: Path, metrics_ports: list[int],
                display: Display, signals: StopSignals, grace: float, books: Books,
                lighthouse: LocalLighthouse | None = None) -> Attempt:
    """Start every node (in `cwd`: the DDPJob file's folder, against which relative paths in its
    command resolve), watch them, stop the group on the first failure or a stop signal.

    A per-step job (`lighthouse`: its Lighthouse, kept up meanwhile) instead replaces a failed node alone, up to
    failurePolicy.maxRestarts times in the attempt: the new one joins the quorum and takes its state
    from a live peer while the others train on. It succeeds when node 0 (replica group 0, whose
    rank 0 writes the result) succeeds; the nodes still running then are stopped."""
    logs = workdir / "logs" / f"attempt-{attempt}"
    logs.mkdir(parents=True, exist_ok=True)
    result_file = workdir / f"result-attempt-{attempt}.json"
    # Each node of a per-step job is a torchrun world of its own, with its own store.
    master_ports = [free_port() for _ in range(job.spec.nodes)] if lighthouse else [free_port()] * job.spec.nodes
    nodes: list[subprocess.Popen] = []  # node r's launcher at index r
    node_logs: dict[int, Path] = {}  # node r's log, its replacement's once replaced
    replaced = 0

    def start(rank: int, log_name: str) -> subprocess.Popen:
        env = node_env(job, rank, master_port=master_ports[rank], metrics_port=metrics_ports[rank],
                       attempt=attempt, workdir=workdir, result_file=result_file,
                       lighthouse=lighthouse.url if lighthouse else None)
        # Where its ranks record why they failed (the launcher's own dir otherwise, gone with it):
        # a bad configuration's message is then said however long the log grew after it.
        status = status_dir(workdir, attempt, rank)
        shutil.rmtree(status, ignore_errors=True)  # an earlier run with this --workdir, or the node replaced
        env[contract.ENV_STATUS_DIR] = str(status)
        node_logs[rank] = logs / log_name
        with open(logs / log_name, "wb") as log:
            return subprocess.Popen(
                node_command(job, metrics_port=metrics_ports[rank]), env=env,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=cwd, start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, os.getpid()))

    try:
        for rank in range(job.spec.nodes):
            nodes.append(start(rank, f"node-{rank}.log"))
        books.started(attempt)
        next_scrape = 0.0
        while True:
            codes = [n.poll() for n in nodes]
            if lighthouse and codes[0] == 0:
                result = json.loads(result_file.read_text()) if result_file.exists() else {}
                return Attempt(ok=True, result=result, replaced=replaced)
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                time.sleep(0.3)  # let a bad-config exit (78) on another node land too
                codes = [n.poll() for n in nodes]
                bad = [rank for rank, c in enumerate(codes) if c == EXIT_BAD_CONFIG]
                if lighthouse and not bad and replaced + len(failed) <= job.spec.failure_policy.max_restarts:
                    for rank, code in failed:
                        replaced += 1
                        display.say(f"node {rank} failed with exit code {code}: replacing it alone (per-step fault "
                                    f"tolerance; replacement {replaced}/{job.spec.failure_policy.max_restarts}), "
                                    "it takes its state from a live peer")
                        _stop_node(nodes[rank], rank, workdir=workdir)
                        nodes[rank] = start(rank, f"node-{rank}-replacement-{replaced}.log")
                    continue
                rank, code = (bad[0], EXIT_BAD_CONFIG) if bad else failed[0]
                return Attempt(ok=False, exit_code=code, failed_rank=rank, returncodes=dict(enumerate(codes)),
                               replaced=replaced, failed_log=node_logs[rank])
            if all(c == 0 for c in codes):
                result = json.loads(result_file.read_text()) if result_file.exists() else {}
                return Attempt(ok=True, result=result)
            if lighthouse:
                lighthouse.keep_up(display.say)
            if time.monotonic() >= next_scrape:
                books.observe(display.update(metrics_ports, attempt=attempt))
                next_scrape = time.monotonic() + SCRAPE_INTERVAL
            signals.raise_if_stopped()  # a Stop lost in a __del__ or weakref callback
            time.sleep(0.1)
    except Stop as stop:
        display.say(f"{stop}: stopping every node (SIGKILL after {grace:g}s)")
        return Attempt(ok=False, exit_code=128 + stop.signum, interrupted=True)
    finally:
        _stop_nodes(nodes, workdir=workdir, signals=signals, grace=grace, display=display)
        # An attempt's pods take their /dev/shm, the snapshots in it, with them. A local attempt's
        # nodes share this machine's: removed here, the next attempt (a group restart) resumes
        # from disk as new pods do, and no run, ended or failed, leaves its snapshots in memory.
        shutil.rmtree(contract.snapshot_root({contract.ENV_JOB_UID: job.uid or local_uid(job, workdir)}),
                      ignore_errors=True)


def _give_up(job: JobSpec, reason: str) -> str:
    if reason == FailReason.BAD_CONFIGURATION:
        return "bad configuration: not retrying"
    if reason == FailReason.RESTART_LIMIT_EXCEEDED:
        return f"restart budget exhausted (failurePolicy.maxRestarts={job.spec.failure_policy.max_restarts})"
    return "not retrying"


def run_local(path: str, *, summary_json: str | None = None, metrics_port_base: int | None = None,
              workdir: str | None = None, progress: bool = True) -> int:
    """Run the DDPJob in `path` on this machine; the process exit code (130/143 when stopped)."""
    signals = StopSignals().install()  # first: a signal during start-up must stop it too
    become_subreaper()
    try:
        return _run_local(path, signals=signals, summary_json=summary_json,
                          metrics_port_base=metrics_port_base, workdir=workdir, progress=progress)
    except Stop as stop:  # before the first node started (each attempt stops its own nodes)
        click.echo(f"{stop}", err=True)
        return 128 + stop.signum


def _run_local(path: str, *, signals: StopSignals, summary_json: str | None, metrics_port_base: int | None,
               workdir: str | None, progress: bool) -> int:
    t0, created = time.monotonic(), time.time()
    try:
        grace = stop_grace_from_env()
        job = validate(load_job_file(path))
        require_trainer(job)
    except (ConfigError, LocalRunError) as exc:
        click.echo(f"error: {exc}", err=True)
        return 2
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"ddpjob-{job.name}-"))
    wd.mkdir(parents=True, exist_ok=True)
    ports = ([metrics_port_base + r for r in range(job.spec.nodes)] if metrics_port_base
             else [free_port() for _ in range(job.spec.nodes)])
    click.echo(f"{job.name}: {job.spec.nodes} node(s) x {job.nproc_per_node} process(es) = world size "
               f"{job.world_size}; metrics on ports {ports[0]}..{ports[-1]}; logs in {wd}/logs", err=True)
    display = Display(enabled=progress, job=job)
    books = Books(job, say=display.say, created=created)
    tally, outcome, started = Tally(), Attempt(ok=False), dt.datetime.now(dt.timezone.utc)
    lighthouse: LocalLighthouse | None = None
    replaced = 0
    try:
        if job.spec.fault_tolerance is not None:
            lighthouse = LocalLighthouse(job, workdir=wd)
        while True:
            attempt_no = tally.attempt
            outcome = run_attempt(job, attempt=attempt_no, workdir=wd, cwd=Path(path).resolve().parent,
                                  metrics_ports=ports, display=display,
                                  signals=signals, grace=grace, books=books, lighthouse=lighthouse)
            replaced += outcome.replaced
            if not outcome.ok and signals.exit_code is not None:  # it came while nodes were stopped
                outcome = Attempt(ok=False, exit_code=signals.exit_code, interrupted=True)
            if outcome.ok or outcome.interrupted:
                break
            display.close()
            log = outcome.failed_log  # set with failed_rank: the log run_attempt opened for that node
            bad = rank_messages(str(status_dir(wd, attempt_no, outcome.failed_rank)), "bad-config")
            click.echo(f"node {outcome.failed_rank} failed with exit code {outcome.exit_code} "
                       f"(attempt {attempt_no}){': ' + bad[0] if bad else ''}; its log ({log}) ends:\n{_tail(log)}",
                       err=True)
            decision = after_failure(job, tally=tally, returncodes=outcome.returncodes, started=started,
                                     now=dt.datetime.now(dt.timezone.utc))
            if decision.phase is Phase.FAILED:
                click.echo(f"{decision.reason}: {decision.message}", err=True)
                click.echo(_give_up(job, decision.reason), err=True)
                break
            tally = next_tally(decision)
            books.group_restart(ended=attempt_no, attempt=tally.attempt, counted=tally.counted_restarts,
                                reason=decision.reason, message=decision.message)
            click.echo(f"restarting the whole group (restart {tally.counted_restarts}/{job.spec.failure_policy.max_restarts}); "
                       "it resumes from the newest complete checkpoint", err=True)
    except Stop as stop:  # between two attempts: no node is running
        outcome = Attempt(ok=False, exit_code=128 + stop.signum, interrupted=True)
    except LocalRunError as exc:  # before any node started
        click.echo(f"error: {exc}", err=True)
        return 2
    finally:
        if lighthouse is not None:  # with the run, never an orphan
            lighthouse.stop()
        display.close()
        books.close()
    phase = "Succeeded" if outcome.ok else ("Interrupted" if outcome.interrupted else "Failed")
    r = outcome.result
    run_id = r.get(contract.RESULT_MLFLOW_RUN_ID)
    summary = {
        "phase": phase, "job": job.name, "world_size": job.world_size, "nodes": job.spec.nodes,
        "nproc_per_node": job.nproc_per_node, "steps": r.get("steps"), "restarts": tally.restarts,
        "in_place_restarts": books.in_place_restarts, "restart_history": books.history, "goodput": books.ledger,
        "train_samples_per_second": r.get("train_samples_per_second"),
        "eval_accuracy": r.get("eval_accuracy"), "eval_loss": r.get("eval_loss"),
        "eval_samples": r.get("eval_samples"), "eval_dataset_size": r.get("eval_dataset_size"),
        "resumed_from_step": r.get("resumed_from_step", 0),
        "wall_seconds": round(time.monotonic() - t0, 3),
        "exit_code": 0 if outcome.ok else outcome.exit_code, "failed_rank": outcome.failed_rank,
        "workdir": str(wd), "last_checkpoint": r.get("last_checkpoint"),
        "mlflow_run_id": run_id,
    }
    if job.spec.fault_tolerance is not None:
        summary["nodes_replaced"] = replaced  # per-step fault tolerance's replacements of one node alone
    run = f", MLflow run {run_id}" if run_id else ""
    restarts = f"restarts {tally.restarts} (group), {books.in_place_restarts} in place"
    spent = f"; goodput {goodput.summary(books.ledger)}" if books.ledger else ""
    if outcome.ok and r.get("steps") is not None:
        click.echo(f"{job.name}: Succeeded in {summary['wall_seconds']:.1f}s — {r.get('steps')} steps, "
                   f"eval accuracy {r.get('eval_accuracy', 0):.4f} on {r.get('eval_samples')}/"
                   f"{r.get('eval_dataset_size')} samples, {r.get('train_samples_per_second', 0):.0f} "
                   f"samples/s, {restarts}{run}{spent}", err=True)
    elif outcome.ok:
        click.echo(f"{job.name}: Succeeded in {summary['wall_seconds']:.1f}s, {restarts}{run}{spent}", err=True)
    else:
        click.echo(f"{job.name}: {phase}, {restarts}{spent}", err=True)
    if summary_json:
        Path(summary_json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if outcome.ok else outcome.exit_code or 1
