"""Performance defaults a GPU run needs, each overridable in spec.trainer (see config.py).

Everything here resolves an `auto` or applies a backend switch once, before the model is built;
nothing runs per step.
"""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Callable

import torch

from ddpjob_api import contract
from ddpjob_api.trainerdefaults import IN_MEMORY_DATASETS, MAX_AUTO_WORKERS
from .config import AUTO, TrainerConfig
from .errors import ConfigError
from .reporting import NullReporter

CNN_MODELS = ("convnet", "resnet18", "resnet50")

# Set before init_process_group (the operator's env builder may set them too; a user's value wins).
NCCL_ENV_DEFAULTS = {
    # A failed or timed-out collective aborts the communicator and the process, so torchrun and
    # the operator see a failure and restart the group, instead of every rank hanging.
    contract.ENV_TORCH_NCCL_ASYNC_ERROR_HANDLING: "3",
    # Flight recorder: the last collectives of each rank, dumped when a collective times out,
    # so a hang names the rank and the collective that never arrived.
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/ddpjob_nccl_trace_rank_",
}


def set_nccl_env_defaults(environ=os.environ, *, debug_dir: str | None = None) -> dict[str, str]:
    """Fill in NCCL fault-handling defaults that are not already set; returns what was set.

    With `debug_dir` (contract.debug_dir: on the checkpoint volume) the flight recorder dumps
    there instead of the pod's /tmp, which a group restart deletes with the pod.
    """
    defaults = dict(NCCL_ENV_DEFAULTS)
    if debug_dir:
        Path(debug_dir).mkdir(parents=True, exist_ok=True)
        defaults["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = f"{debug_dir}/nccl_trace_rank_"
    added = {key: value for key, value in defaults.items() if key not in environ}
    environ.update(added)
    return added


def available_cpus(environ=os.environ) -> int:
    """CPUs this pod may use: DDPJOB_CPUS (the pod's CPU request, via the downward API) if set,
    else the affinity mask capped by a cgroup CPU quota (a pod's limit)."""
    if environ.get(contract.ENV_CPUS):
        try:
            return max(1, math.floor(float(environ[contract.ENV_CPUS])))
        except ValueError:
            raise ConfigError(f"{contract.ENV_CPUS}: expected a number of CPUs, got {environ[contract.ENV_CPUS]!r}") from None
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(n, math.floor(quota))) if quota else max(1, n)


def _cgroup_cpu_quota() -> float | None:
    v2 = Path("/sys/fs/cgroup/cpu.max")
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        q = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
        p = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
        if q.is_file() and p.is_file():
            quota_us = int(q.read_text())
            return None if quota_us <= 0 else quota_us / int(p.read_text())
    except (OSError, ValueError):
        return None
    return None


def resolve_num_workers(cfg: TrainerConfig, *, local_world_size: int, cpus: int | None = None) -> int:
    """DataLoader workers per rank: cfg.num_workers, or the `auto` rule documented in config.py."""
    if cfg.num_workers != AUTO:
        return int(cfg.num_workers)
    if cfg.dataset in IN_MEMORY_DATASETS:
        return 0
    cpus = available_cpus() if cpus is None else cpus
    return max(1, min(MAX_AUTO_WORKERS, cpus // max(1, local_world_size) - 1))


def use_channels_last(cfg: TrainerConfig, device: torch.device) -> bool:
    """channels_last memory format: explicit setting, or on for CNNs on GPU."""
    if cfg.channels_last != AUTO:
        return bool(cfg.channels_last)
    return device.type == "cuda" and cfg.model in CNN_MODELS


def static_graph(cfg: TrainerConfig) -> bool:
    """DDP static_graph: explicit setting, or on where the built-in loop keeps the graph fixed."""
    if cfg.ddp.static_graph != AUTO:
        return bool(cfg.ddp.static_graph)
    # no_sync() micro-batches and compiled graphs are where static_graph has had bugs; the
    # plain loop uses every parameter every step, which is what static_graph assumes.
    return not cfg.compile and cfg.grad_accum_steps == 1


def apply_backend_switches(cfg: TrainerConfig, device: torch.device) -> None:
    """cuDNN autotuning and TF32 for fp32 math, on GPU only."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    precision = "tf32" if cfg.tf32 else "ieee"
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = precision
        # (torch.backends.cudnn.conv is in torch's typing only from some version on)
        torch.backends.cudnn.conv.fp32_precision = precision  # type: ignore[attr-defined,unused-ignore]
    else:  # older torch
        matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32


def autocast_dtype(cfg: TrainerConfig, device: torch.device, *, log: NullReporter,
                   bf16_supported: Callable[..., bool] | None = None) -> torch.dtype | None:
    """bf16 autocast where asked for and the GPU runs it natively; bf16 required but impossible is
    a config error. `bf16_supported` stands in for torch.cuda.is_bf16_supported (same signature).

    `auto` on a GPU without bf16 trains in fp32 and says so (a warning line, every start).
    """
    if device.type != "cuda" or cfg.precision == "fp32":
        if cfg.precision == "bf16" and device.type != "cuda":
            log.warning("precision bf16 applies to GPUs; this rank runs on the CPU in fp32")
        return None
    # Natively only: torch's default also counts GPUs that merely emulate bf16 (before Ampere),
    # where autocast runs slower than fp32.
    if (bf16_supported or torch.cuda.is_bf16_supported)(including_emulation=False):
        return torch.bfloat16
    name = str(device) if bf16_supported else torch.cuda.get_device_name(device)
    if cfg.precision == "bf16":
        raise ConfigError(f"spec.trainer.precision: bf16 requested but {name} has no native bf16 support "
                          "(use precision fp32, or auto to fall back with a warning)")
    log.warning(f"precision auto: {name} has no native bf16 support; training in fp32")
    return None


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The autocast context for the resolved dtype (a no-op context for full precision)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
