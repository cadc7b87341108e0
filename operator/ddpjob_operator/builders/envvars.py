"""The environment every training container gets (names: ddpjob_api.contract; the pods' DNS: ddpjob_api.names).

One pure function used by the operator (pods) and by `ddpjob run --local`, so a job
sees exactly the same variables in both places.
"""
from __future__ import annotations

import json
import re
from typing import Any

from ddpjob_api import contract, labels
from ddpjob_api.names import lighthouse_url, master_dns
from ddpjob_api.spec import JobSpec
from ddpjob_operator.builders import rdma, template

# spec.nccl keys -> NCCL_* variables; anything else in spec.nccl is upper-snake-cased.
_NCCL_KEYS = {
    "p2pDisable": contract.ENV_NCCL_P2P_DISABLE,
    "ibDisable": contract.ENV_NCCL_IB_DISABLE,
    "debug": contract.ENV_NCCL_DEBUG,
    "debugSubsys": contract.ENV_NCCL_DEBUG_SUBSYS,
    "socketIfname": contract.ENV_NCCL_SOCKET_IFNAME,
    "asyncErrorHandling": contract.ENV_TORCH_NCCL_ASYNC_ERROR_HANDLING,
    "blockingWait": contract.ENV_TORCH_NCCL_BLOCKING_WAIT,
}


def own_rendezvous(job: JobSpec) -> bool:
    """The job sets its own PET_RDZV_ENDPOINT: which pod hosts that rendezvous is not ours to know."""
    return any(e.get("name") == contract.PET_RDZV_ENDPOINT for e in template.user_env(job))


def _camel_to_env(key: str) -> str:
    return "NCCL_" + re.sub(r"(?<!^)(?=[A-Z])", "_", key).upper()


def nccl_env(nccl: dict[str, Any]) -> dict[str, str]:
    """spec.nccl -> NCCL_* variables (booleans become 1/0)."""
    out: dict[str, str] = {}
    for key, value in sorted(nccl.items()):
        name = _NCCL_KEYS.get(key) or _camel_to_env(key)
        out[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


def mlflow_env(job: JobSpec, *, default_tracking_uri: str | None = None) -> dict[str, str]:
    """spec.trainer.mlflow as MLflow's own variables, so that a script of the user's (or a subclass of
    the trainer) logs with plain `mlflow` calls to the same server and experiment (and, with
    MLFLOW_RUN_ID from the launcher, the same run). The URI is the job's, else the operator's
    cluster-wide default (a job opts in with `mlflow: {}`); none: no tracking, no variables."""
    ml = job.trainer.get("mlflow")
    uri = (ml or {}).get("trackingUri") or default_tracking_uri
    if ml is None or not uri:
        return {}
    env = {contract.ENV_MLFLOW_TRACKING_URI: uri,
           contract.ENV_MLFLOW_EXPERIMENT: ml.get("experiment") or contract.MLFLOW_DEFAULT_EXPERIMENT,
           contract.ENV_MLFLOW: "required" if ml.get("required") else "optional"}
    if ml.get("runName"):
        env[contract.ENV_MLFLOW_RUN_NAME] = ml["runName"]
    if ml.get("systemMetrics"):
        env[contract.ENV_MLFLOW_SYSTEM_METRICS] = "1"
    return env


def mlflow_secret_env(job: JobSpec, *, default_tracking_uri: str | None = None) -> list[dict[str, Any]]:
    """MLflow's credentials from the Secret spec.trainer.mlflow.credentialsSecret names: its keys
    `token` (MLFLOW_TRACKING_TOKEN) or `username` and `password`, each optional (the operator reads
    no Secret, so it cannot know which the Secret has; the kubelet leaves a missing key unset)."""
    name = (job.trainer.get("mlflow") or {}).get("credentialsSecret")
    if not name or not mlflow_env(job, default_tracking_uri=default_tracking_uri):
        return []
    return [{"name": var, "valueFrom": {"secretKeyRef": {"name": name, "key": key, "optional": True}}}
            for var, key in contract.MLFLOW_SECRET_KEYS.items()]


def pod_env(
    job: JobSpec,
    rank: int,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    metrics_port: int | None = None,
    attempt: int = 0,
    cluster_domain: str | None = None,
    rdma_devices: bool = True,
    stop_grace: float | None = None,
    mlflow_tracking_uri: str | None = None,
    ft_host: str | None = None,
    ft_lighthouse: str | None = None,
) -> list[dict[str, Any]]:
    """Env for node `rank` as a k8s env list: ours, then the template container's env, then
    `spec.env`; a user's variable replaces ours of the same name (spec.env's a template's).
    `rdma_devices=False` (a local run, which has none of the pods' RDMA devices) leaves out the
    fabric's settings, which would make NCCL refuse to start there. `stop_grace`: the launcher's
    SIGTERM-to-SIGKILL seconds (a pod's: stop_grace_seconds; a local run keeps the launcher's default).
    `mlflow_tracking_uri`: the operator's default for a job whose spec.trainer.mlflow names none.
    A per-step job (spec.faultTolerance, per_step_env): `ft_host`, the address other replica groups
    reach this one at (default: the pod's IP, by the downward API; locally 127.0.0.1), also its
    MASTER_ADDR, and `ft_lighthouse`, the Lighthouse's URL (default: names.lighthouse_url)."""
    per_step = job.spec.fault_tolerance is not None
    if per_step:
        addr = master_addr or ft_host or f"$({contract.ENV_FT_HOST})"
    else:
        addr = master_addr or master_dns(job, cluster_domain=cluster_domain)
    port = master_port or job.spec.master_port
    env: dict[str, str] = {
        contract.ENV_MASTER_ADDR: addr,
        contract.ENV_MASTER_PORT: str(port),
        contract.ENV_NNODES: str(job.spec.nodes),
        contract.ENV_NODE_RANK: str(rank),
        contract.ENV_NPROC_PER_NODE: str(job.nproc_per_node),
        contract.ENV_WORLD_SIZE: str(job.world_size),
        contract.PET_NPROC_PER_NODE: str(job.nproc_per_node),
        contract.ENV_JOB_NAME: job.name,
        contract.ENV_JOB_NAMESPACE: job.namespace,
        contract.ENV_POD_METRICS_PORT: str(metrics_port or job.spec.metrics_port),
        contract.ENV_ATTEMPT: str(attempt),
        contract.ENV_IMAGE: job.spec.image,
        contract.ENV_GPUS_PER_NODE: str(job.spec.gpus_per_node),
        # Unbuffered output so `kubectl logs` and the local runner see errors at once.
        contract.ENV_UNBUFFERED: "1",
    }
    # Every job rendezvouses through c10d (not torchrun's static rendezvous) so that its workers
    # restart in place: a pod whose worker dies restarts its workers, up to PET_MAX_RESTARTS times,
    # and the other pods' agents see the new round and restart theirs (docs/restarts.md). The id
    # names the attempt, so a group restart never meets an older attempt's round.
    nnodes = f"{job.min_nodes}:{job.max_nodes}" if job.spec.elastic else str(job.spec.nodes)
    env.update({
        contract.PET_NNODES: nnodes,
        contract.PET_RDZV_BACKEND: "c10d",
        contract.PET_RDZV_ENDPOINT: f"{addr}:{port}",
        contract.PET_RDZV_ID: f"{job.uid or job.name}-{attempt}",
        contract.PET_MAX_RESTARTS: str(inplace_budget(job)),
        contract.ENV_TORCH_NO_SHARED_RDZV_STORE: "1",
        # The agent restarts a stalled rank's workers in place, by the monitor's rule (docs/restarts.md).
        contract.ENV_RESTART_ON_HANG: "1" if job.spec.failure_policy.restart_on_hang else "0",
    })
    if per_step:
        env.update(per_step_env(job, ft_lighthouse or lighthouse_url(job)))
    if job.spec.hang_timeout_seconds is not None:
        env[contract.ENV_HANG_TIMEOUT] = str(job.spec.hang_timeout_seconds)
    if job.uid:
        env[contract.ENV_JOB_UID] = job.uid
    if stop_grace is not None:
        env[contract.ENV_STOP_GRACE] = f"{stop_grace:g}"
    if job.uses_builtin_trainer:
        env[contract.ENV_TRAINER_CONFIG] = json.dumps(job.trainer, sort_keys=True)
    env.update(mlflow_env(job, default_tracking_uri=mlflow_tracking_uri))
    if rdma_devices:
        env.update(rdma.env(job))
    env.update(nccl_env(job.nccl))
    ours: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()]
    if per_step:
        # First: Kubernetes expands $(DDPJOB_FT_HOST) in MASTER_ADDR and the rendezvous endpoint
        # only from variables defined earlier in the list.
        ours.insert(0, {"name": contract.ENV_FT_HOST, "value": ft_host} if ft_host else
                    {"name": contract.ENV_FT_HOST, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    ours += mlflow_secret_env(job, default_tracking_uri=mlflow_tracking_uri)
    if cpu_request(job):
        # The trainer sizes numWorkers: auto from the CPUs the pod asked for, not the node's cores
        # (which os.cpu_count() reports inside a container). Rounded up to whole CPUs.
        ours.append({"name": contract.ENV_CPUS, "valueFrom": {"resourceFieldRef": {
            "containerName": labels.CONTAINER, "resource": "requests.cpu", "divisor": "1"}}})
    user = template.user_env(job)
    user_names = {e.get("name") for e in user}
    if not own_rendezvous(job):
        # Which pod hosts the c10d store, said rather than guessed: torchrun's guess resolves the
        # endpoint's name and compares it with the pod's own addresses, and pod 0, starting before
        # its DNS record is served, took itself for a client of the store it should host and failed
        # after the connect timeout (seen: a group restart before the first step).
        # A per-step job's pods each host their own (each is a torchrun world of its own).
        host = per_step or rank == 0
        ours.append({"name": contract.PET_RDZV_CONF, "value": f"is_host={'true' if host else 'false'}"})
    return [e for e in ours if e["name"] not in user_names] + user


def per_step_env(job: JobSpec, lighthouse: str) -> dict[str, str]:
    """What a per-step job (spec.faultTolerance) changes: each pod is one torchft replica group, a
    torchrun world of its own (one node, its own c10d store at its own address), while NODE_RANK
    (the group's index) and NNODES (the number of groups) still say where it stands in the job;
    the DDPJOB_FT_* variables tell the trainer where the Lighthouse is and the quorum's timing."""
    ft = job.spec.fault_tolerance
    assert ft is not None
    return {
        contract.PET_NNODES: "1",
        contract.ENV_FT_LIGHTHOUSE: lighthouse,
        contract.ENV_FT_MIN_REPLICAS: str(ft.min_replicas),
        contract.ENV_FT_TIMEOUT: str(ft.timeout_seconds),
        contract.ENV_FT_QUORUM_TIMEOUT: str(ft.quorum_timeout_seconds),
    }


def inplace_budget(job: JobSpec) -> int:
    """PET_MAX_RESTARTS, the in-place restarts torchrun's agent of one pod may make: the job's
    restart budget (failurePolicy.maxRestarts), or spec.elastic.maxRestarts where set. The operator
    charges every in-place restart to failurePolicy.maxRestarts as well (decisions/inplace.py)."""
    if job.spec.elastic and job.spec.elastic.max_restarts is not None:
        return job.spec.elastic.max_restarts
    return job.spec.failure_policy.max_restarts


def stop_grace_seconds(job: JobSpec) -> float:
    """The launcher's grace in this job's pods: their terminationGracePeriodSeconds (spec.template's,
    else Kubernetes' default) less the launcher's own margin (contract.stop_grace)."""
    grace = template.pod_spec(job).get("terminationGracePeriodSeconds")
    return contract.stop_grace(contract.POD_TERMINATION_GRACE_DEFAULT if grace is None else grace)


def cpu_request(job: JobSpec) -> Any:
    """The training container's CPU request: spec.resources', else its template container's."""
    def requests(resources: dict[str, Any] | None) -> dict[str, Any]:
        return (resources or {}).get("requests") or {}
    tpl = template.trainer_container(template.pod_template(job)).get("resources")
    return requests(job.spec.resources).get("cpu") or requests(tpl).get("cpu")


def env_dict(env: list[dict[str, Any]]) -> dict[str, str]:
    """A k8s env list (plain values only) as a dict, for local processes."""
    return {e["name"]: str(e["value"]) for e in env if "value" in e}
