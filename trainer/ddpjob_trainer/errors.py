"""The trainer's errors, and the exit codes they map to (defined in contract)."""
from __future__ import annotations

from ddpjob_api.contract import EXIT_BAD_CONFIG, EXIT_OK, EXIT_TRAINING_FAILED

__all__ = ["ConfigError", "EXIT_BAD_CONFIG", "EXIT_OK", "EXIT_TRAINING_FAILED", "PeerStopped"]


class ConfigError(ValueError):
    """A bad trainer configuration or missing input: the job must not be retried."""


class PeerStopped(RuntimeError):
    """This rank got no stop signal but a peer did (preempt.py): the group stops, and is restarted,
    together; not this rank's fault."""
