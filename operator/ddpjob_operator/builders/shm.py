"""The size of a pod's /dev/shm (pure).

DataLoader workers hand every batch to their rank through shared memory: each worker keeps
`prefetchFactor` batches there, so a pod needs room for processes x workers x prefetch batches, or
its workers die with "Bus error" mid-epoch. A fixed size is either too small for image batches
(8 ranks of 224x224 float32 batches overflow 2Gi) or wasteful; the built-in trainer's config says
how much it will hold, so the default is computed from it. `spec.shmSize` still wins.

The trainer's defaults and its `numWorkers: auto` bounds come from the API (ddpjob_api.trainerdefaults),
where the trainer's config takes them too.

The in-memory snapshots live there too (docs/restarts.md): with `checkpoint.dir` and
`snapshotEverySteps` set, every rank keeps its newest snapshots of the whole state (parameters
plus the optimizer's moments) in the pod's /dev/shm. That room is memory the pod's limit counts,
so it is sized from the built-in model's parameter count, computed below from the sample shape
and the class count as torch builds the model (held equal to it by tests/unit/test_shm.py).
"""
from __future__ import annotations

import math
from typing import Any

from ddpjob_api import contract
from ddpjob_api import trainerdefaults as defaults
from ddpjob_api.spec import JobSpec
from ddpjob_operator.builders.envvars import cpu_request

GIB = 1024 ** 3
# Below the batches: NCCL's shared-memory transport between local ranks and torch's own IPC, which
# need room without any loader worker (the size every pod had before it was computed).
FLOOR_BYTES = 2 * GIB
FLOAT32_BYTES = 4
LABEL_BYTES = 8          # one int64 class index per sample

DIGITS_SHAPE = (1, 8, 8)    # scikit-learn's digits, as the trainer's data set yields them


def sample_shape(trainer: dict[str, Any]) -> tuple[int, ...]:
    """One sample's tensor shape as the built-in trainer's data set yields it (float32)."""
    dataset = trainer.get("dataset") or defaults.DATASET
    if dataset == "imagefolder":
        size = int(trainer.get("imageSize") or defaults.IMAGE_SIZE)
        return (3, size, size)
    if dataset == "synthetic":
        return tuple((trainer.get("synthetic") or {}).get("shape") or defaults.SYNTHETIC_SHAPE)
    return DIGITS_SHAPE


def _cpus(quantity: Any) -> int | None:
    """Whole CPUs of a CPU quantity, rounded up as the downward API's divisor 1 does (None: unknown)."""
    if quantity is None:
        return None
    text = str(quantity)
    try:
        value = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return None
    return max(1, math.ceil(value))


def loader_workers(trainer: dict[str, Any], *, ranks: int, cpus: int | None) -> int:
    """DataLoader workers per rank: numWorkers, or what `auto` resolves to in the pod; with no CPU
    request the trainer counts the node's CPUs, unknown here, so the most `auto` can pick."""
    workers = trainer.get("numWorkers", "auto")
    if workers != "auto":
        return int(workers)
    if (trainer.get("dataset") or defaults.DATASET) in defaults.IN_MEMORY_DATASETS:
        return 0
    if cpus is None:
        return defaults.MAX_AUTO_WORKERS
    return max(1, min(defaults.MAX_AUTO_WORKERS, cpus // max(1, ranks) - 1))


def loader_bytes(trainer: dict[str, Any], *, ranks: int, cpus: int | None) -> int:
    """Bytes the loaders of one pod hold in shared memory at most: ranks x workers x prefetch x batch."""
    workers = loader_workers(trainer, ranks=ranks, cpus=cpus)
    if workers == 0:
        return 0
    batch = int(trainer.get("batchSize") or defaults.BATCH_SIZE)
    prefetch = int(trainer.get("prefetchFactor") or defaults.PREFETCH_FACTOR)
    batch_bytes = batch * (math.prod(sample_shape(trainer)) * FLOAT32_BYTES + LABEL_BYTES)
    return ranks * workers * prefetch * batch_bytes


# An image folder's classes are counted by the trainer when it reads the folder, not known here:
# ImageNet's 1000 bound the classifier of most folders (and the body dominates anyway).
IMAGEFOLDER_CLASSES = 1000
# torchvision's resnets: parameters before the classifier (3 input channels, whatever the data's)
# and the classifier's input width.
RESNETS = {"resnet18": (11_176_512, 512), "resnet50": (23_508_032, 2048)}


def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def num_classes(trainer: dict[str, Any]) -> int:
    """The classifier's width for the trainer's data set."""
    dataset = trainer.get("dataset") or defaults.DATASET
    if dataset == "imagefolder":
        return IMAGEFOLDER_CLASSES
    if dataset == "synthetic":
        return int((trainer.get("synthetic") or {}).get("numClasses") or defaults.NUM_CLASSES)
    return defaults.NUM_CLASSES


def model_params(trainer: dict[str, Any]) -> int:
    """Parameters of the built-in model (ddpjob_trainer.models) for the trainer's data."""
    model, shape, classes = trainer.get("model") or defaults.MODEL, sample_shape(trainer), num_classes(trainer)
    if model in RESNETS:
        body, width = RESNETS[model]
        return body + _linear(width, classes)
    if model == "mlp":
        return _linear(math.prod(shape), 256) + _linear(256, 256) + _linear(256, classes)
    return (_linear(shape[0] * 9, 32) + _linear(32 * 9, 64) + _linear(64 * 16, 128)  # convnet
            + _linear(128, classes))


def snapshot_bytes(trainer: dict[str, Any], *, ranks: int) -> int:
    """Bytes one pod's snapshots hold at most: ranks x (kept + the one being written) x the state,
    float32 parameters and the optimizer's per-parameter moments (AdamW's two, SGD's momentum)."""
    ckpt = trainer.get("checkpoint") or {}
    if not ckpt.get("dir") or not ckpt.get("snapshotEverySteps", defaults.SNAPSHOT_EVERY_STEPS):
        return 0
    if (trainer.get("optimizer") or defaults.OPTIMIZER) == "adamw":
        moments = 2
    else:
        moments = int(float(trainer.get("momentum", defaults.MOMENTUM)) != 0)
    state = model_params(trainer) * FLOAT32_BYTES * (1 + moments)
    return ranks * (contract.SNAPSHOTS_KEPT + 1) * state


def shm_size(job: JobSpec) -> str:
    """sizeLimit of the pod's /dev/shm: spec.shmSize, else the floor plus what the built-in trainer's
    loaders and snapshots hold, in whole GiB (a `command:` job's are unknown: the floor)."""
    given = job.spec.shm_size
    if given:
        return str(given)
    held = 0
    if job.uses_builtin_trainer:
        held = (loader_bytes(job.trainer, ranks=job.nproc_per_node, cpus=_cpus(cpu_request(job)))
                + snapshot_bytes(job.trainer, ranks=job.nproc_per_node))
    return f"{math.ceil((FLOOR_BYTES + held) / GIB)}Gi"
