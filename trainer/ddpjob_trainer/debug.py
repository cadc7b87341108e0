"""Test knobs that make one rank slow or frozen, so straggler and hang detection can be shown.

DDPJOB_DEBUG_SLOW_RANK="<rank>:<seconds>"   that rank's data loader takes this much longer per step
DDPJOB_DEBUG_FREEZE_RANK="<rank>:<step>"    that rank stops advancing once it takes that very step (a
                                            start that resumed past it does not: a replacement pod's,
                                            whose first start is its own)
DDPJOB_DEBUG_STEP_SLEEP="<seconds>"         every rank sleeps this long after every step
DDPJOB_DEBUG_CRASH_RANK="<rank>:<step>"     that rank exits 1 at the step, in the first start of attempt 0
                                            only (not again after a restart in place or of the group)
DDPJOB_DEBUG_RAISE_RANK="<rank>:<step>"     that rank raises an exception at the step (its traceback recorded,
                                            as a bug in training code would be), first start of attempt 0 only
DDPJOB_DEBUG_BLOCK_FETCH="<rank>:<step>"    that rank's data path blocks (sleeps, in Python) as it fetches the
                                            batch of that step: its peers wait in the step's all-reduce for it
                                            (its stack names the sleep, theirs the collective)
DDPJOB_DEBUG_FREEZE_STAGE="<rank>:<stage>"  that rank freezes on entering the stage (e.g. first_step:
                                            a job that hangs before its first step)
DDPJOB_DEBUG_SAMPLE_LOG="<dir>"             every rank appends "<step> <epoch> <sample indices...>" for each
                                            step it took to <dir>/rank-<rank>.log (which samples were seen)
DDPJOB_DEBUG_AWAIT_SIGTERM="<step>"         every rank, at that step's boundary, prints AWAIT_LINE and waits
                                            until it has been sent SIGTERM, then casts its stop ballot: a
                                            test places a stop at a known step without racing the training
DDPJOB_DEBUG_HOLD="<attempt>:<path>"         in that attempt (every start of it), every rank waits at each step boundary,
                                            before its stop ballot, until <path> exists, its stage's start
                                            renewed each second (the watchdogs see it alive, not hung): a test
                                            acts at a known point of a later attempt, e.g. deletes a pod, without
                                            racing the training to its end, then creates <path>
DDPJOB_DEBUG_HOLD_RANK="<rank>:<step>:<path>[,...]" that rank alone holds so at that step's boundary and later
                                            ones until <path> exists (in a per-step job a rank is the job's: group x
                                            nproc + local rank): a test stops one replica group at a known step
DDPJOB_DEBUG_LAUNCHER_START="<seconds>"     the in-pod launcher prints LAUNCHER_START_LINE and sleeps this long
                                            before it installs its stop handlers: a slow interpreter start
                                            (a loaded node), for a test that deletes the pod in that window
DDPJOB_DEBUG_WATCHDOG_READ="<seconds>"      the agent's hang watchdog, at its first read of the ranks' metrics after a
                                            step, prints WATCHDOG_READ_LINE and sleeps this long inside that read: a
                                            test stops the pod while its agent reads (a loaded node's slow read)
DDPJOB_DEBUG_WRITE_BANDWIDTH="<bytes/s>"    the checkpoint directory's write speed is taken to be this, not
                                            measured (storage too slow for a stop's save, preempt.plan)

The freezes and the block, like the crashes and the wait for SIGTERM, happen in the first start of attempt 0 only: a
restart (in place, by failurePolicy.restartOnHang, or of the group) recovers, as from a real one-off hang.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from ddpjob_api import contract

# What a rank prints when it starts waiting for SIGTERM (a test waits for it): format with rank, step.
AWAIT_LINE = "debug: rank {rank} at step {step} waits for SIGTERM"
# ... and when a hold starts and ends (DDPJOB_DEBUG_HOLD): format with rank, step, path.
HOLD_LINE = "debug: rank {rank} holds at step {step} until {path} exists"
RELEASED_LINE = "debug: rank {rank} released at step {step}"
# How often a held rank renews its stage's start, well inside any hang timeout.
HOLD_RENEW_SECONDS = 1.0
LAUNCHER_START_LINE = "debug: the launcher waits {seconds:g}s before its stop handlers"
WATCHDOG_READ_LINE = "debug: the agent's watchdog holds its read {seconds:g}s"


def delay_launcher_start(env=os.environ) -> None:
    """DDPJOB_DEBUG_LAUNCHER_START: the launcher's start, before its handlers, made that slow."""
    seconds = float(env.get("DDPJOB_DEBUG_LAUNCHER_START", "0") or 0)
    if seconds > 0:
        print(LAUNCHER_START_LINE.format(seconds=seconds), file=sys.stderr, flush=True)
        time.sleep(seconds)


def watchdog_read_hold(env=os.environ) -> float:
    """DDPJOB_DEBUG_WATCHDOG_READ: seconds the agent watchdog's first read after a step is held (0: off)."""
    return float(env.get("DDPJOB_DEBUG_WATCHDOG_READ", "0") or 0)


def hold_watchdog_read(seconds: float) -> None:
    """Hold the watchdog's read `seconds`, saying so first (the line a test waits for)."""
    print(WATCHDOG_READ_LINE.format(seconds=seconds), file=sys.stderr, flush=True)
    time.sleep(seconds)


def _pair(value: str | None) -> tuple[int, float] | None:
    if not value:
        return None
    rank, _, arg = value.partition(":")
    return int(rank), float(arg or 0)


@dataclass(frozen=True)
class Knobs:
    """The knobs that apply to this rank (all off by default)."""

    sleep: float = 0.0
    slow_fetch: float = 0.0
    freeze_at: int | None = None
    crash_at: int | None = None
    raise_at: int | None = None
    block_fetch_at: int | None = None
    freeze_stage: str | None = None
    sample_log: str | None = None
    await_sigterm_at: int | None = None
    write_bandwidth: float | None = None
    hold_until: str | None = None
    hold_rank_at: int | None = None  # DDPJOB_DEBUG_HOLD_RANK's step, for this rank; its path:
    hold_rank_until: str | None = None
    rank: int = 0

    @classmethod
    def from_env(cls, *, rank: int, env=os.environ) -> "Knobs":
        """Read the DDPJOB_DEBUG_* variables for `rank`."""
        sleep = float(env.get("DDPJOB_DEBUG_STEP_SLEEP", "0") or 0)
        slow = _pair(env.get("DDPJOB_DEBUG_SLOW_RANK"))
        first_attempt = env.get(contract.ENV_ATTEMPT, "0") == "0" and env.get(contract.ENV_RESTART, "0") == "0"

        def step_of(name: str) -> int | None:
            """The step of a "<rank>:<step>" knob aimed at this rank, in the first start of attempt 0 only."""
            pair = _pair(env.get(name))
            return int(pair[1]) if pair and pair[0] == rank and first_attempt else None
        f_rank, _, f_stage = (env.get("DDPJOB_DEBUG_FREEZE_STAGE") or "").partition(":")
        log_dir = env.get("DDPJOB_DEBUG_SAMPLE_LOG")
        await_at = env.get("DDPJOB_DEBUG_AWAIT_SIGTERM")
        hold_attempt, _, hold_path = (env.get("DDPJOB_DEBUG_HOLD") or "").partition(":")
        held = [e.split(":", 2) for e in (env.get("DDPJOB_DEBUG_HOLD_RANK") or "").split(",") if e.count(":") >= 2]
        h_step, h_path = next(((step, path) for r, step, path in held if r == str(rank)), ("", ""))
        mine = bool(h_path)
        return cls(sample_log=os.path.join(log_dir, f"rank-{rank}.log") if log_dir else None, rank=rank,
                   await_sigterm_at=int(await_at) if await_at and first_attempt else None,
                   write_bandwidth=float(env.get("DDPJOB_DEBUG_WRITE_BANDWIDTH") or 0) or None,
                   hold_until=(hold_path or None) if hold_attempt == env.get(contract.ENV_ATTEMPT, "0") else None,
                   hold_rank_at=int(h_step) if mine else None, hold_rank_until=h_path if mine else None,
                   freeze_stage=f_stage if f_stage and f_rank == str(rank) and first_attempt else None,
                   sleep=sleep, slow_fetch=slow[1] if slow and slow[0] == rank else 0.0,
                   freeze_at=step_of("DDPJOB_DEBUG_FREEZE_RANK"), crash_at=step_of("DDPJOB_DEBUG_CRASH_RANK"),
                   raise_at=step_of("DDPJOB_DEBUG_RAISE_RANK"), block_fetch_at=step_of("DDPJOB_DEBUG_BLOCK_FETCH"))

    def before_fetch(self, step: int | None = None) -> None:
        """Before fetching the batch of `step`: a slow rank's batch arrives late (the time counts as
        its data wait, as a real one would); a blocked rank's never does."""
        if self.slow_fetch:
            time.sleep(self.slow_fetch)
        if step is not None and step == self.block_fetch_at:
            _block_in_fetch()

    def after_step(self, step: int) -> None:
        """Apply the knobs once `step` has been taken."""
        if self.sleep:
            time.sleep(self.sleep)
        if self.crash_at is not None and step >= self.crash_at:
            os._exit(1)
        if self.raise_at is not None and step >= self.raise_at:
            raise RuntimeError(f"debug: rank {self.rank} raises at step {step} (DDPJOB_DEBUG_RAISE_RANK)")
        if self.freeze_at is not None and step == self.freeze_at:
            _freeze()

    def record_samples(self, step: int, epoch: int, indices: list[int]) -> None:
        """Note which samples this rank's step `step` trained on."""
        if self.sample_log:
            with open(self.sample_log, "a") as f:
                f.write(" ".join(map(str, [step, epoch, *indices])) + "\n")

    def before_stop_vote(self, step: int, *, sigterm_noted: Callable[[], bool]) -> None:
        """At `step`'s boundary, before this rank's stop ballot: wait there for SIGTERM when asked."""
        if step != self.await_sigterm_at:
            return
        print(AWAIT_LINE.format(rank=self.rank, step=step), file=sys.stderr, flush=True)
        while not sigterm_noted():
            time.sleep(0.01)  # SIGTERM's handler runs on this thread, mid-sleep

    def hold(self, step: int, *, alive: Callable[[], None]) -> bool:
        """At `step`'s boundary: wait while the hold's file is missing, calling `alive` every
        HOLD_RENEW_SECONDS (a hold is not a hang). True when it waited (the time is no step's)."""
        path = self.hold_until
        if path is None and self.hold_rank_at is not None and step >= self.hold_rank_at:
            path = self.hold_rank_until
        if path is None or os.path.exists(path):
            return False
        print(HOLD_LINE.format(rank=self.rank, step=step, path=path), file=sys.stderr, flush=True)
        renewed = time.monotonic()
        while not os.path.exists(path):
            if time.monotonic() - renewed >= HOLD_RENEW_SECONDS:
                alive()
                renewed = time.monotonic()
            time.sleep(0.05)
        print(RELEASED_LINE.format(rank=self.rank, step=step), file=sys.stderr, flush=True)
        return True

    def at_stage(self, stage: str) -> None:
        """Apply the knobs once this rank has entered `stage`."""
        if stage == self.freeze_stage:
            _freeze()


def _block_in_fetch() -> None:
    while True:  # a data loader that never returns (a hung filesystem or a deadlocked worker, in Python)
        time.sleep(3600)


def _freeze() -> None:
    while True:  # frozen: alive, but never advancing (what a hung NCCL call looks like)
        time.sleep(3600)
