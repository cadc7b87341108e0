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
    GANG_SCHEDULED = "GangScheduled"
    ADMITTED = "Admitted"
