"""`python -m ddpjob_trainer.agent [torchrun flags] ...`: torchrun, counted and attributed.

The launcher runs the built-in trainer under this instead of `python -m torch.distributed.run`.
It is torchrun itself (same flags, same PET_* env, same agent), with two hooks into its agent
(torchapi.hook_agent):

- before each start of this pod's workers it prints the marker line (contract.INPLACE_MARKER:
  `==> ddpjob: attempt A restart R <==`, R = 0 for the attempt's first start) and hands R to
  the workers (contract.ENV_RESTART);
- when a worker fails it exports the failure on the pod's metrics endpoint
  (contract.WORKER_FAILURE: rank, exit code, signal, the error's first line, whether the agent
  restarts in place, the step the rank had finished), which the operator turns into
  status.restartHistory.

Why torchrun's agent restarts the workers in place (not a supervisor of ours): it already
restarts a pod's workers where they are (`--max-restarts`), and through the c10d rendezvous every
other pod's agent sees the new round and restarts its workers too, so the group re-forms in
seconds without a pod deleted, an image pulled or a node rescheduled; its budget per pod is
PET_MAX_RESTARTS, the operator's the whole job's (failurePolicy.maxRestarts).
"""
from __future__ import annotations

import os
import sys
from typing import Any

from . import contract

ERROR_CHARS = 200  # the error's first line as a label: a pod's exposition stays small


def error_line(status_dir: str | None, rank: int, failure: Any) -> str:
    """The line that names why `rank` failed: the last line of the trainer's record of it (a
    traceback ends with the exception), else torchrun's account (a signal: no record)."""
    record = os.path.join(status_dir, f"failed-rank-{rank}.txt") if status_dir else ""
    try:
        with open(record, errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        lines = []
    if lines:
        text = lines[-1]
    else:
        sig = failure.signal_name() if getattr(failure, "exitcode", 0) < 0 else ""
        text = f"killed by {sig}" if sig and sig != "<N/A>" else f"exit code {failure.exitcode}"
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text[:ERROR_CHARS]


def steps_reached(metrics_dir: str) -> dict[str, int]:
    """The step each rank of this pod last finished, by rank label: its `step` gauge as the pod's
    endpoint serves it (mostrecent over every worker process that had the rank, a dead one's file
    included), read at the failure to the fraction of a second. {} when unreadable: the failure
    is exported without it, never lost for it."""
    from prometheus_client.multiprocess import MultiProcessCollector

    name = contract.METRIC_PREFIX + contract.STEP
    try:
        return {s.labels.get("rank", ""): int(s.value) for m in MultiProcessCollector(None, path=metrics_dir).collect()
                if m.name == name for s in m.samples}
    except Exception:  # noqa: BLE001  (a torn or foreign file in the dir)
        return {}


class Hooks:
    """What the agent's hooks keep: the starts so far and the failure series."""

    def __init__(self, env: dict[str, str] | os._Environ = os.environ) -> None:
        self.env = env
        self.starts = 0
        self.attempt = env.get(contract.ENV_ATTEMPT, "0")
        self._gauge: Any = None

    def on_start(self, _agent: Any, _group: Any) -> None:
        restart = self.starts
        self.starts += 1
        # The workers inherit the agent's environment (torchrun adds its own on top).
        os.environ[contract.ENV_RESTART] = str(restart)
        print(contract.inplace_marker(self.attempt, restart), file=sys.stderr, flush=True)

    def on_failure(self, _agent: Any, group: Any, failures: dict[int, Any], will_restart: bool) -> None:
        import time

        status_dir = self.env.get(contract.ENV_STATUS_DIR)
        restart = str(max(0, self.starts - 1))
        steps = steps_reached(self.env[contract.ENV_METRICS_DIR]) if self._exports else {}
        for rank, failure in sorted(failures.items()):
            code = int(getattr(failure, "exitcode", 1))
            sig = failure.signal_name() if code < 0 else ""
            self._series(rank=rank, local_rank=getattr(failure, "local_rank", 0), restart=restart, exit_code=code,
                         signal=sig if sig != "<N/A>" else "", error=error_line(status_dir, rank, failure),
                         restarted=will_restart, step=steps.get(str(rank), "")).set(time.time())
        if will_restart and status_dir and os.path.isdir(status_dir):
            # Consumed: the next failure's record (or the node's final one, for its termination
            # message) must not be this one.
            for name in os.listdir(status_dir):
                if name.startswith("failed-rank-"):
                    os.replace(os.path.join(status_dir, name), os.path.join(status_dir, f"restart-{restart}-{name}"))

    @property
    def _exports(self) -> bool:
        return self.env.get(contract.ENV_TELEMETRY, "1") != "0" and bool(self.env.get(contract.ENV_METRICS_DIR))

    def _series(self, **labels: Any) -> Any:
        if not self._exports:
            return _Null()
        if self._gauge is None:
            from .telemetry import LABELS, _prepare_multiprocess
            _prepare_multiprocess()
            from prometheus_client import CollectorRegistry, Gauge
            self._gauge = Gauge(contract.METRIC_PREFIX + contract.WORKER_FAILURE,
                                "Unix time a worker of this pod failed (1 series per failure).",
                                [*LABELS, "restart", "exit_code", "signal", "error", "restarted", "step"],
                                registry=CollectorRegistry(), multiprocess_mode="mostrecent")
        return self._gauge.labels(
            ddpjob=self.env.get(contract.ENV_JOB_NAME, "local"), namespace=self.env.get(contract.ENV_JOB_NAMESPACE, ""),
            rank=str(labels["rank"]), local_rank=str(labels["local_rank"]), node_rank=self.env.get("NODE_RANK", "0"),
            restart=labels["restart"], exit_code=str(labels["exit_code"]), signal=labels["signal"],
            error=labels["error"], restarted="true" if labels["restarted"] else "false", step=str(labels["step"]))


class _Null:
    def set(self, _value: float) -> None:
        pass


def main() -> None:
    from torch.distributed import run

    from . import torchapi

    hooks = Hooks()
    if not torchapi.hook_agent(hooks.on_start, hooks.on_failure):
        print("[ddpjob-agent] WARNING this torch's agent has no hooks: in-place restarts are not "
              "counted on the metrics endpoint", file=sys.stderr, flush=True)
    run.main()


if __name__ == "__main__":
    main()
