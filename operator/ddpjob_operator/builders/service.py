"""The headless Service that gives every pod of a job a stable DNS name (pure builder)."""
from __future__ import annotations

from typing import Any

from ddpjob_api import labels
from ddpjob_api.names import service_name
from ddpjob_api.spec import API_VERSION, KIND, JobSpec


def owner_reference(job: JobSpec) -> dict[str, Any]:
    """Controller owner reference to the DDPJob, so garbage collection removes children."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job.name, "uid": job.uid,
            "controller": True, "blockOwnerDeletion": True}


def training_labels(job: JobSpec) -> dict[str, str]:
    """The labels that select a job's training pods (its headless Service, their spread): the
    job-name label, and in a per-step job role=trainer, which leaves its Lighthouse out (labels.ROLE)."""
    role = {labels.ROLE: labels.ROLE_TRAINER} if job.spec.fault_tolerance is not None else {}
    return {labels.JOB_NAME: job.name, **role}


def child_metadata(job: JobSpec, name: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Name, namespace, labels and owner reference shared by every child."""
    ours = {labels.JOB_NAME: job.name, labels.MANAGED_BY: labels.MANAGER}
    # The operator's labels win over a user's of the same key (the job-name label selects the
    # Service's pods), in the first places.
    meta: dict[str, Any] = {"name": name, "namespace": job.namespace,
                            "labels": {**ours, **(extra_labels or {}), **ours}}
    if job.uid:  # `ddpjob render` has no uid yet: then no owner reference
        meta["ownerReferences"] = [owner_reference(job)]
    return meta


def render_service(job: JobSpec) -> dict[str, Any]:
    """Headless Service selecting the job's pods; DNS records exist before pods are ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(job, service_name(job)),
        "spec": {
            "clusterIP": "None",
            # Workers must resolve rank 0 before it is Ready (it has no readiness probe).
            "publishNotReadyAddresses": True,
            "selector": training_labels(job),
            "ports": [
                {"name": "master", "port": job.spec.master_port, "targetPort": job.spec.master_port, "protocol": "TCP"},
                {"name": "metrics", "port": job.spec.metrics_port, "targetPort": job.spec.metrics_port, "protocol": "TCP"},
            ],
        },
    }
