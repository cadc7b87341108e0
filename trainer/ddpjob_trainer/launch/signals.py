"""Stop signals: SIGTERM (a pod deletion) and SIGINT (Ctrl-C) become a Stop in the main thread,
and the grace every process of the node gets before SIGKILL."""
from __future__ import annotations

import os
import signal

from ddpjob_api import contract
from ..errors import ConfigError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stop(BaseException):
    """A stop signal arrived. A BaseException (like KeyboardInterrupt) so that no `except
    Exception` on the way swallows it before the process tree is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopSignals:
    """SIGTERM/SIGINT handling: the first signal raises Stop in the main thread while `armed`
    (disarm around cleanup that must not be interrupted); every later one only hurries the
    shutdown (no more grace)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self.armed = True

    def install(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
        if self.armed and self.count == 1:
            raise Stop(signum)

    def raise_if_stopped(self) -> None:
        """Raise Stop again for a signal that already arrived. The handler's own raise can be
        lost: when the signal lands while Python runs a weakref callback or __del__ (an import's
        module-lock cleanup, say), the exception is printed as "Exception ignored" and dropped,
        and the launcher would wait on until SIGKILL. Blocking waits call this between tries."""
        if self.signum is not None and self.armed:
            raise Stop(self.signum)

    def hurry(self) -> bool:
        """True once a second signal arrived (Ctrl-C pressed again): skip what is left of the grace."""
        return self.count > 1

    @property
    def exit_code(self) -> int | None:
        """128 + the first signal's number (130 SIGINT, 143 SIGTERM), None when none arrived."""
        return None if self.signum is None else 128 + self.signum


def stop_grace_from_env(env=os.environ) -> float:
    """DDPJOB_STOP_GRACE_SECONDS (default 5; the operator sets it from the pod's
    terminationGracePeriodSeconds): seconds between SIGTERM and SIGKILL on a stop."""
    raw = env.get(contract.ENV_STOP_GRACE, "")
    try:
        value = float(raw) if raw else contract.STOP_GRACE_DEFAULT
    except ValueError:
        raise ConfigError(f"{contract.ENV_STOP_GRACE}: not a number of seconds: {raw!r}") from None
    if value < 0:
        raise ConfigError(f"{contract.ENV_STOP_GRACE}: must be >= 0, got {raw!r}")
    return value
