"""Kueue admission through its plain-pod group integration (pure).

A DDPJob labelled `kueue.x-k8s.io/queue-name: <LocalQueue>` waits in that Kueue queue until the
whole group fits the queue's quota. Kueue's pod webhook holds each pod with a scheduling gate
(no node, no GPU) and lifts the gates of a whole group at once when it admits the group's
Workload. The operator only labels the pods; it needs no Kueue API and no external-framework
controller, and a cluster without Kueue ignores the labels.

Each attempt is its own group (Kueue refuses to reuse a finished group's name, and a group never
takes replacement pods with `retriable-in-group: "false"`), so a restarted job queues again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpjob_api.spec import JobSpec
from ddpjob_operator.base import podinfo
from ddpjob_operator.base.group import Attempt

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
# Without it Kueue waits for replacement pods of a failed or deleted member forever, keeping the
# group's quota and its finalizers on the pods; the operator replaces whole groups, not pods.
RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
MANAGED_LABEL = "kueue.x-k8s.io/managed"  # Kueue's mark on the pods its webhook took
TERMINATION_TARGET = podinfo.TERMINATION_TARGET  # set on the pods of a group Kueue evicts
MAX_NAME = 63


def queue_name(job: JobSpec) -> str | None:
    """The LocalQueue the job's own label names, else its pods' (podLabels, the template's): a
    queue label on the pods alone would have Kueue admit them one by one (None: no queue)."""
    tpl = (job.spec.template or {}).get("metadata") or {}
    for mapping in ((job.raw.get("metadata") or {}).get("labels"), job.spec.pod_labels, tpl.get("labels")):
        value = (mapping or {}).get(QUEUE_LABEL) if isinstance(mapping, dict) else None
        if value:
            return str(value)
    return None


def group_name(job: JobSpec, attempt: int) -> str:
    """The pod group (and Kueue Workload) of one attempt: unique per job incarnation and attempt,
    a valid label value and object name (<= 63 characters)."""
    suffix = f"-{job.uid[:5]}-a{attempt}" if job.uid else f"-a{attempt}"
    return job.name[:MAX_NAME - len(suffix)].rstrip("-") + suffix


def pod_metadata(job: JobSpec, attempt: int) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) that put a pod of this attempt into its Kueue pod group."""
    queue = queue_name(job)
    if queue is None:
        return {}, {}
    return ({QUEUE_LABEL: queue, GROUP_LABEL: group_name(job, attempt)},
            {TOTAL_ANNOTATION: str(job.spec.nodes), RETRIABLE_ANNOTATION: "false"})


def gated(pod: dict[str, Any]) -> bool:
    """True while Kueue holds the pod (it has not admitted its group)."""
    return any(g.get("name") == ADMISSION_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


@dataclass(frozen=True)
class Admission:
    """What the Admitted condition says this pass."""

    admitted: bool
    reason: str
    message: str


def admission(job: JobSpec, attempt: Attempt) -> Admission | None:
    """Whether Kueue has admitted the current attempt's group; None when the job names no queue
    or none of its current pods exists yet."""
    queue, current = queue_name(job), attempt.active
    if queue is None or not current:
        return None
    group = group_name(job, attempt.number)
    waiting = sum(1 for p in current if gated(p))
    if waiting:
        return Admission(False, "Queued",
                         f"waiting in Kueue LocalQueue {queue} for quota for all {job.spec.nodes} pods: {waiting} "
                         f"gated ({ADMISSION_GATE}), holding no node or GPU; Kueue's Workload {group} says why")
    if any(((p.get("metadata") or {}).get("labels") or {}).get(MANAGED_LABEL) == "true" for p in current):
        return Admission(True, "Admitted", f"Kueue admitted pod group {group} from LocalQueue {queue}")
    return Admission(False, "NotManagedByKueue",
                     f"the pods name LocalQueue {queue} but Kueue did not take them (not installed, its pod "
                     f"integration off, or this namespace outside its managedJobsNamespaceSelector): they are "
                     f"scheduled without waiting for quota")
