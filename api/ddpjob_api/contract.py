"""What the operator, the local runner, the in-pod launcher and the trainer agree on, defined
once: the pod's command, the environment a pod gets, the exit codes a node reports, the metrics a
rank exports and the operator reads, and the run's result.

It lives in the API package (ddpjob_api), which the operator, the trainer and the CLI all stand
on and none of them owns; it imports nothing but the standard library (`os`, `re`, `pathlib`,
`typing`, `dataclasses`), so no side pays for another's dependencies.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping
from dataclasses import dataclass

# A pod's command before the user's (the operator's pods, the trainer image's ENTRYPOINT, the
# local runner's nodes): the in-pod launcher, ddpjob_trainer/launch/.
LAUNCHER_MODULE = "ddpjob_trainer.launch"
LAUNCHER = ("python", "-m", LAUNCHER_MODULE, "--")

# Exit codes of a rank, a node's launcher and the local runner.
EXIT_OK = 0
EXIT_TRAINING_FAILED = 1   # may be retried (group restart, resume from checkpoint)
EXIT_BAD_CONFIG = 78       # EX_CONFIG: retrying cannot help; fail the job at once

# Set by the operator in every pod (operator/ddpjob_operator/builders/envvars.py) and by the local runner.
# torch's rendezvous names, for a user's script that reads them (and the launcher's DNS wait):
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_NNODES = "NNODES"
ENV_NODE_RANK = "NODE_RANK"
ENV_NPROC_PER_NODE = "NPROC_PER_NODE"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_UNBUFFERED = "PYTHONUNBUFFERED"       # "1": `kubectl logs` and the local runner see errors at once
ENV_OMP_THREADS = "OMP_NUM_THREADS"       # the local runner's share of the host's cores per rank
ENV_JOB_NAME = "DDPJOB_NAME"
ENV_JOB_NAMESPACE = "DDPJOB_NAMESPACE"
ENV_JOB_UID = "DDPJOB_UID"                # the DDPJob's metadata.uid; locally, one per name + work dir
ENV_ATTEMPT = "DDPJOB_ATTEMPT"            # the group attempt: 0, then +1 per restart
ENV_IMAGE = "DDPJOB_IMAGE"                # spec.image (the MLflow run's tag ddpjob.image)
ENV_POD_METRICS_PORT = "DDPJOB_METRICS_PORT"  # the pod's metrics endpoint (not the operator's own)
DEFAULT_MASTER_PORT = 29500  # MASTER_PORT when the operator set none (spec.masterPort's default; torch's)
ENV_TRAINER_CONFIG = "DDPJOB_TRAINER_CONFIG"  # spec.trainer as JSON (built-in trainer only)
ENV_CPUS = "DDPJOB_CPUS"                  # the pod's CPU request, via the downward API
ENV_LOCAL = "DDPJOB_LOCAL"                # "1" under `ddpjob run --local`
ENV_GPUS_PER_NODE = "DDPJOB_GPUS_PER_NODE"  # spec.gpusPerNode: > 0, every local rank needs a GPU
# spec.faultTolerance (torchft, per-step): set on every training pod (or local node) of such a job,
# absent otherwise. Each pod is one replica group: its torchrun is a world of its own (nnodes 1,
# MASTER_ADDR its own address, so other groups reach its store), NODE_RANK is the group's index and
# NNODES the number of groups.
ENV_FT_LIGHTHOUSE = "DDPJOB_FT_LIGHTHOUSE"  # the Lighthouse's URL, http://host:port
ENV_FT_MIN_REPLICAS = "DDPJOB_FT_MIN_REPLICAS"  # spec.faultTolerance.minReplicas
ENV_FT_TIMEOUT = "DDPJOB_FT_TIMEOUT_SECONDS"  # spec.faultTolerance.timeoutSeconds
ENV_FT_QUORUM_TIMEOUT = "DDPJOB_FT_QUORUM_TIMEOUT_SECONDS"  # spec.faultTolerance.quorumTimeoutSeconds
ENV_FT_HOST = "DDPJOB_FT_HOST"  # the address other groups reach this group at (the pod's IP; locally 127.0.0.1)
FT_LIGHTHOUSE_PORT = 29510  # the Lighthouse's port (its pod's, its Service's; locally on loopback)
# The id of the Lighthouse's incarnation (ddpjob_trainer.lighthouse) is served on the port after
# the Lighthouse's, at the same host (names.lighthouse_id_url): 29511 in a pod, locally the port
# after the local Lighthouse's.
FT_LIGHTHOUSE_ID_PORT = FT_LIGHTHOUSE_PORT + 1
# Seconds from a stop's SIGTERM to the launcher's SIGKILL of the node's processes: the operator
# derives it from the pod's terminationGracePeriodSeconds (stop_grace); the launcher passes the
# value it uses on to the ranks, whose last checkpoint must fit in it.
ENV_STOP_GRACE = "DDPJOB_STOP_GRACE_SECONDS"

# Set by the launcher (or the local runner) for the ranks below it.
ENV_METRICS_DIR = "DDPJOB_METRICS_DIR"    # prometheus-client's multiprocess dir, one per node
ENV_STATUS_DIR = "DDPJOB_STATUS_DIR"      # a failing rank's reason (failed-/bad-config-rank-N.txt)
ENV_RESULT_FILE = "DDPJOB_RESULT_FILE"    # rank 0's final numbers (JSON)
ENV_TELEMETRY = "DDPJOB_TELEMETRY"        # "0": no metrics at all
# torch.distributed.elastic's: where an entrypoint decorated with @record writes its exception,
# and where torchrun copies the first failed worker's (a user's script gets its traceback into
# the pod's termination message by decorating its main with @record).
ENV_TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
# torchrun's agent SIGKILLs its workers this many seconds after its own SIGTERM (read by torch
# releases that have the setting; 30 s, fixed, before them): the launcher sets it to its grace.
ENV_TORCHRUN_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCHRUN_SHUTDOWN_TIMEOUT_DEFAULT = 30

# The fabric's, set from spec.nccl (builders/envvars.py) and spec.rdma (builders/rdma.py); the
# trainer fills in torch's NCCL fault handling where neither did (tuning.py).
ENV_NCCL_P2P_DISABLE = "NCCL_P2P_DISABLE"
ENV_NCCL_IB_DISABLE = "NCCL_IB_DISABLE"
ENV_NCCL_DEBUG = "NCCL_DEBUG"
ENV_NCCL_DEBUG_SUBSYS = "NCCL_DEBUG_SUBSYS"
ENV_NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
ENV_NCCL_NET = "NCCL_NET"
ENV_TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
ENV_TORCH_NCCL_BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"
ENV_FI_PROVIDER = "FI_PROVIDER"                        # libfabric's provider (EFA)
ENV_FI_EFA_USE_DEVICE_RDMA = "FI_EFA_USE_DEVICE_RDMA"

# Set by torchrun in each worker it starts (read, never set, by us; not scanned as literals by
# tests/unit/test_contract.py: "RANK" is also a column header).
TORCHRUN_RANK = "RANK"
TORCHRUN_LOCAL_RANK = "LOCAL_RANK"
TORCHRUN_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
TORCHRUN_GROUP_RANK = "GROUP_RANK"

# torchrun's flags as env (torch.distributed.run reads PET_<FLAG>).
PET_NNODES = "PET_NNODES"
PET_NODE_RANK = "PET_NODE_RANK"
PET_NPROC_PER_NODE = "PET_NPROC_PER_NODE"
PET_MASTER_ADDR = "PET_MASTER_ADDR"
PET_MASTER_PORT = "PET_MASTER_PORT"
PET_RDZV_BACKEND = "PET_RDZV_BACKEND"
PET_RDZV_ENDPOINT = "PET_RDZV_ENDPOINT"
PET_RDZV_CONF = "PET_RDZV_CONF"
PET_RDZV_ID = "PET_RDZV_ID"
PET_MAX_RESTARTS = "PET_MAX_RESTARTS"
PET_LOCAL_ADDR = "PET_LOCAL_ADDR"
# "1": each rendezvous round gets a store of its own for the workers. torchrun's default shares
# the rendezvous's first store across rounds, unprefixed, and restarted workers then read the
# addresses of the previous round's (dead) workers: gloo's connect is refused and the restart
# fails again (seen with torch 2.15).
ENV_TORCH_NO_SHARED_RDZV_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# Kubernetes' terminationGracePeriodSeconds for a pod spec that does not set it.
POD_TERMINATION_GRACE_DEFAULT = 30
# The launcher's grace where nothing sets ENV_STOP_GRACE (a local run, a launcher run by hand).
STOP_GRACE_DEFAULT = 5.0
# After its own SIGKILL the launcher waits this long for the killed processes to vanish before
# giving up on them (one stuck in uninterruptible kernel sleep cannot be reaped; waiting longer
# would only hang the launcher).
LAUNCHER_KILL_WAIT = 5.0
# The part of a pod's grace period the launcher keeps for itself after that SIGKILL (its kill wait,
# then its termination message and exit), so that the kubelet never has to SIGKILL the pod.
STOP_MARGIN_SECONDS = LAUNCHER_KILL_WAIT + 2.0


def stop_grace(termination_grace_seconds: float) -> float:
    """The launcher's SIGTERM-to-SIGKILL time in a pod with this terminationGracePeriodSeconds:
    the grace period less STOP_MARGIN_SECONDS (0 when the grace is shorter than the margin)."""
    return max(0.0, float(termination_grace_seconds) - STOP_MARGIN_SECONDS)


# spec.trainer.mlflow.experiment when unset: the trainer logs there, the operator's pods get it as
# MLFLOW_EXPERIMENT_NAME.
MLFLOW_DEFAULT_EXPERIMENT = "ddpjob"
# MLflow's own variables (what plain `mlflow` calls in a user's script read). The operator (and the
# local runner) set the URI and experiment; node 0's launcher finds or creates the job's one run
# and sets MLFLOW_RUN_ID for every rank below it (the other nodes' launchers look it up).
ENV_MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"
ENV_MLFLOW_EXPERIMENT = "MLFLOW_EXPERIMENT_NAME"
ENV_MLFLOW_RUN_ID = "MLFLOW_RUN_ID"
# From the Secret spec.trainer.mlflow.credentialsSecret names (its keys: MLFLOW_SECRET_KEYS).
ENV_MLFLOW_TOKEN = "MLFLOW_TRACKING_TOKEN"
ENV_MLFLOW_USERNAME = "MLFLOW_TRACKING_USERNAME"
ENV_MLFLOW_PASSWORD = "MLFLOW_TRACKING_PASSWORD"
MLFLOW_SECRET_KEYS = {ENV_MLFLOW_TOKEN: "token", ENV_MLFLOW_USERNAME: "username", ENV_MLFLOW_PASSWORD: "password"}
# Set when the job tracks (spec.trainer.mlflow): "required" (spec.trainer.mlflow.required: no run
# fails the attempt) or "optional". Only then does a launcher find or create the run: an
# MLFLOW_TRACKING_URI of the user's own (spec.env, a local shell) asks for nothing.
ENV_MLFLOW = "DDPJOB_MLFLOW"
ENV_MLFLOW_SYSTEM_METRICS = "DDPJOB_MLFLOW_SYSTEM_METRICS"  # "1": spec.trainer.mlflow.systemMetrics
ENV_MLFLOW_RUN_NAME = "DDPJOB_MLFLOW_RUN_NAME"  # spec.trainer.mlflow.runName, for the run a launcher creates
# 1 for the job's MLflow run, on rank 0's series (labels run_id, experiment_id): how the operator
# learns the run for status.mlflow.
MLFLOW_RUN_INFO = "mlflow_run_info"

# Every metric a rank exports starts with this; the operator's scraper keeps only these.
METRIC_PREFIX = "ddpjob_trainer_"
# The series of a rank (names after METRIC_PREFIX) that the operator reads into its progress,
# health and status (cluster/scrape.py); the rest are for Prometheus alone. A counter's samples
# end in _total, a histogram's in _sum and _count.
STEP = "step"                          # optimizer steps done
STEP_STARTED = "step_started"          # the step whose batch the rank has
EPOCH = "epoch"
TOTAL_STEPS = "total_steps"
LOSS = "loss"
SAMPLES = "samples"                    # counter
STEP_SECONDS = "step_seconds"          # histogram
COMPUTE_SECONDS = "compute_seconds"    # histogram (GPU ranks only)
DATA_WAIT_SECONDS = "data_wait_seconds"  # counter
LAST_STEP_TIMESTAMP = "last_step_timestamp_seconds"
EVAL_ACCURACY = "eval_accuracy"
EVAL_LOSS = "eval_loss"
CHECKPOINT_SECONDS = "checkpoint_seconds"
RESTART_COUNT = "restart_count"
GPU_MEMORY_ALLOCATED = "gpu_memory_allocated_bytes"
GPU_MEMORY_MAX_ALLOCATED = "gpu_memory_max_allocated_bytes"
# `stage{stage=S}` is 1 for the stage a rank is in, one of STAGES, in the order a job passes through
# them (the operator names the earliest one a stuck rank is in); the stage began at STAGE_START.
STAGE = "stage"
STAGES = ("waiting_for_master", "rendezvous", "process_group_init", "first_step", "training", "eval",
          "checkpoint")
STAGE_START_TIMESTAMP = "stage_start_timestamp_seconds"
# Where a job's wall time went (docs/goodput.md): every second from its creation to its end in exactly
# one of these, in this order (the operator's status.goodput, the local runner's summary).
GOODPUT_CATEGORIES = ("queued", "starting", "training", "checkpointing", "evaluating", "recovering",
                      "recomputing", "stalled", "suspended")
# `goodput_seconds_total{category=C}`: a rank's own seconds in category C, beside its stage (a
# counter, summed over every worker process the rank had in its pod). No rank runs while a job is
# queued or suspended, so those two are the operator's alone; the rest a rank sees as: starting
# from its node's launcher to its first step, recovering from a failure its agent saw to its
# restarted worker's first step, training and recomputing the steps' time (recomputing: the steps up
# to the one reached before the failure), checkpointing and evaluating the time in those stages,
# stalled the time without progress before its agent killed it for a stall.
GOODPUT_SECONDS = "goodput_seconds"
RANK_GOODPUT_CATEGORIES = tuple(c for c in GOODPUT_CATEGORIES if c not in ("queued", "suspended"))
# The stages whose time is a category of its own (the rest of a rank's time is its steps').
STAGE_GOODPUT = {"eval": "evaluating", "checkpoint": "checkpointing"}

# Stalled: no progress (a step, or a rank beginning a stage) for the job's hang timeout. One rule
# for the operator's monitor (decisions/health.py: the Stalled condition, the group restart when
# nothing else helped) and each pod's agent (agent.py: a stalled rank's workers restarted in place).
ENV_HANG_TIMEOUT = "DDPJOB_HANG_TIMEOUT_SECONDS"  # spec.hangTimeoutSeconds; unset: hang_timeout derives it
ENV_RESTART_ON_HANG = "DDPJOB_RESTART_ON_HANG"    # "1": failurePolicy.restartOnHang (the agent's watchdog on)
MIN_HANG_TIMEOUT = 300.0       # while stepping, at least this
HANG_STEP_MULTIPLE = 20.0      # ... or this many step times
STARTUP_HANG_TIMEOUT = 600.0   # before the first step and in eval/checkpoint (the trainer's own start-up limits)
HANG_PAUSES = ("eval", "checkpoint")  # stages between steps, judged from their own start
# The error line of a worker the agent killed for a stall (its failure record; the operator matches
# it, STALL_ERROR_RE, to give the in-place restart the reason Stalled).
STALL_ERROR = "stalled: no progress for {idle:.0f}s in {stage} (hang timeout {timeout:.0f}s)"
STALL_ERROR_RE = re.compile(r"^stalled: no progress for (\d+)s in [a-z_]+( after step (\d+))? \(hang timeout \d+s\)$")


def stall_step(error: str | None) -> int | None:
    """The last step of a rank its agent killed for a stall (STALL_ERROR's "after step N"), else None."""
    m = STALL_ERROR_RE.match(error or "")
    return int(m.group(3)) if m and m.group(3) else None


def stall_seconds(error: str | None) -> float | None:
    """How long a rank its agent killed for a stall had made no progress (STALL_ERROR's idle), else None."""
    m = STALL_ERROR_RE.match(error or "")
    return float(m.group(1)) if m else None


def startup_hang_timeout(trainer: Mapping[str, Any] | None) -> float:
    """The least hang timeout before the first step and in a pause, for a job whose spec.trainer is
    `trainer`: STARTUP_HANG_TIMEOUT, or the built-in trainer's own start-up limit
    (spec.trainer.timeoutSeconds, the process group's timeout until the first step) where a user
    raised it past that: a start-up the trainer itself still waits for is no hang."""
    try:
        own = float((trainer or {}).get("timeoutSeconds") or 0)
    except (TypeError, ValueError, AttributeError):
        own = 0.0
    return max(STARTUP_HANG_TIMEOUT, own)


def hang_timeout(configured: float | None, *, stage: str | None, step_seconds: float | None = None,
                 startup: float = STARTUP_HANG_TIMEOUT) -> float:
    """The hang timeout in force for a job (or a rank) in `stage` (None: before its first step; a
    start-up stage is judged as that, whatever steps an earlier worker of the rank took):
    `configured` (spec.hangTimeoutSeconds) when set; else, while stepping, max(MIN_HANG_TIMEOUT,
    HANG_STEP_MULTIPLE x the step time), and before the first step or in a pause at least
    `startup` (startup_hang_timeout)."""
    if configured:
        return float(configured)
    derived = max(MIN_HANG_TIMEOUT, HANG_STEP_MULTIPLE * step_seconds) if step_seconds else MIN_HANG_TIMEOUT
    # A start-up stage counts as before the first step even when the rank stepped before: the
    # worker an in-place restart started restores and meets its peers again first.
    if stage is None or stage in HANG_PAUSES or stage in STAGES[:STAGES.index("training")]:
        return max(startup, derived)
    return derived


# The words of failure_head, which failure_step parses back.
_EXITED, _AT_STEP = "training exited with code ", " at step "


def failure_head(code: int, step: int | None) -> str:
    """The first line of a failed node's termination message (launch/report.failure_message): the
    exit code, and the newest step its ranks finished where they took one. The operator reads the
    step back (failure_step) for a group restart's stepAtFailure: the failed pod's last scrape may
    be a scrape interval or more older than its failure, and once the pod has ended it is not
    scraped again."""
    return f"{_EXITED}{code}" + (f"{_AT_STEP}{step}" if step is not None else "")


_FAILURE_HEAD = re.compile(re.escape(_EXITED) + r"-?\d+(?:" + re.escape(_AT_STEP) + r"(\d+))?")


def failure_step(message: str | None) -> int | None:
    """The step failure_head wrote on the first line of a termination message, else None."""
    m = _FAILURE_HEAD.fullmatch((message or "").lstrip().split("\n", 1)[0].strip())
    return int(m.group(1)) if m and m.group(1) else None


def stall_error(*, idle: float, stage: str, step: int | None, timeout: float) -> str:
    """The failure record of a worker killed for a stall (STALL_ERROR)."""
    where = stage + (f" after step {step}" if step is not None else "")
    return STALL_ERROR.format(idle=idle, stage=where, timeout=timeout)


@dataclass
class RunResult:
    """What rank 0 reports when training ends: the run-result file (ENV_RESULT_FILE) holds its
    fields and RESULT_MLFLOW_RUN_ID as one JSON object, which node 0's launcher makes its
    termination message (naming the run it resolved where rank 0's tracker had not opened it yet),
    the operator status.result (decisions/result.py) and the local runner its summary."""

    steps: int
    total_steps: int
    epochs_completed: int
    world_size: int
    resumed_from_step: int
    train_samples_per_second: float
    eval_accuracy: float | None
    eval_loss: float | None
    eval_samples: int | None
    eval_dataset_size: int | None
    last_checkpoint: str | None


RESULT_MLFLOW_RUN_ID = "mlflow_run_id"  # the job's MLflow run, also in a user's script's result


def debug_dir(checkpoint_dir: str, attempt: int | str) -> str:
    """Where an attempt's crash evidence (NCCL flight-recorder dumps) goes: beside the checkpoints,
    on the volume every node shares and that outlives the pods; the trainer writes there, the
    operator names it in status.failures."""
    return f"{checkpoint_dir.rstrip('/')}/debug/attempt-{attempt}"


_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@")


def public_uri(text: str) -> str:
    """`text` (a URI, or a message naming one) without URIs' userinfo (`https://user:pass@host` ->
    `https://host`): what may be printed, logged as an MLflow param or shown in a status (a link
    that still works, unlike the operator's redaction `***@`). Credentials belong in a Secret
    (MLFLOW_TRACKING_TOKEN, ..._USERNAME/_PASSWORD), but a URI that carries them must not spread them."""
    return _USERINFO.sub(r"\1", text)


# Restart in place: torchrun's agent (run as `python -m ddpjob_trainer.agent`) restarts a pod's
# workers where they are, up to PET_MAX_RESTARTS times, re-forming the group through the c10d
# rendezvous. Each start of a pod's workers prints this line first (restart 0: the attempt's first
# start), so a pod's log splits into its worker starts (`ddpjob logs --attempt` filters on it).
INPLACE_MARKER = "==> ddpjob: attempt {attempt} restart {restart} <=="
INPLACE_MARKER_RE = re.compile(r"^==> ddpjob: attempt (\d+) restart (\d+) <==$")
# In-memory snapshots (checkpointing/snapshot.py): under the pod's /dev/shm (a memory-backed
# emptyDir that outlives a worker restarted in place), or where DDPJOB_SNAPSHOT_DIR says.
SNAPSHOT_SHM = "/dev/shm"
# Snapshots a rank keeps (the newest); while the next is written one more is there, as `.part`.
# The operator sizes the pod's /dev/shm for SNAPSHOTS_KEPT + 1 copies of every rank's state.
SNAPSHOTS_KEPT = 2
ENV_SNAPSHOT_DIR = "DDPJOB_SNAPSHOT_DIR"


def snapshot_root(env: Mapping[str, str] = os.environ) -> Path:
    """Where a job's snapshots live: DDPJOB_SNAPSHOT_DIR, else /dev/shm/ddpjob-<uid or name>."""
    if env.get(ENV_SNAPSHOT_DIR):
        return Path(env[ENV_SNAPSHOT_DIR])
    key = env.get(ENV_JOB_UID) or env.get(ENV_JOB_NAME) or "local"
    return Path(SNAPSHOT_SHM) / f"ddpjob-{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}"


# Set by the agent for the workers it starts: the pod's worker start in this attempt (0, 1, ...).
ENV_RESTART = "DDPJOB_RESTART"
# ... and, for a restart, the Unix time of the failure it saw and the newest step the pod's ranks had
# finished then: a restarted rank's time up to its first step is recovering, its steps up to that
# one recomputing (GOODPUT_SECONDS).
ENV_FAILED_AT = "DDPJOB_FAILED_AT"
ENV_STEP_REACHED = "DDPJOB_STEP_REACHED"
# Set by the launcher for the ranks it starts: the Unix time it started (a rank's starting counts from it).
ENV_NODE_STARTED = "DDPJOB_NODE_STARTED"
# 1 per worker failure the agent saw on this pod, valued the failure's Unix time; labels: the
# failed rank's, `restart` (the pod's worker start that failed), `exit_code`, `signal`, `error`
# (the first line that names the error), `restarted` ("true": the agent restarted in place;
# "false": its budget was spent and the pod fails, for a group restart), `step` (the step the
# failed rank had finished, read from its STEP gauge at the failure; "" when unknown: the steps an
# in-place restart lost). The operator turns these into status.restartHistory.
WORKER_FAILURE = "worker_failure_timestamp_seconds"
# Per rank, from the worker process that runs now: when it finished its first step, and the step
# it resumed from (the recovery time of an in-place restart, and the steps it lost).
FIRST_STEP_TIMESTAMP = "first_step_timestamp_seconds"
RESUMED_FROM_STEP = "resumed_from_step"


def inplace_marker(attempt: int | str, restart: int | str) -> str:
    """The marker line of one start of a pod's workers (INPLACE_MARKER)."""
    return INPLACE_MARKER.format(attempt=attempt, restart=restart)


# Stacks (ddpjob_trainer/stacks.py, docs/health.md): every worker process below a launcher has
# faulthandler registered on STACK_SIGNAL (the exit guard's sitecustomize, for the built-in trainer
# and a user's own script alike), dumping every thread's Python stack into
# <ENV_STACKS_DIR>/<pid>.txt; the pod's agent sends it before it kills a stalled worker, when a
# rank has been idle for STACK_IDLE_FRACTION of its hang timeout, and to the peers still running
# when a worker failed. Each capture is kept in <ENV_STACKS_DIR>/captures/ (the pod's endpoint
# serves them as JSON at STACKS_PATH, the operator keeps them in the job's ConfigMap) and named by
# a STACK_CAPTURE series: labels `restart`, `trigger` (STACK_TRIGGERS), `waiting` (the collective
# the rank's main thread waits in, "" when none), `frames` (its innermost frames); value its time.
STACK_SIGNAL = "SIGUSR2"
ENV_STACKS_DIR = "DDPJOB_STACKS_DIR"
STACK_CAPTURE = "stack_capture_timestamp_seconds"
STACKS_PATH = "/stacks"
STACK_IDLE, STACK_STALL, STACK_FAILURE = "idle", "stall", "failure"
STACK_TRIGGERS = (STACK_IDLE, STACK_STALL, STACK_FAILURE)
STACK_IDLE_FRACTION = 0.5
# What a capture may hold: each rank's dump, and the frames a STACK_CAPTURE series names.
STACK_TEXT_BYTES = 16 * 1024
STACK_FRAMES = 3
STACK_FRAMES_CHARS = 300
# Between a capture's frames, innermost first ("ddpjob_trainer/debug.py:95 _block < ...").
STACK_FRAME_SEPARATOR = " < "


def stack_capture_text(record: Mapping[str, Any], *, where: str = "") -> str:
    """One capture record as text: a header line (rank, `where` it ran, attempt, restart, trigger,
    time, the collective it waits in), then its dump. How the agent's captures read everywhere:
    the job's ConfigMap, `ddpjob logs --stacks`, `ddpjob stacks`, the local runner."""
    import time

    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(record.get("time") or 0)))
    head = (f"=== rank {record.get('rank')}{where}, attempt {record.get('attempt')} restart {record.get('restart')}: "
            f"{record.get('trigger')} capture at {when}")
    if record.get("waiting"):
        head += f", waiting in {record['waiting']}"
    return head + " ===\n" + str(record.get("text") or "").rstrip("\n") + "\n"


def stacks_configmap(job_name: str) -> str:
    """The ConfigMap (owned by the DDPJob) in which the operator keeps the job's captured stacks."""
    return f"{job_name}-stacks"
