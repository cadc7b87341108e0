"""`python -m ddpjob_trainer.agent [torchrun flags] ...`: torchrun, counted and attributed.

The launcher runs the built-in trainer under this instead of `python -m torch.distributed.run`.
It is torchrun itself (same flags, same PET_* env, same agent), with three hooks into its agent
(torchapi.hook_agent):

- before each start of this pod's workers it prints the marker line (contract.INPLACE_MARKER:
  `==> ddpjob: attempt A restart R <==`, R = 0 for the attempt's first start) and hands R to
  the workers (contract.ENV_RESTART);
- when a worker fails it exports the failure on the pod's metrics endpoint
  (contract.WORKER_FAILURE: rank, exit code, signal, the error's first line, whether the agent
  restarts in place, the step the rank had finished), which the operator turns into
  status.restartHistory;
- while the workers run, its watchdog (failurePolicy.restartOnHang) kills the worker of a rank
  that made no progress for the job's hang timeout (contract.hang_timeout, the operator's Stalled
  rule), its failure record naming the stall (contract.STALL_ERROR): torchrun then restarts every
  pod's workers in place as for any failure, counted and attributed the same way.
- it captures every worker's Python stack (stacks.py: faulthandler on a signal) before such a kill,
  when a rank has been idle for half its hang timeout, and for the peers still running when a
  worker failed: a record each, served by the pod's endpoint (contract.STACKS_PATH), and a series
  (contract.STACK_CAPTURE) naming the collective it waits in and its innermost frames, from which
  the operator names the rank the others wait for (docs/health.md, Stacks).

Why torchrun's agent restarts the workers in place (not a supervisor of ours): it already
restarts a pod's workers where they are (`--max-restarts`), and through the c10d rendezvous every
other pod's agent sees the new round and restarts its workers too, so the group re-forms in
seconds without a pod deleted, an image pulled or a node rescheduled; its budget per pod is
PET_MAX_RESTARTS, the operator's the whole job's (failurePolicy.maxRestarts).
"""
from __future__ import annotations

import collections
import json
import os
import signal
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from . import debug, telemetry
from ddpjob_api import contract

ERROR_CHARS = 200  # the error's first line as a label: a pod's exposition stays small
# How often the watchdog reads its ranks' progress (torchrun looks at its workers every 0.1 s).
# Across pods the earliest kill is named as the cause, and the rank that stopped first reaches its
# timeout first (its peers made at least one step or stage more), so this is kept short of a step.
WATCH_SECONDS = 0.1


def _say(msg: str) -> None:
    print(f"[ddpjob-agent] {msg}", file=sys.stderr, flush=True)


def stop_passes(exc: Exception) -> None:
    """Raise `exc` again when it is torchrun's stop. The agent's SIGTERM/SIGINT handler raises
    SignalException, an Exception, wherever its main thread is, and these hooks run in that
    thread: one that swallowed it (a watchdog's read that "failed") left the agent running while
    the launcher stopped its workers, and the agent restarted them into a new rendezvous round,
    which an elastic peer joined at once and then waited in for the stopped pod until its
    collective timeout (CI's elastic job: 600 s). Only loaded where torch's agent runs, so the
    launcher, which reads steps_reached too, never imports torch for it."""
    agent_mp = sys.modules.get("torch.distributed.elastic.multiprocessing")
    if agent_mp is not None and isinstance(exc, agent_mp.SignalException):
        raise exc


def error_line(status_dir: str | None, rank: int, failure: Any) -> str:
    """The line that names why `rank` failed: the last line of the trainer's record of it (a
    traceback ends with the exception), else torchrun's account (a signal: no record)."""
    record = os.path.join(status_dir, f"failed-rank-{rank}.txt") if status_dir else ""
    try:
        with open(record, errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        lines = []
    if lines:
        text = lines[-1]
    else:
        sig = failure.signal_name() if getattr(failure, "exitcode", 0) < 0 else ""
        text = f"killed by {sig}" if sig and sig != "<N/A>" else f"exit code {failure.exitcode}"
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text[:ERROR_CHARS]


def failed_at(status_dir: str | None, rank: int, seen: float) -> float:
    """When `rank`'s worker failed: when it recorded its failure (the built-in trainer does so as
    its exception is raised, before anything that can block; the watchdog before its kill), else
    `seen`, when the agent saw it exit. The record's time orders a group's failures by cause: a
    peer that fails in a collective because this rank died can only raise after it, while the
    agents may see the two exits the other way round (the dying rank's teardown is bounded, not
    instant)."""
    try:
        recorded = os.path.getmtime(os.path.join(status_dir, f"failed-rank-{rank}.txt")) if status_dir else seen
    except OSError:
        recorded = seen
    return min(recorded, seen)


def steps_reached(metrics_dir: str, *, since: float = 0.0) -> dict[str, int]:
    """The step each rank of this pod last finished, by rank label: its `step` gauge as the pod's
    endpoint serves it (mostrecent over every worker process that had the rank, a dead one's file
    included; read_progress), read at the failure to the fraction of a second. Only a step taken
    at `since` or later (the start of the workers running now) counts: a worker that failed
    before its first step reached nothing, and its predecessor's step would count the steps the
    previous restart lost a second time. {} when unreadable: the failure is exported without it,
    never lost for it."""
    try:
        return {str(rank): p.step for rank, p in read_progress(metrics_dir).items()
                if p.step is not None and p.stepped_at >= since}
    except Exception as exc:  # noqa: BLE001  (a torn or foreign file in the dir)
        stop_passes(exc)
        return {}


@dataclass(frozen=True)
class Progress:
    """What one rank last reported (its metrics in the pod's multiprocess directory)."""

    stage: str | None
    since: float                 # Unix time of its last progress: its last step or its stage's start
    step: int | None = None      # steps done (None: no step yet)
    step_seconds: float | None = None  # mean step time (read_progress: of every step so far)
    stepped_at: float = 0.0      # Unix time of its last step (0: none)
    steps_timed: float = 0.0     # steps in step_seconds' histogram (every worker of the rank)
    seconds_timed: float = 0.0   # their seconds


# The monitor judges the step time by its recent median (decisions/health.py); the agent by the
# mean of about as many recent steps, so that a slow first step (compilation, a cold cache) long
# past does not lift the agent's timeout above the monitor's, whose group restart would then come
# before the in-place restart it is the fallback of.
RECENT_STEPS = 50


class StepWindow:
    """Each rank's mean step time over its last RECENT_STEPS steps, from the cumulative histogram
    read_progress sees at each look."""

    def __init__(self) -> None:
        self._seen: dict[int, collections.deque[tuple[float, float]]] = {}

    def recent(self, rank: int, p: Progress) -> Progress:
        seen = self._seen.setdefault(rank, collections.deque(maxlen=RECENT_STEPS + 1))
        if p.steps_timed and (not seen or p.steps_timed > seen[-1][0]):
            seen.append((p.steps_timed, p.seconds_timed))
        if not seen:
            return p
        count, total = seen[-1]
        base = next(((c, t) for c, t in seen if c < count and count - c <= RECENT_STEPS), None)
        if base is None:  # one look so far, or one look holds more than the window
            return p
        return replace(p, step_seconds=(total - base[1]) / (count - base[0]))


def idle(ranks: Mapping[int, Progress], *, configured: float | None, started_at: float, now: float,
         startup: float = contract.STARTUP_HANG_TIMEOUT) -> dict[int, tuple[float, float, str, int | None]]:
    """{rank: (seconds without progress, its hang timeout, stage, step)} of the ranks judged:
    those whose worker reported since `started_at` (`stalled` says why only those)."""
    out = {}
    for rank, p in sorted(ranks.items()):
        if p.since < started_at:
            continue
        stage = p.stage or "rendezvous"
        timeout = contract.hang_timeout(configured, stage=None if p.step is None else stage,
                                        step_seconds=p.step_seconds, startup=startup)
        out[rank] = (now - p.since, timeout, stage, p.step)
    return out


def stalled(ranks: Mapping[int, Progress], *, configured: float | None, started_at: float,
            now: float, startup: float = contract.STARTUP_HANG_TIMEOUT) -> dict[int, str]:
    """{rank: the failure record} of the ranks that made no progress for their hang timeout
    (contract.hang_timeout: the monitor's rule, per rank); `started_at`: when the agent started
    the workers running now. A rank whose worker reported nothing since then (what it reported
    before is an earlier worker's) is still starting its interpreter and importing torch: killing
    it would only start that again, so it is left to the operator, which restarts the group when
    the job is still Stalled a second hang timeout later."""
    return {rank: contract.stall_error(idle=seconds, stage=stage, step=step, timeout=timeout)
            for rank, (seconds, timeout, stage, step) in idle(ranks, configured=configured, started_at=started_at,
                                                              now=now, startup=startup).items()
            if seconds >= timeout}


def read_progress(metrics_dir: str) -> dict[int, Progress]:
    """Each rank's Progress from the pod's multiprocess metrics directory (what the pod's endpoint
    serves, read without HTTP)."""
    values: dict[int, dict[str, Any]] = {}
    for family in telemetry.merged_metrics(metrics_dir):
        for s in family.samples:
            name = s.name[len(contract.METRIC_PREFIX):] if s.name.startswith(contract.METRIC_PREFIX) else ""
            rank = s.labels.get("rank", "")
            if not name or not rank.isdigit():
                continue
            v = values.setdefault(int(rank), {})
            if name == contract.STAGE:
                if s.value == 1:
                    v["stage"] = s.labels.get("stage")
            elif name in (contract.STEP, contract.LAST_STEP_TIMESTAMP, contract.STAGE_START_TIMESTAMP,
                          contract.STEP_SECONDS + "_sum", contract.STEP_SECONDS + "_count"):
                v[name] = v.get(name, 0.0) + s.value if name.startswith(contract.STEP_SECONDS) else s.value
    out = {}
    for rank, v in values.items():
        count = v.get(contract.STEP_SECONDS + "_count") or 0.0
        step = v.get(contract.STEP)
        out[rank] = Progress(stage=v.get("stage"),
                             since=max(v.get(contract.LAST_STEP_TIMESTAMP, 0.0), v.get(contract.STAGE_START_TIMESTAMP, 0.0)),
                             step=int(step) if step is not None else None,
                             step_seconds=v.get(contract.STEP_SECONDS + "_sum", 0.0) / count if count else None,
                             stepped_at=v.get(contract.LAST_STEP_TIMESTAMP, 0.0),
                             steps_timed=count, seconds_timed=v.get(contract.STEP_SECONDS + "_sum", 0.0))
    return out


def live_workers(group: Any, *, but: Any = ()) -> dict[int, int]:
    """{global rank: pid} of the group's workers still running (ranks in `but` left out)."""
    return {int(w.global_rank): w.id for w in getattr(group, "workers", [])
            if isinstance(w.id, int) and int(w.global_rank) not in but and _running_child(w.id)}


def _running_child(pid: int) -> bool:
    """True while `pid` is a live child of this process: a worker that already exited (its rank done
    before its peers) is neither judged nor signalled, and its pid may have gone to another process."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.ppid() == os.getpid() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Watchdog:
    """Kills the worker of a stalled rank (`stalled`; failurePolicy.restartOnHang), so that torchrun
    restarts the workers in place, after `capture` took every worker's stack; a rank idle for
    contract.STACK_IDLE_FRACTION of its hang timeout has them taken too, once per idle spell: a
    peer's worker that waits in a collective for the stalled rank dies as soon as it is killed,
    its stack with it, and its own agent (another pod's) has no word of the kill. Without
    restartOnHang it watches all the same and takes the stacks, once per spell, without a kill."""

    def __init__(self, env: Mapping[str, str], clock: Any = time.time,
                 capture: Any = lambda pids, trigger: None) -> None:
        self.metrics_dir = env.get(contract.ENV_METRICS_DIR, "")
        self.status_dir = env.get(contract.ENV_STATUS_DIR, "")
        self.enabled = bool(self.metrics_dir) and env.get(contract.ENV_TELEMETRY, "1") != "0"
        self.kills = env.get(contract.ENV_RESTART_ON_HANG) == "1"
        raw = env.get(contract.ENV_HANG_TIMEOUT, "")
        self.configured = float(raw) if raw.strip().isdigit() else None
        try:
            trainer = json.loads(env.get(contract.ENV_TRAINER_CONFIG) or "{}")
        except ValueError:  # the trainer refuses it with its own error; judge by the default
            trainer = {}
        self.startup = contract.startup_hang_timeout(trainer if isinstance(trainer, dict) else None)
        ckpt = (trainer.get("checkpoint") or {}).get("dir") if isinstance(trainer, dict) else None
        # The built-in trainer's crash evidence folder (its NCCL flight recorder dumps there too):
        # every capture is also written there, beside them.
        self.debug_dir = (contract.debug_dir(ckpt, env.get(contract.ENV_ATTEMPT, "0"))
                          if isinstance(ckpt, str) and ckpt else None)
        self.clock = clock
        self.started_at = 0.0
        self.looked_at = 0.0
        self.killed: set[int] = set()
        self.window = StepWindow()
        self.capture = capture
        self.captured: dict[int, float] = {}  # rank -> the start of the idle spell its stacks were taken in
        self.stalled_at: dict[int, float] = {}  # without kills: rank -> the spell its stall's stacks were taken in
        self.unreadable = False  # the last look could not read the metrics (said once per spell)
        self.hold_read = debug.watchdog_read_hold(env)  # read once: this runs every WATCH_SECONDS

    def on_start(self) -> None:
        self.started_at = self.clock()

    def on_monitor(self, _agent: Any, group: Any) -> None:
        now = self.clock()
        if not self.enabled or now - self.looked_at < WATCH_SECONDS:
            return
        self.looked_at = now
        pids = live_workers(group)
        try:
            progress = {r: self.window.recent(r, p) for r, p in read_progress(self.metrics_dir).items() if r in pids}
            if self.hold_read and any(p.step for p in progress.values()):
                hold, self.hold_read = self.hold_read, 0.0  # once
                debug.hold_watchdog_read(hold)  # a test's stand-in for a slow read (off unless set)
        except Exception as exc:  # noqa: BLE001 - a watchdog that cannot read must not end the training it watches
            stop_passes(exc)
            # Looked at again at the next look: a torn read (a file a worker writes as it is read)
            # passes, and one that lasts leaves the watchdog blind for as long, said once.
            if not self.unreadable:
                _say(f"WARNING the hang watchdog is blind until it can read the ranks' metrics "
                     f"({type(exc).__name__}: {exc})")
            self.unreadable = True
            return
        if self.unreadable:
            _say("the hang watchdog reads the ranks' metrics again")
            self.unreadable = False
        judged = idle(progress, configured=self.configured, started_at=self.started_at, now=now, startup=self.startup)
        spells = {rank: progress[rank].since for rank, (seconds, timeout, *_) in judged.items()
                  if seconds >= contract.STACK_IDLE_FRACTION * timeout and self.captured.get(rank) != progress[rank].since}
        stuck = {rank: contract.stall_error(idle=seconds, stage=stage, step=step, timeout=timeout)
                 for rank, (seconds, timeout, stage, step) in judged.items()
                 if seconds >= timeout and pids[rank] not in self.killed}
        if not self.kills:
            stuck = {rank: why for rank, why in stuck.items() if self.stalled_at.get(rank) != progress[rank].since}
            self.stalled_at.update({rank: progress[rank].since for rank in stuck})
        if spells and not stuck:
            self.captured.update(spells)
            self.capture(pids, contract.STACK_IDLE)
        if stuck:
            self.capture(pids, contract.STACK_STALL)  # before the kill: every worker of this pod, alive
        for rank, why in stuck.items() if self.kills else ():
            pid = pids[rank]
            self.killed.add(pid)
            _say(f"rank {rank} {why}: killing its worker (pid {pid}) to restart in place")
            if self.status_dir:
                # The failure's record: what on_failure exports as its error and the operator shows.
                try:
                    os.makedirs(self.status_dir, exist_ok=True)
                    with open(os.path.join(self.status_dir, f"failed-rank-{rank}.txt"), "w") as f:
                        f.write(why + "\n")
                except OSError as exc:  # a full disk: the kill still restarts it, unnamed
                    _say(f"WARNING cannot record the stall of rank {rank} ({exc})")
            with suppress(ProcessLookupError):  # it ended since: torchrun sees how
                os.kill(pid, signal.SIGKILL)


class Hooks:
    """What the agent's hooks keep: the starts so far and the failure series."""

    def __init__(self, env: dict[str, str] | os._Environ = os.environ) -> None:
        self.env = env
        self.starts = 0
        self.attempt = env.get(contract.ENV_ATTEMPT, "0")
        self._families: dict[str, Any] = {}
        self.reached = -1  # the newest step this pod's ranks finished before a failure (-1: none yet)
        self.watchdog = Watchdog(env, capture=self.capture)

    def on_start(self, _agent: Any, _group: Any) -> None:
        self.watchdog.on_start()
        restart = self.starts
        self.starts += 1
        # The workers inherit the agent's environment (torchrun adds its own on top).
        os.environ[contract.ENV_RESTART] = str(restart)
        print(contract.inplace_marker(self.attempt, restart), file=sys.stderr, flush=True)

    def capture(self, pids: Mapping[int, int], trigger: str) -> None:
        """Take the stacks of the workers `pids` ({rank: pid}) and keep them: a record each in the
        stacks folder (served at contract.STACKS_PATH), a STACK_CAPTURE series each, a line in the log."""
        folder = self.env.get(contract.ENV_STACKS_DIR)
        if not folder or not pids:
            return
        from . import stacks

        started = time.monotonic()
        try:
            texts = stacks.capture(pids, folder)
        except Exception as exc:  # noqa: BLE001 - a capture must never stop the kill or the restart it precedes
            stop_passes(exc)
            _say(f"WARNING cannot capture the workers' stacks ({exc})")
            return
        now, restart = time.time(), str(max(0, self.starts - 1))
        said = []
        for rank, text in sorted(texts.items()):
            waiting, frames = stacks.summary(text)
            record = {"attempt": self.attempt, "restart": restart, "rank": rank, "node_rank": self.env.get(contract.ENV_NODE_RANK, "0"),
                      "trigger": trigger, "time": now, "pid": pids[rank], "waiting": waiting, "frames": frames,
                      "text": text}
            try:
                stacks.keep(folder, record)
                if self.watchdog.debug_dir:
                    os.makedirs(self.watchdog.debug_dir, exist_ok=True)
                    name = f"stacks-restart-{restart}-rank-{rank}-{trigger}-{int(now * 1000)}.txt"
                    with open(os.path.join(self.watchdog.debug_dir, name), "w") as f:
                        f.write(contract.stack_capture_text(record, where=f" (node rank {record['node_rank']})"))
            except OSError as exc:  # a full disk: the series below still names it
                _say(f"WARNING cannot keep the stack of rank {rank} ({exc})")
            self._gauge(contract.STACK_CAPTURE, "Unix time the pod's agent captured a worker's stack (1 series per capture).",
                        now, rank=rank, local_rank=rank % self._nproc(), restart=restart, trigger=trigger,
                        waiting=waiting, frames=frames)
            said.append(f"rank {rank} " + (f"waiting in {waiting}" if waiting else f"at {frames or 'no frame'}"))
        _say(f"stacks captured ({trigger}, {time.monotonic() - started:.2f}s): {'; '.join(said)}")

    def on_failure(self, _agent: Any, group: Any, failures: dict[int, Any], will_restart: bool) -> None:
        # First the peers' stacks, while they still run: torchrun stops them once this returns.
        self.capture(live_workers(group, but=failures), contract.STACK_FAILURE)
        seen = time.time()  # before the reads below: the earliest failure seen is the group's
        status_dir = self.env.get(contract.ENV_STATUS_DIR)
        restart = str(max(0, self.starts - 1))
        steps = (steps_reached(self.env[contract.ENV_METRICS_DIR], since=self.watchdog.started_at)
                 if self._exports else {})
        for rank, failure in sorted(failures.items()):
            code = int(getattr(failure, "exitcode", 1))
            sig = failure.signal_name() if code < 0 else ""
            error = error_line(status_dir, rank, failure)
            self._gauge(contract.WORKER_FAILURE, "Unix time a worker of this pod failed (1 series per failure).",
                        failed_at(status_dir, rank, seen), rank=rank, local_rank=getattr(failure, "local_rank", 0),
                        restart=restart, exit_code=str(code), signal=sig if sig != "<N/A>" else "", error=error,
                        restarted="true" if will_restart else "false", step=str(steps.get(str(rank), "")))
            idle = contract.stall_seconds(error)
            if idle is not None:  # the time it made no progress, before the watchdog killed it
                self._stalled(rank, getattr(failure, "local_rank", 0), idle)
        # The restarted workers' time from here to their first step is recovering, and their steps
        # up to the newest one finished so far are done again (telemetry's goodput_seconds).
        self.reached = max([self.reached, *steps.values()])
        os.environ[contract.ENV_FAILED_AT] = f"{seen:.3f}"
        if self.reached >= 0:
            os.environ[contract.ENV_STEP_REACHED] = str(self.reached)
        if will_restart and status_dir and os.path.isdir(status_dir):
            # Consumed: the next failure's record (or the node's final one, for its termination
            # message) must not be this one.
            for name in os.listdir(status_dir):
                if name.startswith("failed-rank-"):
                    os.replace(os.path.join(status_dir, name), os.path.join(status_dir, f"restart-{restart}-{name}"))

    @property
    def _exports(self) -> bool:
        return self.env.get(contract.ENV_TELEMETRY, "1") != "0" and bool(self.env.get(contract.ENV_METRICS_DIR))

    def _stalled(self, rank: int, local_rank: int, seconds: float) -> None:
        """Count a stalled rank's seconds without progress (its goodput_seconds{category=stalled})."""
        if self._exports:
            family = self._family(contract.GOODPUT_SECONDS,
                                  lambda reg: telemetry.goodput_family(reg, list(telemetry.LABELS)))
            family.labels(**self._labels(rank, local_rank), category="stalled").inc(seconds)

    def _gauge(self, metric: str, doc: str, value: float, *, rank: Any, local_rank: Any, **extra: str) -> None:
        """Set a mostrecent gauge of this agent's with the ranks' LABELS and `extra`: one series per
        failure or capture, served by the pod's endpoint."""
        if self._exports:
            from prometheus_client import Gauge
            gauge = self._family(metric, lambda reg: Gauge(contract.METRIC_PREFIX + metric, doc,
                                                           [*telemetry.LABELS, *extra], registry=reg,
                                                           multiprocess_mode="mostrecent"))
            gauge.labels(**self._labels(rank, local_rank), **extra).set(value)

    def _family(self, metric: str, make: Callable[[Any], Any]) -> Any:
        """This agent's metric family `metric`, made on first use by make(registry)."""
        if metric not in self._families:
            telemetry._prepare_multiprocess()
            from prometheus_client import CollectorRegistry
            self._families[metric] = make(CollectorRegistry())
        return self._families[metric]

    def _labels(self, rank: Any, local_rank: Any) -> dict[str, str]:
        return telemetry.rank_labels(self.env, rank=rank, local_rank=local_rank,
                                     node_rank=self.env.get(contract.ENV_NODE_RANK, "0"))

    def _nproc(self) -> int:
        raw = self.env.get(contract.ENV_NPROC_PER_NODE) or self.env.get(contract.PET_NPROC_PER_NODE) or "1"
        return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def main() -> None:
    from torch.distributed import run

    from . import torchapi

    hooks = Hooks()
    if not torchapi.hook_agent(hooks.on_start, hooks.on_failure, hooks.watchdog.on_monitor):
        _say("WARNING this torch's agent has no hooks: in-place restarts are not counted on the metrics endpoint")
    run.main()


if __name__ == "__main__":
    main()
