"""What ends, restarts or repairs a DDPJob: small policies over one pass's observation (pure).

Each policy reads the facts lifecycle.observe gathered (no pods: plain values) and returns an
Action, or None to pass. POLICIES is their order and the first answer wins; when all pass, the
job is in its steady state (lifecycle.decide acts on the answer, and on the steady state).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from ddpjob_api.phases import FailReason, Reason
from ddpjob_api.phases import RestartReason as R


@dataclass(frozen=True)
class Failure:
    """One reason to restart (or fail) the group."""

    reason: str          # a RestartReason, or BadConfiguration (fatal)
    message: str
    counted: bool        # counts against failurePolicy.maxRestarts
    fatal: bool = False  # fails the job at once (no restart helps)


# What a pod of rank > 0 may be lost to and be replaced alone (the cluster took it, or someone
# deleted it): its launcher did not fail, so its peers' agents restart their workers in place and
# wait in the attempt's rendezvous for the replacement's (docs/restarts.md).
REPLACEABLE = frozenset({R.POD_DELETED.value, R.POD_EVICTED.value, R.POD_PREEMPTED.value, R.NODE_LOST.value})


@dataclass(frozen=True)
class Observation:
    """What the policies read of one pass."""

    finished: bool             # the status' finished phase holds (lifecycle.finished_claim_holds)
    suspend: bool              # spec.suspend
    deadline: int | None       # spec.activeDeadlineSeconds
    elapsed: float             # seconds since the deadline clock started
    lost: tuple[tuple[int, Failure], ...] = ()   # (rank, what its end means) of each pod that ended or vanished
    failures: tuple[Failure, ...] = ()           # those, and a stall the agents did not restart in place
    group_only: str | None = None                # why a lost pod restarts the group (lifecycle.group_only)
    counted_restarts: int = 0
    in_place: int = 0          # restarts in place so far: charged with the counted group restarts
    max_restarts: int = 0      # failurePolicy.maxRestarts

    @property
    def cause(self) -> Failure | None:
        """The failure a group restart would name: the first that costs the budget, else the first."""
        return next((f for f in self.failures if f.counted), self.failures[0]) if self.failures else None


class Act(str, enum.Enum):
    KEEP = "keep"          # stay finished: only cleanPodPolicy and the TTL act
    SUSPEND = "suspend"    # delete the pods, keep the counters
    FAIL = "fail"          # the job ends Failed
    REPLACE = "replace"    # recreate the lost pods alone; the others keep theirs
    RESTART = "restart"    # a new attempt of the whole group


@dataclass(frozen=True)
class Action:
    act: Act
    reason: str = ""
    message: str = ""
    cause: Failure | None = None   # what a group restart answers


def keep_finished(o: Observation) -> Action | None:
    return Action(Act.KEEP) if o.finished else None


def suspend(o: Observation) -> Action | None:
    return Action(Act.SUSPEND, Reason.SUSPENDED, "spec.suspend is true: pods deleted") if o.suspend else None


def deadline(o: Observation) -> Action | None:
    if o.deadline is None or o.elapsed < o.deadline:
        return None
    return Action(Act.FAIL, FailReason.DEADLINE_EXCEEDED, f"the job ran longer than spec.activeDeadlineSeconds={o.deadline}")


def bad_configuration(o: Observation) -> Action | None:
    """A pod exited 78 (lifecycle.verdict): no restart can help."""
    fatal = next((f for f in o.failures if f.fatal), None)
    return Action(Act.FAIL, fatal.reason, fatal.message) if fatal else None


def budget(o: Observation) -> Action | None:
    """Each pod's agent restarts in place within its own budget; the job's is spent when they
    together, with the group restarts, made more than failurePolicy.maxRestarts, or when the
    restart (or replacement) a counted failure asks for would. What the cluster did is free."""
    cause = o.cause
    if cause is not None and not cause.counted:
        return None
    used = o.counted_restarts + o.in_place
    if used + (cause is not None) <= o.max_restarts:
        return None
    if cause is None:
        return Action(Act.FAIL, FailReason.RESTART_LIMIT_EXCEEDED, f"{o.in_place} restart(s) in place and {o.counted_restarts} "
                      f"group restart(s): more than failurePolicy.maxRestarts={o.max_restarts}")
    return Action(Act.FAIL, FailReason.RESTART_LIMIT_EXCEEDED, f"{cause.message}; failurePolicy.maxRestarts={o.max_restarts} "
                  "restart(s) already used" + (f" ({o.in_place} of them in place)" if o.in_place else ""))


def replace_lost(o: Observation) -> Action | None:
    """Lost pods are recreated alone, unless one failed (its launcher or agent, or a spent in-place
    budget: its peers' agents may be failing too), rank 0 is lost (it hosts the c10d store every
    agent's rendezvous goes through), or the job is one group_only names."""
    if not o.lost or o.group_only is not None:
        return None
    if any(r == 0 or f.fatal or f.reason not in REPLACEABLE for r, f in o.lost):
        return None
    return Action(Act.REPLACE)


def restart_group(o: Observation) -> Action | None:
    cause = o.cause
    return Action(Act.RESTART, cause.reason, cause.message, cause=cause) if cause else None


# First answer wins: a finished job stays so, a suspended one waits; time and a bad configuration
# end the job whatever its pods did; the budget is checked before anything would spend it.
POLICIES: tuple[Callable[[Observation], Action | None], ...] = (
    keep_finished, suspend, deadline, bad_configuration, budget, replace_lost, restart_group)


def first(o: Observation) -> Action | None:
    """The first policy's answer (None: every policy passes, the steady state)."""
    return next((a for policy in POLICIES if (a := policy(o)) is not None), None)
