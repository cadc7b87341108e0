"""The torch APIs that differ across the versions we support, and the private ones we still use.

pyproject allows torch from the trainer image's version (hack/versions.env, the floor) to the
newest; CI runs the trainer tiers on both ends (make test, make test-floor). Anything here that
a newer torch added or renamed gets the old spelling as a fallback, and a test of this module runs
on each end, so an upgrade that moves one of these names fails one test, not a user's job.
Nothing else in the trainer imports a private torch name (tests/unit/test_torchapi.py holds that).
"""
from __future__ import annotations

import datetime as dt
import os
from typing import Any, Mapping

import torch.distributed as dist

from ddpjob_api import contract

__all__ = ["TIMEOUT_SETTABLE_FOR_GLOO", "hook_agent", "load_dcp_state", "set_timeout",
           "torchrun_shutdown_seconds"]


def __getattr__(name: str) -> Any:
    """`StorageInfo`, imported on first use: importing DCP costs as much as importing torch, and a
    worker restarted in place that resumes from its snapshot needs none of it (checkpointing/storage.py says why)."""
    if name == "StorageInfo":
        # Where a shard's item lives (file, offset, length, transform descriptors): DCP's
        # FileSystemReader requires this class in a checkpoint's `.metadata`, and has no public name for it.
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        return _StorageInfo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Whether this torch can change a live group's timeout for every backend, gloo included.
TIMEOUT_SETTABLE_FOR_GLOO = hasattr(dist, "set_timeout")


def set_timeout(timeout: dt.timedelta, group: dist.ProcessGroup | None = None) -> bool:
    """Change a live group's collective timeout (the default group without `group`); False where
    this torch cannot, and the group keeps the timeout it was created with.

    Public as `dist.set_timeout` in newer torch. Older versions (2.8, the floor) have only the
    private `_set_pg_timeout`, which NCCL honours but gloo does not: measured on 2.8, a gloo
    all-reduce after it still waits the creation timeout (tests/unit/test_trainer_torchapi.py).
    """
    public = getattr(dist, "set_timeout", None)
    if public is not None:
        public(timeout, group)
        return True
    from torch.distributed.distributed_c10d import _set_pg_timeout
    _set_pg_timeout(timeout, group)
    return dist.get_backend(group) != "gloo"


def load_dcp_state(path: Any, storage_reader: Any) -> dict[str, Any]:
    """A DCP checkpoint's whole state rebuilt from its pickled `.metadata`, without a process group.

    Only for checkpoints written before DDPJob kept an index of its own (INDEX.json): reading
    `.metadata` unpickles torch's private classes, which a torch upgrade may move. The same
    private entry point torch's own dcp_to_torch_save uses.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=storage_reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def torchrun_shutdown_seconds(env: Mapping[str, str] = os.environ) -> float:
    """How long torchrun's agent lets its workers run after its own SIGTERM before it SIGKILLs them.

    Newer torch reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT (LaunchConfig.shutdown_timeout); 2.8, the
    floor, has no such setting and always gives 30 s.
    """
    from torch.distributed.launcher.api import LaunchConfig
    default = float(contract.TORCHRUN_SHUTDOWN_TIMEOUT_DEFAULT)
    if "shutdown_timeout" not in getattr(LaunchConfig, "__dataclass_fields__", {}):
        return default
    raw = env.get(contract.ENV_TORCHRUN_SHUTDOWN_TIMEOUT, "")
    try:
        return float(int(raw)) if raw else default
    except ValueError:  # torchrun itself fails on it, before any worker starts
        return default


def hook_agent(on_start: Any, on_failure: Any, on_monitor: Any = None) -> bool:
    """Have torchrun's agent (LocalElasticAgent, in this process) call `on_start(agent, group)`
    before each start of its workers, `on_monitor(agent, group)` before each look at them (every
    --monitor-interval, the workers running) and `on_failure(agent, group, failures, will_restart)`
    when workers failed (failures: {global rank: ProcessFailure}); False where this torch lacks the
    seams, and torchrun runs unhooked (restarts in place all the same, unattributed). A worker that
    exits EXIT_BAD_CONFIG ends the agent's restarts in place: no start of it can succeed.

    Both are protected methods (`_start_workers`, `_monitor_workers`) that every torch from the
    floor (2.8) to the newest has, with the same signatures; torchrun offers no public callback.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    start, monitor = getattr(LocalElasticAgent, "_start_workers", None), getattr(LocalElasticAgent, "_monitor_workers", None)
    if start is None or monitor is None:
        return False

    def _start_workers(self, worker_group):
        on_start(self, worker_group)
        return start(self, worker_group)

    def _monitor_workers(self, worker_group):
        if on_monitor is not None:
            on_monitor(self, worker_group)
        result = monitor(self, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            if any(getattr(f, "exitcode", None) == contract.EXIT_BAD_CONFIG for f in result.failures.values()):
                # A bad configuration fails every start the same way: the round ends here and the
                # pod fails with it (the job's BadConfiguration), its restarts in place not spent.
                self._remaining_restarts = 0
            on_failure(self, worker_group, dict(result.failures), getattr(self, "_remaining_restarts", 0) > 0)
        return result

    LocalElasticAgent._start_workers = _start_workers  # type: ignore[method-assign]
    LocalElasticAgent._monitor_workers = _monitor_workers  # type: ignore[method-assign]
    return True
