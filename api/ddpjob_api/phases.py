"""The words of a DDPJob's status, as Enums (their values are what the API shows): phases, condition
types, and every reason the operator writes into a condition, the status or an Event. One home: a
test finds none of these values spelled outside this package (tests/unit/test_contract.py)."""
from __future__ import annotations

import enum


class Word(str, enum.Enum):
    """A word the API shows: str() and f-strings give the value, as json.dumps does (a plain
    str-mixin Enum formats as `Class.MEMBER` from Python 3.11 on)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Phase(Word):
    """status.phase of a DDPJob."""

    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"

    @property
    def finished(self) -> bool:
        """Succeeded and Failed are terminal."""
        return self in (Phase.SUCCEEDED, Phase.FAILED)

    @classmethod
    def parse(cls, value: str | None) -> "Phase | None":
        """Phase from a status string; None when absent or unknown."""
        try:
            return cls(value) if value else None
        except ValueError:
            return None


class RestartReason(Word):
    """Why the group restarted (status.failures[].reason, the restart event, and the label of
    ddpjob_operator_jobs_restarted_total, whose series all start at zero from this list)."""

    POD_FAILED = "PodFailed"          # a container exited non-zero
    POD_DELETED = "PodDeleted"        # someone deleted a pod
    POD_EVICTED = "PodEvicted"        # eviction, drain, node pressure or shutdown
    POD_PREEMPTED = "PodPreempted"    # the scheduler or Kueue took the pod's place
    NODE_LOST = "NodeLost"            # the node is gone or stopped reporting
    STALLED = "Stalled"               # no step progress; failurePolicy.restartOnHang


class Cond(Word):
    """metav1-style condition types the operator owns."""

    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    UNSCHEDULABLE = "Unschedulable"
    CONTAINERS_NOT_STARTING = "ContainersNotStarting"
    FAILED_CREATE_POD = "FailedCreatePod"
    NODE_NOT_READY = "NodeNotReady"
    RESIZED = "Resized"   # an elastic job trains on fewer nodes while a lost pod's replacement is not running
    GANG_SCHEDULED = "GangScheduled"
    ADMITTED = "Admitted"
    LIGHTHOUSE_READY = "LighthouseReady"   # a per-step job's torchft Lighthouse pod is Ready (serves quorums)


class FailReason(Word):
    """status.reason of a Failed job the operator decided (besides Cond.FAILED_CREATE_POD and a
    pod's start error), and the label of ddpjob_operator_jobs_failed_total."""

    BAD_CONFIGURATION = "BadConfiguration"           # a rank exited 78: retrying cannot help
    RESTART_LIMIT_EXCEEDED = "RestartLimitExceeded"  # failurePolicy.maxRestarts spent
    DEADLINE_EXCEEDED = "DeadlineExceeded"           # spec.activeDeadlineSeconds passed


class Recovery(Word):
    """status.restartHistory[].kind: how the job recovered (and the label of the recovery metrics)."""

    IN_PLACE = "InPlace"   # torchrun's agents restarted the workers; the pods stayed
    GROUP = "Group"        # a new attempt of every pod
    REPLACE = "Replace"    # a lost pod recreated alone


class Signal(Word):
    """What the health tracker finds in a running job (status.health[].kind)."""

    STRAGGLER = "Straggler"
    STALLED = "Stalled"


class Reason(Word):
    """The other reasons of the operator's conditions, status and Events."""

    CREATED = "Created"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"                  # after a suspension; a stall that ended
    RESTARTING = "Restarting"
    UNSCHEDULABLE = "Unschedulable"      # Kubernetes' own word for a pod the scheduler cannot place
    FEWER_NODES = "FewerNodes"           # an elastic job trains on fewer nodes (Cond.RESIZED)
    ALL_NODES = "AllNodes"
    NODES_READY = "NodesReady"
    NAME_CONFLICT = "NameConflict"       # a pod of the job's name that is not the job's
    WAITING_FOR_GANG = "WaitingForGang"
    RESTARTING_IN_PLACE = "RestartingInPlace"
    RESTARTED_IN_PLACE = "RestartedInPlace"
    REPLACING_POD = "ReplacingPod"
    POD_REPLACED = "PodReplaced"
    NO_PROGRESS = "NoProgress"
    STALLED_RANK_RESTARTED = "StalledRankRestarted"
    STUCK_IN_STAGE = "StuckInStage"
    SLOW_RANK = "SlowRank"
    NO_STRAGGLER = "NoStraggler"
    STRAGGLER_RECOVERED = "StragglerRecovered"
