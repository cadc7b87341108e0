"""Fixtures shared by unit tests."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def termination_log(tmp_path, monkeypatch) -> Path:
    """The launcher writes its termination message here instead of /dev/termination-log; its
    scratch files (result, per-rank status) go where it chooses, as in a pod."""
    from ddpjob_trainer import launch

    term = tmp_path / "termination-log"
    monkeypatch.setattr(launch, "TERMINATION_LOG", str(term))
    from prometheus_client import values

    for var in ("DDPJOB_RESULT_FILE", "DDPJOB_STATUS_DIR", "DDPJOB_METRICS_DIR", "PROMETHEUS_MULTIPROC_DIR"):
        # Set, then deleted, so that monkeypatch restores the absence: the launcher points its own
        # process's metrics at a scratch dir that it removes on exit, which must not leak into
        # later tests (nor must prometheus-client's multiprocess value class).
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    return term
