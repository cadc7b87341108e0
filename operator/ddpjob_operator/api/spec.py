"""The DDPJob spec as plain data: defaults applied once, read everywhere."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ddpjob_api import contract

GROUP = "ddpjob.dev"
VERSION = "v1alpha1"
KIND = "DDPJob"
PLURAL = "ddpjobs"
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_METRICS_PORT = 9400
DEFAULT_KEEP_FAILED_ATTEMPTS = 1


@dataclass(frozen=True)
class Gang:
    """spec.scheduling.gang: the gang scheduler that places all of the job's pods or none."""

    scheduler: str
    schedule_timeout_seconds: int | None = None   # coscheduling's PodGroup timeout
    queue: str | None = None                      # Volcano's queue


@dataclass(frozen=True)
class Scheduling:
    """spec.scheduling: one pod per node (unless false), the gang, and the pod fields it sets
    (schedulerName, nodeSelector, ... as given: they pass through to every pod)."""

    one_pod_per_node: bool = True
    gang: Gang | None = None
    pod_fields: dict[str, Any] = field(default_factory=dict)


def _scheduling(raw: Any) -> Scheduling:
    sched = dict(raw) if isinstance(raw, dict) else {}
    gang = sched.pop("gang", None)
    timeout = gang.get("scheduleTimeoutSeconds") if isinstance(gang, dict) else None
    return Scheduling(
        one_pod_per_node=sched.pop("onePodPerNode", True) is not False,
        gang=Gang(str(gang["scheduler"]), int(timeout) if timeout else None, str(gang["queue"]) if gang.get("queue") else None)
        if isinstance(gang, dict) and gang.get("scheduler") else None,
        pod_fields=sched)


@dataclass(frozen=True)
class JobSpec:
    """A DDPJob manifest with defaults applied; `raw` keeps pass-through fields."""

    name: str
    namespace: str
    uid: str
    nodes: int
    nproc_per_node: int
    gpus_per_node: int
    image: str
    command: list[str] | None
    args: list[str] | None
    trainer: dict[str, Any]
    env: list[dict[str, Any]]
    master_port: int
    metrics_port: int
    nccl: dict[str, Any]
    max_restarts: int
    elastic: dict[str, Any] | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    scheduling: Scheduling = field(default_factory=Scheduling)

    @property
    def world_size(self) -> int:
        """Total processes: nodes x processes per node."""
        return self.nodes * self.nproc_per_node

    @property
    def min_nodes(self) -> int:
        """Fewest nodes the rendezvous accepts: spec.elastic.minNodes, else spec.nodes."""
        return int((self.elastic or {}).get("minNodes", self.nodes))

    @property
    def max_nodes(self) -> int:
        """Most nodes that may join the rendezvous: spec.elastic.maxNodes, else spec.nodes."""
        return int((self.elastic or {}).get("maxNodes", self.nodes))

    @property
    def uses_builtin_trainer(self) -> bool:
        """True when the job runs our trainer rather than the user's command."""
        return not self.command

    @property
    def spec(self) -> dict[str, Any]:
        """The raw spec dict (pass-throughs such as volumes and scheduling)."""
        return self.raw.get("spec") or {}

    # Operator-only fields, read from the raw spec (the CRD supplies the defaults on a cluster;
    # the same defaults are repeated here for manifests that never went through an API server).
    @property
    def suspend(self) -> bool:
        """True while the job is suspended (no pods)."""
        return bool(self.spec.get("suspend", False))

    @property
    def launcher(self) -> bool:
        """Wrap the container command in ddpjob's launcher."""
        return bool(self.spec.get("launcher", True))

    @property
    def restart_on_hang(self) -> bool:
        """Restart a stalled job: in place (each pod's agent), the group when that did not help."""
        return bool((self.spec.get("failurePolicy") or {}).get("restartOnHang", True))

    @property
    def log_tail_in_status(self) -> bool:
        """Copy failed containers' own words (termination message / log end, redacted) into
        status and events; off: reason and exit code only (readers of a DDPJob may not be
        readers of its pods' logs)."""
        return bool((self.spec.get("failurePolicy") or {}).get("logTailInStatus", False))

    @property
    def keep_failed_attempts(self) -> int:
        """How many failed attempts back the terminated pods stay after a group restart (0: none)."""
        val = (self.spec.get("failurePolicy") or {}).get("keepFailedAttempts")
        return DEFAULT_KEEP_FAILED_ATTEMPTS if val is None else max(0, int(val))

    @property
    def pod_start_timeout(self) -> int | None:
        """Seconds a container may stay in a start error before the job fails (None = keep waiting)."""
        return _int_or_none((self.spec.get("failurePolicy") or {}).get("podStartTimeoutSeconds"))

    @property
    def hang_timeout_seconds(self) -> int | None:
        """spec.hangTimeoutSeconds (None = derived by the monitor)."""
        return _int_or_none(self.spec.get("hangTimeoutSeconds"))

    @property
    def clean_pod_policy(self) -> str:
        """None | Running | All: which pods go away when the job finishes."""
        return str(self.spec.get("cleanPodPolicy") or "Running")

    @property
    def active_deadline_seconds(self) -> int | None:
        """Seconds from start after which the job fails (None = no deadline)."""
        return _int_or_none(self.spec.get("activeDeadlineSeconds"))

    @property
    def ttl_seconds_after_finished(self) -> int | None:
        """Seconds after completion before the DDPJob is deleted (None = keep)."""
        return _int_or_none(self.spec.get("ttlSecondsAfterFinished"))

    @property
    def generation(self) -> int:
        """metadata.generation (0 when unknown)."""
        return int((self.raw.get("metadata") or {}).get("generation") or 0)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def resolve_nproc(nproc: Any, gpus_per_node: int) -> int:
    """`auto` means one process per GPU, or one on a CPU node."""
    if nproc in (None, "auto"):
        return gpus_per_node if gpus_per_node > 0 else 1
    return int(nproc)


def from_manifest(obj: dict[str, Any]) -> JobSpec:
    """Build a JobSpec from a DDPJob object (as applied or as read from the API)."""
    obj = copy.deepcopy(obj)
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    gpus = int(spec.get("gpusPerNode", 0) or 0)
    failure = spec.get("failurePolicy") or {}
    return JobSpec(
        name=meta.get("name", ""),
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid", ""),
        nodes=int(spec.get("nodes", 1)),
        nproc_per_node=resolve_nproc(spec.get("nprocPerNode", "auto"), gpus),
        gpus_per_node=gpus,
        image=spec.get("image", ""),
        command=list(spec["command"]) if spec.get("command") else None,
        args=list(spec["args"]) if spec.get("args") else None,
        trainer=dict(spec.get("trainer") or {}),
        env=list(spec.get("env") or []),
        master_port=int(spec.get("masterPort", contract.DEFAULT_MASTER_PORT)),
        metrics_port=int(spec.get("metricsPort", DEFAULT_METRICS_PORT)),
        nccl=dict(spec.get("nccl") or {}),
        max_restarts=int(failure.get("maxRestarts", 3)),
        elastic=dict(spec["elastic"]) if spec.get("elastic") else None,
        raw=obj,
        scheduling=_scheduling(spec.get("scheduling")),
    )
