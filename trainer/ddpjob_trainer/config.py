"""Built-in trainer configuration: DDPJob `spec.trainer`, validated against the CRD's own schema
(crdschema.py: keys, types, bounds, enums and rules live there only), then mapped onto these frozen
dataclasses, which hold the defaults."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from ddpjob_api import contract, crdschema
from ddpjob_api import trainerdefaults as defaults
from .errors import ConfigError

AUTO = "auto"


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often checkpoints are written."""

    dir: str | None = None
    every_steps: int = 0          # 0: only at epoch end
    keep: int = 3
    # Write on a background thread from a host copy: training pauses only for the copy. A crash
    # during the write loses that checkpoint (never half of it): the previous one is loaded.
    async_save: bool = True
    # Every N steps each rank's state also goes to /dev/shm (0: never); a worker restarted in place
    # resumes from it when it is newer than the newest disk checkpoint (checkpointing/snapshot.py).
    snapshot_every_steps: int = defaults.SNAPSHOT_EVERY_STEPS


@dataclass(frozen=True)
class SyntheticConfig:
    """Generated tensors; labels are a fixed function of the input so the task is learnable."""

    train_size: int = 4096
    val_size: int = 1024
    shape: tuple[int, ...] = defaults.SYNTHETIC_SHAPE
    num_classes: int = defaults.NUM_CLASSES
    seed: int = 1234


@dataclass(frozen=True)
class DdpConfig:
    """DistributedDataParallel options (the trainer sets each one explicitly; none is left to torch).

    bufferSync: how BatchNorm running statistics, which each rank updates from its own batches,
    are made identical before every evaluation and checkpoint: `average` (all-reduce mean of
    floating buffers: statistics of every rank's data) or `broadcast` (rank 0's copy). DDP's own
    per-forward buffer broadcast is always off: it costs a collective per step and still leaves
    eval on rank 0's statistics only.
    staticGraph: DDP static_graph; unset (auto) turns it on where it is valid for the built-in
    loop (no torch.compile, no gradient accumulation).
    bucketCapMb: gradient bucket size in MiB (DDP's bucket_cap_mb).
    """

    buffer_sync: str = "average"
    static_graph: str | bool = AUTO
    bucket_cap_mb: int = 25


@dataclass(frozen=True)
class MlflowConfig:
    """Optional MLflow tracking, used by rank 0 only, from a background thread (tracking.py).

    required: a tracking server unreachable at start fails the attempt (retried like any training
    failure); by default it is a warning and training goes on untracked.
    register_model: after a successful run, the logged model becomes a new version of this
    registered model (created when absent); unset (the default): nothing is registered.
    """

    tracking_uri: str
    experiment: str = contract.MLFLOW_DEFAULT_EXPERIMENT
    run_name: str | None = None
    required: bool = False
    credentials_secret: str | None = None  # the operator's business (env from a Secret); here for the record
    register_model: str | None = None
    system_metrics: bool = False  # each node's launcher logs them (tracking.system_metrics); here for the record


@dataclass(frozen=True)
class TrainerConfig:
    """Everything the built-in trainer needs; built only through `parse_config`."""

    dataset: str = defaults.DATASET
    model: str = defaults.MODEL
    epochs: int = 10
    batch_size: int = defaults.BATCH_SIZE
    lr: float = 0.05
    momentum: float = defaults.MOMENTUM
    weight_decay: float = 0.0
    optimizer: str = defaults.OPTIMIZER
    scheduler: str = "cosine"
    warmup_steps: int = 0
    grad_accum_steps: int = 1
    # linear: lr is the learning rate at the world size the run started at, scaled with the global
    # batch when the run resumes at another one (an elastic job that shrank or grew); none: kept.
    lr_scaling: str = "linear"
    max_steps: int = 0            # 0: no cap (benchmarks and tests cap the run)
    # DataLoader worker processes per rank; `auto`: none for in-memory data sets (digits,
    # synthetic: a worker only adds IPC), for imagefolder the CPUs this pod may use divided by
    # its local ranks, one left for the training process, at most 8.
    num_workers: int | str = AUTO
    prefetch_factor: int = defaults.PREFETCH_FACTOR   # only with workers
    precision: str = "auto"       # auto: bf16 where the GPU has it (warned otherwise); bf16: required
    compile: bool = False
    cudnn_benchmark: bool = True  # GPU only: pick conv algorithms once per input shape
    tf32: bool = True             # GPU only: TF32 tensor cores for fp32 matmuls and convolutions
    # Unset (auto): on for CNNs on GPU (NHWC is the layout tensor-core convolutions read).
    channels_last: str | bool = AUTO
    seed: int = 0
    timeout_seconds: int = 600    # process-group timeout until the first step: start-up, rendezvous
    # After the first step a collective that hangs this long is a hang, not a slow start (0: keep
    # timeoutSeconds). Short, so a dead peer fails the group instead of holding every GPU.
    step_timeout_seconds: int = 300
    log_every_steps: int = 10
    data_path: str | None = None
    val_path: str | None = None
    image_size: int = defaults.IMAGE_SIZE
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ddp: DdpConfig = field(default_factory=DdpConfig)
    mlflow: MlflowConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form, stored in checkpoints."""
        return dataclasses.asdict(self)


def _snake(key: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower()


def _build(cls: type, raw: dict[str, Any]) -> Any:
    """A config dataclass from validated camelCase data: `batchSize` is field `batch_size`, a mapping
    the field's own dataclass, a list a tuple, an integer where a float is declared a float."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        name = _snake(key)
        kinds = typing.get_args(hints[name]) or (hints[name],)
        nested = next((k for k in kinds if dataclasses.is_dataclass(k)), None)
        if nested is not None:
            value = _build(nested, value)  # type: ignore[arg-type]
        elif isinstance(value, list):
            value = tuple(value)
        elif float in kinds and isinstance(value, int):
            value = float(value)
        kwargs[name] = value
    return cls(**kwargs)


def parse_config(raw: dict[str, Any] | None, *, path: str = "spec.trainer",
                 default_tracking_uri: str | None = None) -> TrainerConfig:
    """Validate `spec.trainer` (camelCase keys) against the CRD's schema into a TrainerConfig; raise
    ConfigError naming the key. `default_tracking_uri`: mlflow.trackingUri when unset (the pod's
    MLFLOW_TRACKING_URI, which the operator sets from the job or from its cluster-wide default)."""
    raw = crdschema.pruned(raw or {})
    found = crdschema.problems(raw, path, crdschema.trainer_schema())
    if found:
        raise ConfigError("; ".join(found))
    mlflow = raw.get("mlflow")
    if mlflow is not None and "trackingUri" not in mlflow:
        if not default_tracking_uri:
            raise ConfigError(f"{path}.mlflow.trackingUri: required when mlflow is set and the operator has no "
                              "default tracking URI (chart value mlflow.defaultTrackingUri)")
        raw = {**raw, "mlflow": {**mlflow, "trackingUri": default_tracking_uri}}
    cfg: TrainerConfig = _build(TrainerConfig, raw)
    if cfg.dataset == "imagefolder" and not cfg.data_path:
        raise ConfigError(f"{path}.dataPath: required when dataset is imagefolder")
    if cfg.dataset == "digits" and cfg.model in ("resnet18", "resnet50"):
        raise ConfigError(f"{path}.model: {cfg.model} needs 3-channel images; digits are 1x8x8 "
                          "(use convnet or mlp, or dataset synthetic/imagefolder)")
    return cfg


def config_from_env(environ: dict[str, str] | None = None) -> TrainerConfig:
    """Read DDPJOB_TRAINER_CONFIG (JSON of spec.trainer) as injected by the operator."""
    env = os.environ if environ is None else environ
    text = env.get(contract.ENV_TRAINER_CONFIG, "{}")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{contract.ENV_TRAINER_CONFIG}: not valid JSON ({exc})") from None
    return parse_config(raw, default_tracking_uri=env.get(contract.ENV_MLFLOW_TRACKING_URI) or None)

