"""Label and annotation keys on the operator's children (CONTRACT: job-name, node-rank)."""
from __future__ import annotations

JOB_NAME = "ddpjob.dev/job-name"
NODE_RANK = "ddpjob.dev/node-rank"
ATTEMPT = "ddpjob.dev/attempt"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "ddpjob-operator"
CONTAINER = "trainer"


def selector(job_name: str) -> str:
    """Label selector for every child of a job."""
    return f"{JOB_NAME}={job_name}"
