"""Label and annotation keys on the operator's children."""
from __future__ import annotations

JOB_NAME = "ddpjob.dev/job-name"
NODE_RANK = "ddpjob.dev/node-rank"
ATTEMPT = "ddpjob.dev/attempt"
# A pod that replaced a lost one of its rank within the attempt: the how-manyth (absent: the first pod).
REPLACEMENT = "ddpjob.dev/replacement"
# Pod annotations: the restart counters before the pod's attempt, the operator's own record of
# them (lifecycle.trusted_counters), out of reach of whoever may edit the DDPJob's status.
RESTARTS = "ddpjob.dev/restarts"
COUNTED_RESTARTS = "ddpjob.dev/counted-restarts"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "ddpjob-operator"
CONTAINER = "trainer"


def reserved(key: str) -> bool:
    """True for label/annotation keys the operator owns (ddpjob.dev/*, sub-domains included)."""
    prefix = key.split("/", 1)[0] if "/" in key else ""
    return prefix == "ddpjob.dev" or prefix.endswith(".ddpjob.dev")


def user_keys(mapping: dict[str, str] | None) -> dict[str, str]:
    """A job's podLabels/podAnnotations without reserved keys: the schema refuses them, and a
    manifest that never met the API server (ddpjob render, --local) must not steer the operator
    (a job-name label would put the pods into another job's Service)."""
    return {str(k): str(v) for k, v in (mapping or {}).items() if not reserved(str(k))}


def selector(job_name: str) -> str:
    """Label selector for every child of a job."""
    return f"{JOB_NAME}={job_name}"
