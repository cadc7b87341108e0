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
    for var in ("DDPJOB_RESULT_FILE", "DDPJOB_STATUS_DIR"):
        monkeypatch.delenv(var, raising=False)
    return term
