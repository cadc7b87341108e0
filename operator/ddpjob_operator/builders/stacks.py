"""The ConfigMap that keeps a job's captured stacks (pure builder; what goes in it:
decisions/stacks.py)."""
from __future__ import annotations

from typing import Any, Mapping

from ddpjob_api import contract
from ddpjob_api.spec import JobSpec
from ddpjob_operator.builders.service import child_metadata


def render_stacks_configmap(job: JobSpec, data: Mapping[str, str]) -> dict[str, Any]:
    """contract.stacks_configmap(job), owned by the DDPJob: the garbage collector deletes it with the job."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": child_metadata(job, contract.stacks_configmap(job.name)), "data": dict(data)}
