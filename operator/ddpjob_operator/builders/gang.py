"""Gang scheduling through a real gang scheduler's PodGroup (pure builders).

A DDPJob's pods are useless one by one: two jobs that each get part of their nodes hold those
GPUs for good and neither starts. `spec.scheduling.gang.scheduler` names the scheduler that places
a job's pods all at once or not at all; the operator creates that scheduler's PodGroup (owned by
the DDPJob, one per job, reused by every attempt, as Kubeflow's training-operator does) and points
each pod at it. The scheduler does the rest; the operator only reads the PodGroup back for the
GangScheduled condition.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from ddpjob_api.phases import Reason
from ddpjob_api.spec import JobSpec
from ddpjob_operator.base.group import Attempt
from ddpjob_operator.builders.service import child_metadata


class GangScheduler(str, enum.Enum):
    """spec.scheduling.gang.scheduler."""

    COSCHEDULING = "coscheduling"
    VOLCANO = "volcano"


@dataclass(frozen=True)
class GangApi:
    """How one gang scheduler is addressed: its PodGroup type and how a pod names its group."""

    api_version: str
    scheduler_name: str          # the pods' schedulerName unless the job names another
    pod_label: str | None = None
    pod_annotation: str | None = None

    @property
    def group(self) -> str:
        """The PodGroup's API group (for messages and RBAC)."""
        return self.api_version.split("/", 1)[0]


APIS: dict[GangScheduler, GangApi] = {
    # scheduler-plugins' Coscheduling, run as a second scheduler under its upstream profile name.
    GangScheduler.COSCHEDULING: GangApi(api_version="scheduling.x-k8s.io/v1alpha1",
                                        scheduler_name="scheduler-plugins-scheduler",
                                        pod_label="scheduling.x-k8s.io/pod-group"),
    GangScheduler.VOLCANO: GangApi(api_version="scheduling.volcano.sh/v1beta1", scheduler_name="volcano",
                                   pod_annotation="scheduling.k8s.io/group-name"),
}
KIND = "PodGroup"
# Coscheduling's PodGroup controller never looks at a group again once it is Finished or Failed;
# a restarted gang in the same group (the scheduler reads only its spec) would show a stale phase.
STALE_PHASES = frozenset({"Finished", "Failed"})


def scheduler_of(job: JobSpec) -> GangScheduler | None:
    """The job's gang scheduler, None without one."""
    gang = job.scheduling.gang
    return GangScheduler(gang.scheduler) if gang else None


def api_of(job: JobSpec) -> GangApi | None:
    """The job's gang scheduler's API, None without one."""
    sched = scheduler_of(job)
    return APIS[sched] if sched else None


def podgroup_name(job: JobSpec) -> str:
    """One PodGroup per job, named like it (as the job's Service is)."""
    return job.name


def min_member(job: JobSpec) -> int:
    """Pods that must be placed together: every node, or an elastic job's minimum."""
    return job.min_nodes


def pod_metadata(job: JobSpec) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) that put a pod into its job's PodGroup."""
    api = api_of(job)
    if api is None:
        return {}, {}
    name = podgroup_name(job)
    return ({api.pod_label: name} if api.pod_label else {}), ({api.pod_annotation: name} if api.pod_annotation else {})


def default_scheduler_name(job: JobSpec) -> str | None:
    """The gang scheduler's name, as the pods' default (the job's or template's schedulerName
    wins: Coscheduling may run under another profile name, or inside the default scheduler)."""
    api = api_of(job)
    return api.scheduler_name if api else None


def _format(name: str, value: Decimal) -> str:
    """A quantity as people write it: 12, 500m, and 48Gi for byte counts (a GPU count is not)."""
    if value != value.to_integral_value():
        return f"{int((value * 1000).to_integral_value(rounding=ROUND_CEILING))}m"
    whole = int(value)
    if name in ("memory", "ephemeral-storage") or name.startswith("hugepages-"):
        for suffix, size in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("T", 10**12), ("G", 10**9),
                             ("M", 10**6)):
            if whole >= size and whole % size == 0:
                return f"{whole // size}{suffix}"
    return str(whole)


def pod_requests(fields: dict[str, Any]) -> dict[str, Decimal]:
    """What the scheduler reserves for one pod (`fields`: its spec): its containers' and native sidecars' requests
    (a limit alone is the request), or its largest init container's when that is more."""
    def requests(c: dict[str, Any]) -> dict[str, Decimal]:
        res = c.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return {k: Decimal(parse_quantity(v)) for k, v in merged.items()}

    total: dict[str, Decimal] = {}
    inits = fields.get("initContainers") or []
    for c in list(fields.get("containers") or []) + [i for i in inits if i.get("restartPolicy") == "Always"]:
        for k, v in requests(c).items():
            total[k] = total.get(k, Decimal(0)) + v
    for c in inits:
        if c.get("restartPolicy") != "Always":
            for k, v in requests(c).items():
                total[k] = max(total.get(k, Decimal(0)), v)
    return total


def min_resources(job: JobSpec, pod: dict[str, Any]) -> dict[str, str]:
    """The gang's total requests (min_member pods like `pod`): lets the scheduler turn a gang away
    at once when the cluster could never hold it, and Volcano admit it against its queue."""
    count = min_member(job)
    return {k: _format(k, v * count) for k, v in sorted(pod_requests(pod.get("spec") or {}).items()) if v > 0}


def render_podgroup(job: JobSpec, pod: dict[str, Any]) -> dict[str, Any] | None:
    """The PodGroup for the job (None without gang scheduling); `pod` is one rendered pod, whose
    requests and priority the group's are made of."""
    sched = scheduler_of(job)
    if sched is None:
        return None
    api, gang = APIS[sched], job.scheduling.gang
    assert gang is not None
    group: dict[str, Any] = {"minMember": min_member(job)}
    resources = min_resources(job, pod)
    if resources:
        group["minResources"] = resources
    if sched is GangScheduler.COSCHEDULING and gang.schedule_timeout_seconds:
        group["scheduleTimeoutSeconds"] = gang.schedule_timeout_seconds
    if sched is GangScheduler.VOLCANO:
        if gang.queue:
            group["queue"] = gang.queue
        priority = (pod.get("spec") or {}).get("priorityClassName")
        if priority:
            group["priorityClassName"] = priority
    return {"apiVersion": api.api_version, "kind": KIND, "metadata": child_metadata(job, podgroup_name(job)),
            "spec": group}


@dataclass(frozen=True)
class GangState:
    """What the GangScheduled condition says this pass."""

    placed: bool
    reason: str
    message: str


def gang_state(job: JobSpec, attempt: Attempt, *, podgroup: dict[str, Any] | None) -> GangState | None:
    """Whether the current attempt's gang is placed, from its pods (bound or not) and the
    PodGroup's own status where its scheduler keeps one; None for a job without gang scheduling."""
    api = api_of(job)
    if api is None:
        return None
    need = min_member(job)
    current = attempt.active
    bound = sum(1 for p in current if (p.get("spec") or {}).get("nodeName"))
    scheduler = next(((p.get("spec") or {}).get("schedulerName") for p in current), None) \
        or default_scheduler_name(job)
    where = f"PodGroup {podgroup_name(job)} ({api.group}, minMember {need})"
    if current and bound >= need:
        return GangState(True, "Scheduled", f"{bound}/{job.spec.nodes} pods placed together by {scheduler}; {where}")
    pg_status = (podgroup or {}).get("status") or {}
    phase = str(pg_status.get("phase") or "")
    if phase in STALE_PHASES:
        phase = ""
    text = f"waiting for {scheduler} to place {need} pods at once ({bound} bound); {where}"
    if phase:
        text += f", phase {phase}"
    said = next((c.get("message") for p in current for c in (p.get("status") or {}).get("conditions") or []
                 if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("message")), None)
    if said:
        text += f"; the scheduler says: {str(said)[:300]}"
    if podgroup is None and current:
        text += "; the PodGroup is missing or could not be read"
    return GangState(False, phase or Reason.WAITING_FOR_GANG, text)
