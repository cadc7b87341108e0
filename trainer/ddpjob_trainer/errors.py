"""Exit codes the launcher, the local runner and the operator agree on."""
from __future__ import annotations

EXIT_OK = 0
EXIT_TRAINING_FAILED = 1   # may be retried (group restart, resume from checkpoint)
EXIT_BAD_CONFIG = 78       # EX_CONFIG: retrying cannot help; fail the job at once


class ConfigError(ValueError):
    """A bad trainer configuration or missing input: the job must not be retried."""
