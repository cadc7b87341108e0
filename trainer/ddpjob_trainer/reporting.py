"""Rank-0-only logging and experiment tracking: other ranks get do-nothing reporters."""
from __future__ import annotations

import sys
import time
from typing import Any

from .config import MlflowConfig
from .errors import ConfigError


class NullReporter:
    """What every rank but 0 uses: all methods do nothing."""

    def info(self, msg: str) -> None:
        """Do nothing."""

    def warning(self, msg: str) -> None:
        """Do nothing."""

    def params(self, params: dict[str, Any]) -> None:
        """Do nothing."""

    def metrics(self, metrics: dict[str, float], *, step: int) -> None:
        """Do nothing."""

    def close(self, *, status: str = "FINISHED") -> None:
        """Do nothing."""


class ConsoleReporter(NullReporter):
    """Rank 0: timestamped lines on stdout."""

    def info(self, msg: str) -> None:
        """Print an informational line."""
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stdout, flush=True)

    def warning(self, msg: str) -> None:
        """Print a warning line (stderr, so it shows even when stdout is quiet)."""
        print(f"[{time.strftime('%H:%M:%S')}] WARNING {msg}", file=sys.stderr, flush=True)


class MlflowReporter(ConsoleReporter):
    """Rank 0 with MLflow: params once, metrics per log interval (seed 000's setup)."""

    def __init__(self, cfg: MlflowConfig) -> None:
        try:
            import mlflow
        except ImportError:
            raise ConfigError("spec.trainer.mlflow: mlflow is not installed in this image "
                              "(pip install 'ddpjob[mlflow]')") from None
        self._mlflow = mlflow
        mlflow.set_tracking_uri(cfg.tracking_uri)
        mlflow.set_experiment(cfg.experiment)
        mlflow.start_run(run_name=cfg.run_name)

    def params(self, params: dict[str, Any]) -> None:
        """Log flattened run parameters."""
        self._mlflow.log_params(params)

    def metrics(self, metrics: dict[str, float], *, step: int) -> None:
        """Log metrics at a step."""
        self._mlflow.log_metrics(metrics, step=step)

    def close(self, *, status: str = "FINISHED") -> None:
        """End the MLflow run."""
        self._mlflow.end_run(status=status)


def make_reporter(*, rank: int, mlflow: MlflowConfig | None) -> NullReporter:
    """Rank 0 gets a real reporter; every other rank a do-nothing one."""
    if rank != 0:
        return NullReporter()
    return MlflowReporter(mlflow) if mlflow else ConsoleReporter()
