"""Builders of the DDPJobs and Pods that tests hand to the operator's code, in the style of JobSet's
wrappers.go: a default for every field a test does not care about, a keyword for each it does.

Labels, annotations and the container name come from the operator's own constants, so a builder
cannot drift from what the operator writes on its pods and reads back from them. Timestamps are
dated back from NOW, the clock the unit tests pass to the code under test as `now`.
"""
from __future__ import annotations

import copy
import datetime as dt
from typing import Any

from ddpjob_api import labels
from ddpjob_api.spec import API_VERSION, KIND, JobSpec, from_manifest
from ddpjob_api.names import pod_name

NOW = dt.datetime(2026, 11, 22, 12, 0, 0, tzinfo=dt.timezone.utc)

EVICTION_MESSAGE = "The node was low on resource: memory."
NO_NODE_MESSAGE = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."


def ago(seconds: float) -> str:
    """An API timestamp `seconds` before NOW."""
    return (NOW - dt.timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


def make_manifest(name: str = "j", *, namespace: str | None = "ns", uid: str | None = None,
                  stored: bool = True, image: str = "img", nodes: int = 2, **spec: Any) -> dict[str, Any]:
    """A DDPJob; `spec` adds or overrides spec fields (camelCase, as in YAML).

    stored: as the API server returns it, with a uid (`uid`, else uid-<name>) and generation 1;
    False: as a user writes it. namespace None: none, as in a file for `ddpjob render`."""
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    if stored:
        meta.update(uid=uid or f"uid-{name}", generation=1)
    # Copied, so that a test editing its manifest cannot edit a dict that other calls share.
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
            "spec": {"image": image, "nodes": nodes, **copy.deepcopy(spec)}}


def make_job(name: str = "j", **fields: Any) -> JobSpec:
    """make_manifest's DDPJob as the operator reads it (defaults applied)."""
    return from_manifest(make_manifest(name, **fields))


def running_status(**fields: Any) -> dict[str, Any]:
    """The status of a job whose attempt 0 has run for 100 s, as the operator last wrote it."""
    return {"phase": "Running", "attempt": 0, "launchedAttempt": 0, "restarts": 0, "countedRestarts": 0,
            "startTime": ago(100), **fields}


def make_pod(rank: int = 0, *, job: str = "j", attempt: int = 0, phase: str = "Running",
             exit_code: int | None = None, message: str | None = None, deleting: bool | float = False,
             evicted: bool = False, disruption: str | None = None, reason: str | None = None,
             unschedulable_for: float | None = None, restarts: int | None = None,
             counted_restarts: int | None = None, node_name: str | None = None, pod_ip: str | None = None,
             name: str | None = None, namespace: str = "ns", uid: str | None = None,
             resource_version: int | None = None) -> dict[str, Any]:
    """The pod of one rank of one attempt (named as the operator names it), as a watch delivers it: the operator's labels, and
    the restart-counter annotations only when `restarts` / `counted_restarts` are given.

    exit_code: the trainer container terminated with it (`message`: its termination message).
    deleting: it has a deletionTimestamp; True: its grace period ended a second ago, a number:
    that many seconds ago. evicted: what the kubelet leaves on a pod it evicted. disruption: a
    DisruptionTarget condition with this reason (DeletionByPodGC, PreemptionByScheduler ...).
    reason: status.reason. unschedulable_for: the scheduler has found no node for that long (s).
    """
    name = name or pod_name(job, rank, attempt)
    meta: dict[str, Any] = {
        "name": name, "namespace": namespace, "uid": uid or f"uid-{name}-{attempt}",
        "labels": {labels.JOB_NAME: job, labels.MANAGED_BY: labels.MANAGER,
                   labels.NODE_RANK: str(rank), labels.ATTEMPT: str(attempt)},
    }
    if resource_version is not None:
        meta["resourceVersion"] = str(resource_version)
    counters = {labels.RESTARTS: restarts, labels.COUNTED_RESTARTS: counted_restarts}
    if any(v is not None for v in counters.values()):
        meta["annotations"] = {k: str(v) for k, v in counters.items() if v is not None}
    if deleting is not False:
        meta["deletionTimestamp"] = ago(1 if deleting is True else deleting)
    status: dict[str, Any] = {"phase": phase, "conditions": []}
    if exit_code is not None:
        terminated: dict[str, Any] = {"exitCode": exit_code}
        if message is not None:
            terminated["message"] = message
        status["containerStatuses"] = [{"name": labels.CONTAINER, "state": {"terminated": terminated}}]
    if evicted:
        status.update(reason="Evicted", message=EVICTION_MESSAGE)
        disruption = disruption or "TerminationByKubelet"
    if disruption:
        status["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": disruption})
    if reason:
        status["reason"] = reason
    if unschedulable_for is not None:
        status["conditions"].append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": NO_NODE_MESSAGE, "lastTransitionTime": ago(unschedulable_for)})
    if pod_ip:
        status["podIP"] = pod_ip
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}
    if node_name:
        pod["spec"] = {"nodeName": node_name}
    return pod
