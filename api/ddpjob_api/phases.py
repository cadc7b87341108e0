"""Job phases and condition types, as Enums (their values are what the API shows)."""
from __future__ import annotations

import enum


class Phase(str, enum.Enum):
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


class RestartReason(str, enum.Enum):
    """Why the group restarted (status.failures[].reason, the restart event, and the label of
    ddpjob_operator_jobs_restarted_total, whose series all start at zero from this list)."""

    POD_FAILED = "PodFailed"          # a container exited non-zero
    POD_DELETED = "PodDeleted"        # someone deleted a pod
    POD_EVICTED = "PodEvicted"        # eviction, drain, node pressure or shutdown
    POD_PREEMPTED = "PodPreempted"    # the scheduler or Kueue took the pod's place
    NODE_LOST = "NodeLost"            # the node is gone or stopped reporting
    STALLED = "Stalled"               # no step progress; failurePolicy.restartOnHang


class Cond(str, enum.Enum):
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
