"""One Pod per node of a DDPJob (pure builder)."""
from __future__ import annotations

import re
from typing import Any

from ddpjob_api import contract, labels
from ddpjob_api.names import pod_hostname, pod_name, service_name
from ddpjob_api.spec import JobSpec
from ddpjob_operator.builders import gang, kueue, rdma, shm, template
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.builders.envvars import pod_env, stop_grace_seconds
from ddpjob_operator.builders.service import child_metadata, training_labels
from ddpjob_operator.builders.template import Layers

GPU_RESOURCE = "nvidia.com/gpu"
LAUNCHER = list(contract.LAUNCHER)
SHM_VOLUME = "dshm"
SPREAD = "topologySpreadConstraints"
HOSTNAME_KEY = "kubernetes.io/hostname"
# spec.scheduling: the pod fields it sets, in the order pods have always listed them.
SCHEDULING = ("schedulerName", "priorityClassName", "nodeSelector", "tolerations", "affinity", SPREAD)

# Hardened defaults (Pod Security "restricted"): each key yields to the same key in the job's own
# podSecurityContext / securityContext, so a job that needs more says so in its spec, where an
# admission policy can see it.
POD_SECURITY_DEFAULTS: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_DEFAULTS: dict[str, Any] = {"allowPrivilegeEscalation": False,
                                               "capabilities": {"drop": ["ALL"]}}


def automount_token(job: JobSpec) -> bool:
    """Mount an API token only for a job that names its ServiceAccount (the default one's token
    is an API credential the training code has no use for)."""
    tpl = template.pod_spec(job)
    return bool(job.spec.service_account_name or tpl.get("serviceAccountName") or tpl.get("serviceAccount"))


def share_process_namespace(job: JobSpec) -> bool | None:
    """True: the pod's containers share one PID namespace, so the launcher is not the container's
    PID 1. PID 1 ignores a signal it has no handler for (the kernel drops it), and the kubelet sends
    SIGTERM once: a pod deleted before Python has installed the launcher's handlers would wait out its
    whole grace period for the SIGKILL. Not PID 1, the default action ends it at once (nothing runs
    yet to stop). None (left out) where the API refuses the field: a template with hostPID, a
    Windows pod. A template that sets it keeps its own value."""
    tpl = template.pod_spec(job)
    if tpl.get("hostPID") or (tpl.get("os") or {}).get("name") == "windows":
        return None
    return True


def container_command(job: JobSpec) -> tuple[list[str], list[str] | None]:
    """(command, args) per the launcher contract: our launcher wraps the user's command."""
    if not job.command and not job.spec.launcher:
        # No launcher and no command: torchrun reads PET_* from the env, so it needs no flags.
        return ["torchrun", "-m", "ddpjob_trainer"], job.args
    return (LAUNCHER if job.spec.launcher else []) + list(job.command or []), job.args


def default_runtime_class(job: JobSpec, config: OperatorConfig) -> str | None:
    """The operator's runtime class for GPU jobs (a job's or its template's runtimeClassName wins)."""
    if job.spec.gpus_per_node > 0 and config.default_runtime_class:
        return config.default_runtime_class
    return None


def device_limits(job: JobSpec) -> dict[str, Any] | None:
    """nvidia.com/gpu = gpusPerNode and spec.rdma's devices (extended resources: the request, if
    any, equals the limit)."""
    owned = {GPU_RESOURCE: str(job.spec.gpus_per_node)} if job.spec.gpus_per_node > 0 else {}
    owned.update(rdma.limits(job))
    return {"limits": owned} if owned else None


def owned_security(job: JobSpec) -> dict[str, Any] | None:
    """Capabilities the operator adds whatever the job's securityContext says (spec.rdma's IPC_LOCK):
    a job that adds or drops its own keeps them."""
    caps = rdma.capabilities(job)
    return {"capabilities": {"add": caps}} if caps else None


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


def pod_spread(job: JobSpec) -> list[dict[str, Any]]:
    """The pods' topologySpreadConstraints: the job's own (spec.scheduling's, else its template's)
    and, unless onePodPerNode is false, one pod per node as a hard rule.

    Two ranks on one node share its GPUs, NICs and memory bandwidth, and a partial GPU request lets
    the scheduler do that, so the rule is a refusal (DoNotSchedule): a pod that finds no node of
    its own stays Pending and the job says Unschedulable. maxSkew 1 alone would still allow a
    second pod on a node once every node has one; minDomains = the job's pods counts every missing
    node as holding none, so a node already holding a pod never passes while another pod is
    unplaced. A spread rather than pod anti-affinity: the scheduler's cost of anti-affinity grows
    with every pod that carries it. A job's own DoNotSchedule constraint on kubernetes.io/hostname
    replaces ours (the API allows one per key and mode). Relaxed (false), the spread is a
    preference (ScheduleAnyway) that the job's own constraints replace."""
    own = job.scheduling.topology_spread_constraints or template.pod_spec(job).get(SPREAD) or []
    selector = {"labelSelector": {"matchLabels": training_labels(job)}}
    if not job.one_pod_per_node:
        return own or [{"maxSkew": 1, "topologyKey": HOSTNAME_KEY, "whenUnsatisfiable": "ScheduleAnyway", **selector}]
    if any(c.get("topologyKey") == HOSTNAME_KEY and c.get("whenUnsatisfiable", "DoNotSchedule") == "DoNotSchedule"
           for c in own):
        return own
    return [*own, {"maxSkew": 1, "topologyKey": HOSTNAME_KEY, "whenUnsatisfiable": "DoNotSchedule",
                   "minDomains": job.spec.nodes, **selector}]


def container_env(job: JobSpec, rank: int, *, attempt: int = 0, cluster_domain: str | None = None,
                  mlflow_tracking_uri: str | None = None) -> list[dict[str, Any]]:
    """The training container's env in a pod: pod_env with the launcher's grace derived from the
    pod's terminationGracePeriodSeconds."""
    return pod_env(job, rank, attempt=attempt, cluster_domain=cluster_domain, stop_grace=stop_grace_seconds(job),
                   mlflow_tracking_uri=mlflow_tracking_uri)


def render_pod(job: JobSpec, rank: int, *, attempt: int = 0, config: OperatorConfig | None = None,
               restarts: int | None = None, counted_restarts: int | None = None,
               replacement: int = 0) -> dict[str, Any]:
    """Pod `names.pod_name` (hostname `<job>-<rank>`) for one attempt of the group: spec.template under the flat fields under
    what the operator owns (template.merge_template). `replacement`: the n-th pod that replaces a
    lost one of this rank in the attempt (lifecycle.Replacement): its own name, the same hostname."""
    config = config or OperatorConfig()
    spec, sched = job.spec, job.scheduling
    command, args = container_command(job)
    container = {
        "name": Layers(owned=labels.CONTAINER),
        "image": Layers(owned=job.spec.image),
        "command": Layers(owned=command),
        "env": Layers(owned=container_env(job, rank, attempt=attempt, cluster_domain=config.cluster_domain or None,
                                          mlflow_tracking_uri=config.mlflow_tracking_uri or None)),
        "ports": Layers(owned=[
            {"name": "master", "containerPort": job.spec.master_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": job.spec.metrics_port, "protocol": "TCP"},
        ]),
        "resources": Layers(flat=spec.resources, owned=device_limits(job)),
        "volumeMounts": Layers(owned=[{"name": SHM_VOLUME, "mountPath": "/dev/shm"}], flat=spec.volume_mounts),
        # The launcher writes a one-line reason here; fall back to the log tail otherwise.
        "terminationMessagePolicy": Layers(owned="FallbackToLogsOnError"),
        "args": Layers(owned=list(args) if args else None),
        "imagePullPolicy": Layers(flat=spec.image_pull_policy),
        "workingDir": Layers(flat=spec.working_dir),
        "envFrom": Layers(flat=spec.env_from),
        "securityContext": Layers(default=CONTAINER_SECURITY_DEFAULTS, flat=spec.security_context,
                                  owned=owned_security(job)),
    }
    pod = {
        "hostname": Layers(owned=pod_hostname(job, rank)),
        "subdomain": Layers(owned=service_name(job)),
        "restartPolicy": Layers(owned="Never"),
        # Thousands of service env vars are noise and slow pod start in busy namespaces.
        "enableServiceLinks": Layers(default=False),
        "automountServiceAccountToken": Layers(default=automount_token(job)),
        "shareProcessNamespace": Layers(default=share_process_namespace(job)),
        "securityContext": Layers(default=POD_SECURITY_DEFAULTS, flat=spec.pod_security_context),
        template.CONTAINERS: Layers(),
        "volumes": Layers(owned=[{"name": SHM_VOLUME, "emptyDir": {
            "medium": "Memory", "sizeLimit": shm.shm_size(job)}}], flat=spec.volumes),
        "runtimeClassName": Layers(default=default_runtime_class(job, config), flat=spec.runtime_class_name),
        # spec.scheduling's pod fields, in the order pods have always listed them (SCHEDULING). A
        # gang-scheduled job's pods go to its gang scheduler unless the job names one.
        "schedulerName": Layers(flat=sched.scheduler_name, default=gang.default_scheduler_name(job)),
        "priorityClassName": Layers(flat=sched.priority_class_name),
        "nodeSelector": Layers(flat=sched.node_selector),
        "tolerations": Layers(flat=sched.tolerations),
        "affinity": Layers(flat=sched.affinity),
        # The job's own spread (from the flat field or the template) with one pod per node.
        SPREAD: Layers(owned=pod_spread(job)),
        "serviceAccountName": Layers(flat=spec.service_account_name),
        "imagePullSecrets": Layers(flat=spec.image_pull_secrets),
    }
    pod_spec = template.merge_template(template.pod_template(job), pod=pod, container=container)
    gang_labels, gang_annotations = gang.pod_metadata(job)
    queue_labels, queue_annotations = kueue.pod_metadata(job, attempt)
    extra = {**template.user_metadata(job, "labels", spec.pod_labels), **gang_labels, **queue_labels,
             **training_labels(job), labels.NODE_RANK: str(rank), labels.ATTEMPT: str(attempt),
             **({labels.REPLACEMENT: str(replacement)} if replacement > 0 else {})}
    meta = child_metadata(job, pod_name(job.name, rank, attempt, replacement), extra)
    total, counted = restart_counters(job, restarts, counted_restarts)
    meta["annotations"] = {**template.user_metadata(job, "annotations", spec.pod_annotations), **gang_annotations, **queue_annotations,
                           labels.RESTARTS: str(total), labels.COUNTED_RESTARTS: str(counted)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


# Where each field of a rendered pod comes from (render_pod, template.merge_template), for the
# API's error paths. Lists the merge concatenates: field -> (entries of the operator's, which come
# first; the DDPJob shorthand, whose entries come after the template's).
_POD_LISTS: dict[str, tuple[int, str | None]] = {"volumes": (1, "spec.volumes"),
                                                 "imagePullSecrets": (0, "spec.imagePullSecrets")}
_CONTAINER_LISTS: dict[str, tuple[int, str | None]] = {"volumeMounts": (1, "spec.volumeMounts"), "ports": (2, None),
                                                       "envFrom": (0, "spec.envFrom")}
# Fields a shorthand sets over the template's: field -> the DDPJob field.
_POD_SHORTHANDS = {"securityContext": "spec.podSecurityContext", "serviceAccountName": "spec.serviceAccountName",
                   "runtimeClassName": "spec.runtimeClassName",
                   **{key: f"spec.scheduling.{key}" for key in SCHEDULING}}
_CONTAINER_SHORTHANDS = {key: f"spec.{key}" for key in ("resources", "securityContext", "imagePullPolicy",
                                                        "workingDir", "image", "args")}
_META_SHORTHANDS = {"labels": "spec.podLabels", "annotations": "spec.podAnnotations"}
# What the operator alone sets (template.POD_RULES/CONTAINER_RULES: _owned), whatever the template says.
_OWNED = {"hostname", "subdomain", "restartPolicy", "name", "command", "terminationMessagePolicy"}
_PATH = re.compile(r"(?:spec|metadata)\.[A-Za-z0-9_.\[\]]+")
_STEP = re.compile(r"^\.?(?P<key>[A-Za-z]+)(?:\[(?P<index>\d+)\])?(?P<rest>.*)$")


def _value(obj: Any, path: str) -> Any:
    for key in path.split("."):
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _locate(rest: str, job: JobSpec, *, tpl: dict[str, Any], tpl_path: str | None,
            lists: dict[str, tuple[int, str | None]], shorthands: dict[str, str]) -> str | None:
    """The DDPJob field of `rest` (a path below one pod object whose template counterpart is `tpl`,
    at `tpl_path`): a list entry by its place, a shorthand's field when the job sets it (or the
    template does not), else the template's (None: the operator's own)."""
    m = _STEP.match(rest)
    if not m:
        return None
    key, index, below = m.group("key"), m.group("index"), m.group("rest")
    at = "" if index is None else f"[{index}]"
    if key in lists and index is not None:
        ours, flat = lists[key]
        i, n = int(index), len(tpl.get(key) or [])
        if i < ours:
            return None
        if i < ours + n:
            return f"{tpl_path}.{key}[{i - ours}]{below}"
        return f"{flat}[{i - ours - n}]{below}" if flat else None
    if key in shorthands and (_value(job.raw, shorthands[key]) or key not in tpl):
        return f"{shorthands[key]}{at}{below}"
    return f"{tpl_path}.{key}{at}{below}" if tpl_path and key in tpl and key not in _OWNED else None


def job_field(pod_path: str, job: JobSpec, *, rank: int = 0, config: OperatorConfig | None = None) -> str | None:
    """The DDPJob field that a field path of its rendered Pod comes from (None: the operator's own);
    `config`: the one the pod was rendered with (its defaults add variables of the operator's)."""
    tpl = template.pod_template(job)
    if pod_path.startswith("metadata."):
        return _locate(pod_path[len("metadata"):], job, tpl=tpl.get("metadata") or {},
                       tpl_path="spec.template.metadata", lists={}, shorthands=_META_SHORTHANDS)
    if not pod_path.startswith("spec."):
        return None
    t = template.trainer_index(tpl)
    m = re.match(r"^spec\.containers\[(\d+)\](.*)$", pod_path)
    if not m:
        return _locate(pod_path[len("spec"):], job, tpl=tpl.get("spec") or {}, tpl_path="spec.template.spec",
                       lists=_POD_LISTS, shorthands=_POD_SHORTHANDS)
    k, rest = int(m.group(1)), m.group(2)
    if k != (t or 0):
        # The template's other containers; the operator's own comes first when it has no `trainer`.
        return f"spec.template.spec.containers[{k if t is not None else k - 1}]{rest}"
    tpl_path = None if t is None else f"spec.template.spec.containers[{t}]"
    env = re.match(r"^\.env\[(\d+)\](.*)$", rest)
    if env:
        # pod_env: the operator's variables, the template container's that spec.env leaves, spec.env.
        i, below = int(env.group(1)), env.group(2)
        kept = template.template_env(job)
        ours = len(container_env(job, rank, mlflow_tracking_uri=(config or OperatorConfig()).mlflow_tracking_uri or None)
                   ) - len(kept) - len(job.env)
        if i < ours:
            return None
        if i < ours + len(kept):
            return f"{tpl_path}.env[{kept[i - ours][0]}]{below}"
        return f"spec.env[{i - ours - len(kept)}]{below}"
    return _locate(rest, job, tpl=template.trainer_container(tpl), tpl_path=tpl_path,
                   lists=_CONTAINER_LISTS, shorthands=_CONTAINER_SHORTHANDS)


# What Pod Security admission says when a namespace's level refuses a pod.
POD_SECURITY_REFUSAL = "violates PodSecurity"


def pod_security_needs(job: JobSpec) -> list[str]:
    """The job's fields that need Pod Security level `privileged` (baseline and restricted refuse
    them): spec.rdma's IPC_LOCK, the template's host namespaces."""
    needs = [f"spec.rdma (the {rdma.CAPABILITY} capability it adds)"] if rdma.capabilities(job) else []
    tpl = template.pod_spec(job)
    needs += [f"spec.template.spec.{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if tpl.get(k)]
    return needs


def pod_security_hint(message: str, job: JobSpec) -> str:
    """After a Pod Security refusal: which of the job's fields need which level, "" when none
    does (the refusal names the field of the job's own securityContext itself)."""
    needs = pod_security_needs(job) if POD_SECURITY_REFUSAL in message else []
    if not needs:
        return ""
    return (f" ({', '.join(needs)} needs Pod Security level privileged: the namespace must be labelled "
            f"pod-security.kubernetes.io/enforce=privileged, docs/install.md)")


def explain_pod_error(message: str, job: JobSpec, *, rank: int = 0, config: OperatorConfig | None = None) -> str:
    """An API error about a rendered Pod, with the DDPJob field named after each Pod field path."""
    def name(m: re.Match) -> str:
        field = job_field(m.group(0), job, rank=rank, config=config)
        return f"{m.group(0)} (DDPJob {field})" if field else m.group(0)
    return _PATH.sub(name, message) + pod_security_hint(message, job)
