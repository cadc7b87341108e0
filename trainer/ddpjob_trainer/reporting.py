"""Rank-0-only logging and experiment tracking: other ranks get do-nothing reporters."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from ddpjob_api import contract
from .config import MlflowConfig


class NullReporter:
    """What every rank but 0 uses: all methods do nothing."""

    run_id: str | None = None  # the MLflow run, where there is one

    def info(self, msg: str) -> None:
        """Do nothing."""

    def warning(self, msg: str) -> None:
        """Do nothing."""

    def params(self, params: dict[str, Any]) -> None:
        """Do nothing."""

    def metrics(self, metrics: dict[str, float], *, step: int) -> None:
        """Do nothing."""

    def model(self, model: Any) -> None:
        """Do nothing."""

    def record(self, config: dict[str, Any], *, checkpoint: str | None) -> None:
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
    """Rank 0 with MLflow: one run per job, every call on a background thread (tracking.py).

    SIGTERM (a pod deleted, the group stopped) unwinds the rank (Terminated) and the run ends
    KILLED within tracking.KILLED_SECONDS; the rank exits 143.
    """

    def __init__(self, cfg: MlflowConfig, *, telemetry: Any = None, checkpoint_dir: str | None = None,
                 torch_mod: Any = None, device: Any = None, environ: Any = None) -> None:
        from . import tracking

        env = os.environ if environ is None else environ
        self._env, self._register_as = env, cfg.register_model
        count = telemetry.mlflow_dropped if telemetry is not None else (lambda reason: None)
        self.tracker = tracking.Tracker(
            tracking_uri=cfg.tracking_uri, experiment=cfg.experiment, run_name=cfg.run_name,
            key=tracking.run_key(env, checkpoint_dir=checkpoint_dir),
            tags=tracking.run_tags(env, torch_mod=torch_mod, device=device), warn=self.warning, count_drop=count,
            run_id=env.get(contract.ENV_MLFLOW_RUN_ID) or None,
            on_open=telemetry.mlflow_run if telemetry is not None else None)
        self._closed = self._terminating = False
        if cfg.required and (not self.tracker.ready.wait(tracking.START_SECONDS) or self.tracker.run_id is None):
            why = self.tracker.error or f"no answer within {tracking.START_SECONDS:.0f}s"
            self.close(status="FAILED")
            raise RuntimeError(f"spec.trainer.mlflow.required: no MLflow run at {contract.public_uri(cfg.tracking_uri)}: {why}")
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    @property
    def run_id(self) -> str | None:  # type: ignore[override]
        """The run's id once it is open (None until then, or without a server)."""
        return self.tracker.run_id

    def params(self, params: dict[str, Any]) -> None:
        """Log run parameters (nested sections flattened), once per run."""
        self.tracker.params(params)

    def metrics(self, metrics: dict[str, float], *, step: int) -> None:
        """Log metrics at a global step (queued; never waits for the server)."""
        self.tracker.metrics(metrics, step=step)

    def model(self, model: Any) -> None:
        """Log the trained model (rank 0, after training, outside any collective): a CPU copy is
        handed to the tracking thread, which saves and uploads it before the run ends."""
        import copy

        import torch

        self.tracker.model(copy.deepcopy(model).cpu(), torch_version=torch.__version__.split("+")[0],
                           register_as=self._register_as)

    def record(self, config: dict[str, Any], *, checkpoint: str | None) -> None:
        """Log the job's record at the end of a successful run: the job, its resolved trainer config
        (`config`) and the last checkpoint's path (queued, like every call)."""
        from . import tracking

        self.tracker.record(tracking.job_record(self._env, config, checkpoint=checkpoint))

    def close(self, *, status: str = "FINISHED") -> None:
        """Flush (within a deadline) and end the run with `status`."""
        if not self._closed:
            self._closed = True
            self.tracker.close(status)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Not close() here: the signal may have interrupted this very thread inside the tracker's
        # queue, holding its lock. Unwinding releases it; __main__ then ends the run KILLED.
        # torchrun may send SIGTERM twice: the second must not interrupt that close.
        if not self._terminating:
            self._terminating = True
            raise Terminated(signum)


class Terminated(KeyboardInterrupt):
    """SIGTERM on a rank that tracks a run: unwinds it like Ctrl-C, its run ends KILLED."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def make_reporter(*, rank: int, mlflow: MlflowConfig | None, **tracking: Any) -> NullReporter:
    """Rank 0 gets a real reporter; every other rank a do-nothing one. `tracking`: MlflowReporter's
    keyword arguments (telemetry, checkpoint_dir, torch_mod, device)."""
    if rank != 0:
        return NullReporter()
    return MlflowReporter(mlflow, **tracking) if mlflow else ConsoleReporter()
