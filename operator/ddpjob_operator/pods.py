"""One Pod per node of a DDPJob (pure builder)."""
from __future__ import annotations

import copy
import re
from typing import Any

from . import labels
from .config import OperatorConfig
from .envvars import pod_env, pod_hostname, service_name
from .service import child_metadata
from .spec import JobSpec

GPU_RESOURCE = "nvidia.com/gpu"
LAUNCHER = ["python", "-m", "ddpjob_trainer.launch", "--"]
SHM_VOLUME = "dshm"
DEFAULT_SHM = "2Gi"

# Hardened defaults (Pod Security "restricted"): each key yields to the same key in the job's own
# podSecurityContext / securityContext, so a job that needs more says so in its spec, where an
# admission policy can see it.
POD_SECURITY_DEFAULTS: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_DEFAULTS: dict[str, Any] = {"allowPrivilegeEscalation": False,
                                               "capabilities": {"drop": ["ALL"]}}


def pod_security_context(job: JobSpec) -> dict[str, Any]:
    """The pod's securityContext: the hardened defaults under the job's podSecurityContext."""
    return {**copy.deepcopy(POD_SECURITY_DEFAULTS), **copy.deepcopy(job.spec.get("podSecurityContext") or {})}


def container_security_context(job: JobSpec) -> dict[str, Any]:
    """The training container's securityContext: hardened defaults under the job's securityContext.

    capabilities merge per list (a job that only adds NET_RAW still drops the rest); a privileged
    container gets no allowPrivilegeEscalation default (the API refuses privileged + false)."""
    own = copy.deepcopy(job.spec.get("securityContext") or {})
    out = copy.deepcopy(CONTAINER_SECURITY_DEFAULTS)
    if own.get("privileged"):
        out.pop("allowPrivilegeEscalation")
    caps = {**out["capabilities"], **(own.pop("capabilities", None) or {})}
    out.update(own)
    out["capabilities"] = caps
    return out


def automount_token(job: JobSpec) -> bool:
    """Mount an API token only for a job that names its ServiceAccount (the default one's token
    is an API credential the training code has no use for)."""
    return bool(job.spec.get("serviceAccountName"))


def container_command(job: JobSpec) -> tuple[list[str], list[str] | None]:
    """(command, args) per the launcher contract: our launcher wraps the user's command."""
    if job.command:
        if job.launcher:
            return LAUNCHER + list(job.command), job.args
        return list(job.command), job.args
    if job.launcher:
        return list(LAUNCHER), job.args
    # No launcher and no command: torchrun reads PET_* from the env, so it needs no flags.
    return ["torchrun", "-m", "ddpjob_trainer"], job.args


def runtime_class(job: JobSpec, config: OperatorConfig) -> str | None:
    """The job's runtimeClassName, else the operator default when GPUs are requested."""
    if job.spec.get("runtimeClassName"):
        return str(job.spec["runtimeClassName"])
    if job.gpus_per_node > 0 and config.default_runtime_class:
        return config.default_runtime_class
    return None


def container_resources(job: JobSpec) -> dict[str, Any]:
    """The user's resources plus nvidia.com/gpu limits (extended resources: request = limit)."""
    res = copy.deepcopy(job.spec.get("resources") or {})
    if job.gpus_per_node > 0:
        res.setdefault("limits", {})[GPU_RESOURCE] = str(job.gpus_per_node)
        if GPU_RESOURCE in (res.get("requests") or {}):
            res["requests"][GPU_RESOURCE] = str(job.gpus_per_node)
    return res


def restart_counters(job: JobSpec, restarts: int | None, counted_restarts: int | None) -> tuple[int, int]:
    """(restarts, counted restarts) before this attempt: given, else the job's status as last
    written (the restart's own write precedes its pods' creation)."""
    status = job.raw.get("status") or {}

    def count(given: int | None, key: str) -> int:
        try:
            return max(0, int(status.get(key) or 0) if given is None else int(given))
        except (TypeError, ValueError):
            return 0
    return count(restarts, "restarts"), count(counted_restarts, "countedRestarts")


def default_spread(job: JobSpec) -> list[dict[str, Any]]:
    """One pod per node where the cluster allows it: the product's model, which GPU requests
    enforce by themselves but CPU jobs would otherwise leave to the scheduler's scoring. A score
    (ScheduleAnyway), never a refusal, and spreading rather than pod anti-affinity, whose cost
    grows with the cluster; a job's own topologySpreadConstraints replace it."""
    return [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": {labels.JOB_NAME: job.name}}}]


def render_pod(job: JobSpec, rank: int, *, attempt: int = 0, config: OperatorConfig | None = None,
               restarts: int | None = None, counted_restarts: int | None = None) -> dict[str, Any]:
    """Pod `<job>-<rank>` for one attempt of the group."""
    config = config or OperatorConfig()
    spec = job.spec
    sched = spec.get("scheduling") or {}
    command, args = container_command(job)
    container: dict[str, Any] = {
        "name": labels.CONTAINER,
        "image": job.image,
        "command": command,
        "env": pod_env(job, rank, attempt=attempt, cluster_domain=config.cluster_domain or None),
        "ports": [
            {"name": "master", "containerPort": job.master_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": job.metrics_port, "protocol": "TCP"},
        ],
        "resources": container_resources(job),
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
                        + copy.deepcopy(spec.get("volumeMounts") or []),
        # The launcher writes a one-line reason here; fall back to the log tail otherwise.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if args:
        container["args"] = list(args)
    for key in ("imagePullPolicy", "workingDir", "envFrom"):
        if spec.get(key):
            container[key] = copy.deepcopy(spec[key])
    container["securityContext"] = container_security_context(job)
    pod_spec: dict[str, Any] = {
        "hostname": pod_hostname(job, rank),
        "subdomain": service_name(job),
        "restartPolicy": "Never",
        # Thousands of service env vars are noise and slow pod start in busy namespaces.
        "enableServiceLinks": False,
        "automountServiceAccountToken": automount_token(job),
        "securityContext": pod_security_context(job),
        "containers": [container],
        "volumes": [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                       "sizeLimit": str(spec.get("shmSize") or DEFAULT_SHM)}}]
                   + copy.deepcopy(spec.get("volumes") or []),
    }
    rc = runtime_class(job, config)
    if rc:
        pod_spec["runtimeClassName"] = rc
    for key in ("schedulerName", "priorityClassName", "nodeSelector", "tolerations", "affinity",
                "topologySpreadConstraints"):
        if sched.get(key):
            pod_spec[key] = copy.deepcopy(sched[key])
    if not sched.get("topologySpreadConstraints"):
        pod_spec["topologySpreadConstraints"] = default_spread(job)
    if spec.get("serviceAccountName"):
        pod_spec["serviceAccountName"] = spec["serviceAccountName"]
    if spec.get("imagePullSecrets"):
        pod_spec["imagePullSecrets"] = copy.deepcopy(spec["imagePullSecrets"])
    extra = {**labels.user_keys(spec.get("podLabels")),
             labels.NODE_RANK: str(rank), labels.ATTEMPT: str(attempt)}
    meta = child_metadata(job, pod_hostname(job, rank), extra)
    total, counted = restart_counters(job, restarts, counted_restarts)
    meta["annotations"] = {**labels.user_keys(spec.get("podAnnotations")),
                           labels.RESTARTS: str(total), labels.COUNTED_RESTARTS: str(counted)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


_C = r"spec\.containers\[0\]\."
# Pod field -> the DDPJob field it is copied from (render_pod above), for the API's error paths.
_FIELD_MAP: list[tuple[str, str]] = [
    (_C + r"(env|envFrom|resources|securityContext|imagePullPolicy|workingDir|image|args)\b", r"spec.\1"),
    (r"spec\.securityContext\b", "spec.podSecurityContext"),
    (r"spec\.(nodeSelector|tolerations|affinity|topologySpreadConstraints|schedulerName|priorityClassName)\b",
     r"spec.scheduling.\1"),
    (r"spec\.(imagePullSecrets|serviceAccountName|runtimeClassName)\b", r"spec.\1"),
    (r"metadata\.labels\b", "spec.podLabels"),
    (r"metadata\.annotations\b", "spec.podAnnotations"),
]
_PATH = re.compile(r"(?:spec|metadata)\.[A-Za-z0-9_.\[\]]+")
_INDEX = re.compile(r"^(spec\.containers\[0\]\.volumeMounts|spec\.volumes|spec\.containers\[0\]\.env)\[(\d+)\](.*)$")


def job_field(pod_path: str, job: JobSpec, *, rank: int = 0) -> str | None:
    """The DDPJob field that a field path of its rendered Pod comes from (None: the operator's own)."""
    m = _INDEX.match(pod_path)
    if m:
        base, i, rest = m.group(1), int(m.group(2)), m.group(3)
        if base.endswith("env"):
            # User variables come last (pod_env), after the operator's.
            first = len(pod_env(job, rank)) - len(job.env)
            return f"spec.env[{i - first}]{rest}" if i >= first else None
        # Index 0 is the operator's /dev/shm volume and its mount.
        name = "volumeMounts" if "volumeMounts" in base else "volumes"
        return f"spec.{name}[{i - 1}]{rest}" if i >= 1 else None
    for pattern, repl in _FIELD_MAP:
        if re.match(pattern, pod_path):
            return re.sub(pattern, repl, pod_path, count=1)
    return None


def explain_pod_error(message: str, job: JobSpec, *, rank: int = 0) -> str:
    """An API error about a rendered Pod, with the DDPJob field named after each Pod field path."""
    def name(m: re.Match) -> str:
        field = job_field(m.group(0), job, rank=rank)
        return f"{m.group(0)} (DDPJob {field})" if field else m.group(0)
    return _PATH.sub(name, message)
