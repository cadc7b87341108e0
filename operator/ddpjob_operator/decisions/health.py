"""Straggler and hang detection from successive scrapes of one job (stateful, no I/O).

Why the straggler rule is not "step time above the median": synchronous DDP makes every
rank's iteration equally long, because the fast ranks wait inside backward's all-reduce
for the slow one. So a rank's *own* time per iteration is estimated as

    own = iteration - peer_wait,   peer_wait = busy - min over ranks(busy),
    busy = step_seconds - data_wait_seconds   (per step)

(the slowest rank waits for nobody; a rank's own data wait counts as its own time, the wait
for its peers hides in all-reduce inside the step). A rank whose own time stays above
`straggler_ratio` x the median of the other ranks' (and at least `min_excess_seconds`
more) for `straggler_windows` consecutive observations is a straggler. When ranks do
not run in lock-step (iteration times differ), own time is simply the iteration time.

On GPUs the host's times say little: under NCCL the host runs ahead of the device and waits for
it at log steps, so a throttled GPU slows every rank's host alike. When every rank compared
reports device compute time (the trainer's `compute_seconds`: CUDA-event time of its forward
passes, which contain no collective), own time is that per step plus the rank's own data wait
per step: a slow GPU and a starved loader are both a rank's own, the wait for a peer is neither.

A job is stalled when it made no progress for the hang timeout. Progress is a step (the
highest step of any rank went up) or a stage change (a rank began a stage: the launcher's
waiting_for_master and rendezvous, the trainer's process_group_init, first_step, training,
eval, checkpoint; see ddpjob_trainer.telemetry), so a job frozen before its first step is
caught, and a long eval or checkpoint is judged from its own start. The timeout is
`hang_timeout` when given (spec.hangTimeoutSeconds), in every stage. Without it: before the
first step, and in eval or checkpoint, `contract.startup_hang_timeout` (600 s: the trainer's own
start-up limits, the launcher's wait for the master and the process-group timeout until the
first step, are 600 s too, so a start-up the trainer itself still waits for is no hang; longer
where spec.trainer.timeoutSeconds is); while
stepping, max(`min_hang_timeout`, `hang_step_multiple` x the median iteration time).
Idle time runs on the operator's clock from the change it saw, except before the first step,
where it starts at the reported stage start (the operator's first look does not reset it).

Who is named: in training, the ranks that did not start the step their peers are waiting in
(`step_started` lags), else those behind, else all; in any other stage, the ranks in the
earliest stage before the first step (their peers wait for them), or those in eval/checkpoint.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Mapping

from ddpjob_api import contract
from ddpjob_api.contract import STAGES, STALL_ERROR_RE
from ddpjob_api.phases import Reason, Signal
from ddpjob_api.specgen import DDPJobSpec
from ddpjob_operator.base.objmeta import format_time
from ddpjob_operator.decisions import stacks
from ddpjob_operator.decisions.samples import RankSample


TRAINING = "training"
_PAUSES = contract.HANG_PAUSES   # stages between steps that are judged from their own start
# A stall still there this many hang timeouts after it began: the pods' agents, which restart a
# stalled rank's workers in place at one timeout, could not (a user's own torchrun, an agent stuck
# in its rendezvous, ...); failurePolicy.restartOnHang then restarts the group.
GROUP_RESTART_TIMEOUTS = 2


@dataclass(frozen=True)
class Finding:
    """A change of health: `active` True when it starts, False when it clears."""

    kind: str                 # Signal.STRAGGLER | Signal.STALLED
    active: bool
    ranks: tuple[int, ...]
    reason: str
    message: str


@dataclass
class _RankState:
    step: int
    ts: float | None
    sum: float
    count: float
    wait: float
    csum: float = 0.0
    ccount: float = 0.0


@dataclass
class HealthTracker:
    """Feed it every scrape of one job with `update`; it returns the transitions."""

    hang_timeout: float | None = None
    startup_timeout: float = contract.STARTUP_HANG_TIMEOUT  # contract.startup_hang_timeout of the spec
    straggler_ratio: float = 1.5
    straggler_windows: int = 3
    min_excess_seconds: float = 0.02
    _prev: dict[int, _RankState] = field(default_factory=dict, repr=False)
    _streak: dict[int, int] = field(default_factory=dict, repr=False)
    _calm: dict[int, int] = field(default_factory=dict, repr=False)
    _iterations: list[float] = field(default_factory=list, repr=False)
    _max_step: int | None = field(default=None, repr=False)
    _advanced_at: float | None = field(default=None, repr=False)
    _stages: dict[int, tuple[str, float | None]] = field(default_factory=dict, repr=False)
    active: dict[str, Finding] = field(default_factory=dict)
    # Stalled for GROUP_RESTART_TIMEOUTS hang timeouts (as of the last update): no in-place restart came.
    overdue: bool = False
    _born: float | None = field(default=None, repr=False)  # the first update: older failures are history
    _kills: set[tuple[int, str, float]] = field(default_factory=set, repr=False)

    # ---- public -------------------------------------------------------------------------
    @classmethod
    def for_spec(cls, spec: DDPJobSpec) -> HealthTracker:
        """A tracker judging by a DDPJob spec's hang timeouts."""
        tracker = cls()
        tracker.configure(spec)
        return tracker

    def configure(self, spec: DDPJobSpec) -> None:
        """Take the spec's hang timeouts (they may be edited while the job runs)."""
        self.hang_timeout = spec.hang_timeout_seconds
        self.startup_timeout = contract.startup_hang_timeout(spec.trainer)

    def effective_hang_timeout(self, stage: str | None = TRAINING) -> float:
        """The hang timeout in force now for a job in `stage` (None: before its first step)."""
        p50 = statistics.median(self._iterations[-50:]) if self._iterations else None
        return contract.hang_timeout(self.hang_timeout, stage=stage, step_seconds=p50, startup=self.startup_timeout)

    def stage(self) -> str | None:
        """The job's stage as last seen: the earliest stage of any rank before the first step,
        eval/checkpoint while a rank is in one, else training (None: nothing reported)."""
        seen = [st for st, _ in self._stages.values()]
        if self._max_step is None:
            return min(seen, key=STAGES.index) if seen else None
        pauses = [st for st in seen if st in _PAUSES]
        return pauses[0] if pauses else TRAINING

    def calm_condition(self) -> tuple[str, str]:
        """(reason, message) of the Stalled condition while it is False: never a claim of
        advancing steps before the first step. Stable between stage changes (no status write per
        scrape)."""
        stage = self.stage()
        since = self._stage_start(stage) if stage else None
        when = f" since {format_time(since)}" if since else ""
        if self._max_step is None:
            if stage is None:
                return "Starting", "no training step yet; no stage reported"
            return "Starting", (f"no training step yet; in {stage}{when} (Stalled after "
                                f"{self.effective_hang_timeout(None):.0f}s without progress)")
        if stage in _PAUSES:
            return "Progressing", f"in {stage}{when}, after step {self._max_step}"
        return "Progressing", "training steps are advancing"

    def stragglers(self) -> tuple[int, ...]:
        """Ranks currently flagged as stragglers."""
        f = self.active.get(Signal.STRAGGLER)
        return f.ranks if f else ()

    def update(self, samples: Mapping[int, RankSample], now: float) -> list[Finding]:
        """Observe one scrape taken at `now`; return findings that started or cleared."""
        ranks = {r: s for r, s in samples.items() if s.step is not None}
        known = {r: s for r, s in samples.items() if s.step is not None or s.stage is not None}
        if not known:
            return []
        if self._born is None:
            self._born = now
        changes: list[Finding] = []
        changes += self._check_stall(known, now)
        changes += self._check_stall_kills(samples)
        if Signal.STALLED not in self.active and ranks:
            changes += self._check_stragglers(ranks)
        for r, s in ranks.items():
            self._prev[r] = _RankState(step=s.step, ts=s.last_step_timestamp,
                                       sum=s.step_seconds_sum, count=s.step_seconds_count,
                                       wait=s.data_wait_seconds_total,
                                       csum=s.compute_seconds_sum, ccount=s.compute_seconds_count)
        return changes

    # ---- hang ---------------------------------------------------------------------------
    def _stage_start(self, stage: str) -> float | None:
        starts = [t for st, t in self._stages.values() if st == stage and t]
        return max(starts) if starts else None

    def _stages_moved(self, ranks: Mapping[int, RankSample]) -> bool:
        """Remember each rank's (stage, start); True when one began a stage since the last look
        (a rank missing from one scrape keeps what it had: a flaky scrape is no progress)."""
        moved = False
        for r, s in ranks.items():
            if s.stage is None:
                continue
            now = (s.stage, s.stage_started_at)
            moved |= self._stages.get(r) != now
            self._stages[r] = now
        return moved

    def _check_stall(self, ranks: Mapping[int, RankSample], now: float) -> list[Finding]:
        steps = [s.step for s in ranks.values() if s.step is not None]
        top = max(steps) if steps else None
        first_sight = self._advanced_at is None
        moved = self._stages_moved(ranks)
        if first_sight:
            # The idle clock starts now (a stall seeded from status stays until the job moves), or
            # before the first step at the reported stage start when that is in the past.
            self._max_step, self._advanced_at = top, now
            starts = [t for _, t in self._stages.values() if t]
            if top is None and starts:
                self._advanced_at = min(now, max(starts))
            return []
        if top != self._max_step or moved:
            self._max_step = top
            self._advanced_at = now
            self.overdue = False
            if Signal.STALLED in self.active:
                old = self.active.pop(Signal.STALLED)
                what = f"step {top}" if top is not None else f"stage {self.stage()}"
                return [Finding(Signal.STALLED, False, old.ranks, Reason.RESUMED, f"training advanced again ({what})")]
            return []
        idle = now - self._advanced_at
        stage = self.stage()
        timeout = self.effective_hang_timeout(None if top is None else stage)
        self.overdue = idle >= GROUP_RESTART_TIMEOUTS * timeout
        if idle < timeout or Signal.STALLED in self.active:
            return []
        if top is None or stage in _PAUSES:
            f = self._stuck_in_stage(ranks, stage, idle, timeout)
        else:
            culprits = _stopped_ranks({r: s for r, s in ranks.items() if s.step is not None})
            names = ", ".join(_describe(ranks[r]) for r in culprits)
            steps_at = sorted({ranks[r].step for r in culprits})
            msg = (f"no rank advanced for {idle:.0f}s (hang timeout {timeout:.0f}s); "
                   f"stopped: {names} at step {'/'.join(map(str, steps_at))}")
            f = Finding(Signal.STALLED, True, culprits, Reason.NO_PROGRESS, msg)
        f = _by_stacks(f, stacks.of_stall(ranks), ranks)
        self.active[Signal.STALLED] = f
        return [f]

    def _check_stall_kills(self, samples: Mapping[int, RankSample]) -> list[Finding]:
        """Stalled, named, when a pod's agent killed a stalled rank's worker (its failure record,
        contract.STALL_ERROR_RE): the agent judges each rank from its own last progress, so its kill
        usually comes before the operator's own timeout, and the in-place restart it makes is
        progress. The next progress clears it, as any."""
        kills = [(r, f) for r, s in samples.items() for f in s.worker_failures
                 if STALL_ERROR_RE.match(str(f.get("error") or "")) and float(f["time"]) >= (self._born or 0.0)
                 and (r, str(f.get("restart")), float(f["time"])) not in self._kills]
        if not kills:
            return []
        self._kills.update((r, str(f.get("restart")), float(f["time"])) for r, f in kills)
        if Signal.STALLED in self.active:
            return []
        # The earliest kill, the others' casualties (decisions/inplace: the older last step first).
        rank, failure = min(kills, key=lambda k: (contract.stall_step(str(k[1].get("error"))) or 0, float(k[1]["time"])))
        msg = (f"{_describe(samples[rank])} {failure.get('error')}: its agent killed the worker, and every "
               "pod's workers restart in place")
        timeout = self.effective_hang_timeout()
        culprit = stacks.of_restart(samples, restart=int(str(failure.get("restart") or 0)),
                                    failed_at=float(failure["time"]), window=timeout)
        f = _by_stacks(Finding(Signal.STALLED, True, (rank,), Reason.STALLED_RANK_RESTARTED, msg), culprit, samples)
        self.active[Signal.STALLED] = f
        return [f]

    def _stuck_in_stage(self, ranks: Mapping[int, RankSample], stage: str | None, idle: float,
                        timeout: float) -> Finding:
        """'stuck in rendezvous for 312s (hangTimeoutSeconds 300): rank 1 (pod j-1); other ranks: ...'"""
        staged = {r: st for r, (st, _) in self._stages.items() if r in ranks}
        culprits = tuple(sorted(r for r, st in staged.items() if st == stage)) or tuple(sorted(ranks))
        if stage in _PAUSES and self._max_step is not None:
            # A pause (eval, checkpoint) begins with a collective every rank must reach: the ranks
            # still training, that never reached it, are the ones the others wait for.
            behind = tuple(sorted(r for r, st in staged.items() if st != stage))
            culprits = behind or culprits
        limit = (f"hangTimeoutSeconds {timeout:.0f}" if self.hang_timeout
                 else f"default hang timeout {timeout:.0f}s; set spec.hangTimeoutSeconds")
        where = "" if self._max_step is None else f" after step {self._max_step}"
        msg = (f"stuck in {stage or 'start-up'}{where} for {idle:.0f}s ({limit}): "
               + ", ".join(_describe(ranks[r]) + (f" in {staged[r]}" if staged.get(r, stage) != stage else "")
                           for r in culprits))
        others = sorted(r for r in ranks if r not in culprits)
        if others:
            msg += "; other ranks: " + ", ".join(
                f"{_describe(ranks[r])} in {staged.get(r, 'an unreported stage')}" for r in others)
        return Finding(Signal.STALLED, True, culprits, Reason.STUCK_IN_STAGE, msg)

    # ---- stragglers -----------------------------------------------------------------------
    def _check_stragglers(self, ranks: Mapping[int, RankSample]) -> list[Finding]:
        iters: dict[int, float] = {}
        steps: dict[int, float] = {}
        device: dict[int, float] = {}
        waits: dict[int, float] = {}
        for r, s in ranks.items():
            p = self._prev.get(r)
            if p is None or s.step <= p.step or s.step_seconds_count <= p.count:
                continue
            d = s.step - p.step
            if s.last_step_timestamp is not None and p.ts is not None and s.last_step_timestamp > p.ts:
                iters[r] = (s.last_step_timestamp - p.ts) / d
            dwait = max(0.0, s.data_wait_seconds_total - p.wait)
            steps[r] = max(0.0, s.step_seconds_sum - p.sum - dwait) / (s.step_seconds_count - p.count)
            waits[r] = dwait / (s.step_seconds_count - p.count)
            # Device time is read at log steps, so it is averaged over the steps it covers.
            if s.compute_seconds_count > p.ccount and s.compute_seconds_sum >= p.csum:
                device[r] = (s.compute_seconds_sum - p.csum) / (s.compute_seconds_count - p.ccount)
        common = [r for r in iters if r in steps]
        if common:
            self._iterations.append(statistics.median(iters[r] for r in common))
            del self._iterations[:-200]
        if len(common) < 2:
            return []
        if all(r in device for r in common):
            own = {r: device[r] + waits[r] for r in common}
        elif any(ranks[r].compute_seconds_count > 0 for r in common):
            return []  # a GPU job between log steps: no fresh device time, and host time misleads
        else:
            own = _own_times({r: iters[r] for r in common}, {r: steps[r] for r in common})
        flagged = set()
        for r in common:
            base = statistics.median(own[k] for k in common if k != r)
            if own[r] > self.straggler_ratio * base and own[r] - base > self.min_excess_seconds:
                flagged.add(r)
        for r in common:
            # A rank's run of flagged windows, or of calm ones: each resets the other.
            self._streak[r] = self._streak.get(r, 0) + 1 if r in flagged else 0
            self._calm[r] = 0 if r in flagged else self._calm.get(r, 0) + 1
        current = set(self.stragglers())
        now_set = {r for r in current if self._calm.get(r, 0) < self.straggler_windows}
        now_set |= {r for r in common if self._streak.get(r, 0) >= self.straggler_windows}
        if now_set == current:
            return []
        if not now_set:
            old = self.active.pop(Signal.STRAGGLER)
            return [Finding(Signal.STRAGGLER, False, old.ranks, "Recovered", "no rank is straggling any more")]
        order = tuple(sorted(now_set))
        med = statistics.median(own.values())
        parts = []
        for r in order:
            o = own.get(r)
            factor = f" ({o / med:.1f}x the median {med * 1000:.0f}ms per step)" if o and med > 0 else ""
            parts.append(_describe(ranks[r]) + factor)
        f = Finding(Signal.STRAGGLER, True, order, Reason.SLOW_RANK, "straggling: " + "; ".join(parts))
        self.active[Signal.STRAGGLER] = f
        return [f]


def _by_stacks(f: Finding, culprit: stacks.Culprit | None, ranks: Mapping[int, RankSample]) -> Finding:
    """`f` naming the rank the stacks blame first, with its frames, where they blame one."""
    if culprit is None:
        return f
    named = tuple(dict.fromkeys((*culprit.ranks, *f.ranks)))
    return Finding(f.kind, f.active, named, f.reason, f"{f.message}; stacks: {stacks.describe(culprit.entry(ranks))}")


def _own_times(iters: dict[int, float], steps: dict[int, float]) -> dict[int, float]:
    """Each rank's own time per iteration, i.e. without the time it waited for its peers."""
    med = statistics.median(iters.values())
    lockstep = all(abs(v - med) <= 0.2 * med for v in iters.values()) if med > 0 else True
    if not lockstep:
        return dict(iters)
    fastest = min(steps.values())
    return {r: max(0.0, iters[r] - (steps[r] - fastest)) for r in iters}


def _stopped_ranks(ranks: Mapping[int, RankSample]) -> tuple[int, ...]:
    """Who stopped first: not started the step peers wait in, else behind, else everyone."""
    started = {r: s.step_started for r, s in ranks.items() if s.step_started is not None}
    if len(started) == len(ranks) and len(set(started.values())) > 1:
        top = max(started.values())
        return tuple(sorted(r for r, v in started.items() if v < top))
    top = max(s.step for s in ranks.values())
    behind = tuple(sorted(r for r, s in ranks.items() if s.step < top))
    return behind or tuple(sorted(ranks))


def _describe(s: RankSample) -> str:
    """'rank 3 (pod job-1 on node n7)' with whatever is known."""
    where = " ".join(w for w in (s.pod and f"pod {s.pod}", s.node and f"on node {s.node}") if w)
    return f"rank {s.rank}" + (f" ({where})" if where else "")
