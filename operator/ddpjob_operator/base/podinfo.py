"""Read-only facts about observed pods (pure helpers over pod dicts from the API)."""
from __future__ import annotations

import datetime as dt
from typing import Any

from ddpjob_api import contract, labels
from ddpjob_api.contract import EXIT_BAD_CONFIG  # never retried
from ddpjob_operator.base.objmeta import parse_time


def meta(pod: dict[str, Any]) -> dict[str, Any]:
    return pod.get("metadata") or {}


def name(pod: dict[str, Any]) -> str:
    return str(meta(pod).get("name", ""))


def _int_label(pod: dict[str, Any], key: str) -> int:
    try:
        return int((meta(pod).get("labels") or {}).get(key, -1))
    except (TypeError, ValueError):
        return -1


def rank(pod: dict[str, Any]) -> int:
    """The pod's node rank label (-1 when missing)."""
    return _int_label(pod, labels.NODE_RANK)


def lighthouse(pod: dict[str, Any]) -> bool:
    """The pod is a per-step job's torchft Lighthouse, not one of its training pods (labels.ROLE)."""
    return (meta(pod).get("labels") or {}).get(labels.ROLE) == labels.ROLE_LIGHTHOUSE


def ready(pod: dict[str, Any]) -> bool:
    """Running, not being deleted, and its Ready condition True (its readiness probe passes)."""
    conds = {c.get("type"): c.get("status") for c in _conditions(pod)}
    return phase(pod) == "Running" and not terminating(pod) and conds.get("Ready") == "True"


def attempt(pod: dict[str, Any]) -> int:
    """The pod's attempt label (-1 when missing)."""
    return _int_label(pod, labels.ATTEMPT)


def replacement(pod: dict[str, Any]) -> int:
    """Which replacement of its rank within the attempt the pod is (0: the attempt's own pod)."""
    return max(0, _int_label(pod, labels.REPLACEMENT))


def phase(pod: dict[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def ended(pod: dict[str, Any]) -> bool:
    """Succeeded or Failed: every container has terminated (the scheduler no longer counts it)."""
    return phase(pod) in ("Succeeded", "Failed")


def terminating(pod: dict[str, Any]) -> bool:
    return bool(meta(pod).get("deletionTimestamp"))


def coming_up(pod: dict[str, Any]) -> bool:
    """Created, scheduled or started and nothing else: not ended, not terminating, no container
    that has terminated (a crash, a restart). Such a move asks nothing of a job that comes up."""
    return phase(pod) in ("Pending", "Running") and not terminating(pod) and not terminated_states(pod)


# What a kubelet shows of a container between the pod's scheduling and its start, whatever happens.
STARTING_REASONS = frozenset({"ContainerCreating", "PodInitializing"})


def plain_progress(pod: dict[str, Any]) -> bool:
    """Coming up with nothing a status could show: no scheduling gate, not turned away by a
    scheduler (PodScheduled False), no container waiting for any reason but starting, its node
    reporting. What a DDPJob's status says of its pods meanwhile is only their count."""
    if not coming_up(pod) or (pod.get("spec") or {}).get("schedulingGates") or node_not_ready(pod):
        return False
    if any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in _conditions(pod)):
        return False
    status = pod.get("status") or {}
    return all(((cs.get("state") or {}).get("waiting") or {}).get("reason", "ContainerCreating") in STARTING_REASONS
               for key in ("initContainerStatuses", "containerStatuses") for cs in status.get(key) or []
               if (cs.get("state") or {}).get("waiting") is not None)


def gone_by(pod: dict[str, Any]) -> dt.datetime | None:
    """When a terminating pod should be gone (its deletionTimestamp: the delete request plus the
    grace period); None when it is not terminating."""
    return parse_time(meta(pod).get("deletionTimestamp"))


def _conditions(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list((pod.get("status") or {}).get("conditions") or [])


def terminated_states(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """`state.terminated` of every container that has terminated, the trainer's first (the kubelet
    lists them by name, and a template's sidecars may come before it). When none has, those of
    the init containers: one that failed ends the pod before any container started."""
    status = pod.get("status") or {}

    def ended(key: str) -> list[dict[str, Any]]:
        found = [(cs.get("name") != labels.CONTAINER, (cs.get("state") or {}).get("terminated"))
                 for cs in status.get(key) or []]
        return [term for _, term in sorted(found, key=lambda f: f[0]) if term]
    return ended("containerStatuses") or ended("initContainerStatuses")


def trainer_state(pod: dict[str, Any]) -> dict[str, Any] | None:
    """`state.terminated` of the trainer container (None until it has ended)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == labels.CONTAINER:
            return (cs.get("state") or {}).get("terminated")
    return None


def failure_step(pod: dict[str, Any]) -> int | None:
    """The newest step the pod's ranks finished before its training failed, as its launcher wrote
    it in the trainer container's termination message (contract.failure_head); None without one."""
    return contract.failure_step((trainer_state(pod) or {}).get("message"))


def exit_code(pod: dict[str, Any]) -> int | None:
    """The first non-zero container exit code (else 0 when all terminated, None if none did)."""
    states = terminated_states(pod)
    if not states:
        return None
    codes = [int(s.get("exitCode") or 0) for s in states]
    return next((c for c in codes if c != 0), 0)


def failure_message(pod: dict[str, Any]) -> str:
    """Why the pod stopped, in one line: termination message or pod status message."""
    for s in terminated_states(pod):
        msg = (s.get("message") or "").strip()
        if msg and int(s.get("exitCode") or 0) != 0:
            return msg.splitlines()[-1][:300]
    return str((pod.get("status") or {}).get("message") or "")[:300]


# Kueue's condition on the pods of a group it evicts (preemption, fair-share reclaim), set before it
# deletes them: as free as the scheduler's own preemption.
TERMINATION_TARGET = "TerminationTarget"



def bad_config(pod: dict[str, Any]) -> bool:
    """True when the launcher exited with the bad-configuration code (a sidecar's 78 is its own)."""
    return phase(pod) == "Failed" and int((trainer_state(pod) or {}).get("exitCode") or 0) == EXIT_BAD_CONFIG



def unschedulable_since(pod: dict[str, Any]) -> tuple[dt.datetime | None, str] | None:
    """(since, scheduler message) while the scheduler cannot place the pod, else None."""
    if phase(pod) != "Pending" or terminating(pod):
        return None
    for c in _conditions(pod):
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return parse_time(c.get("lastTransitionTime")), str(c.get("message") or "")
    return None


def scheduled_at(pod: dict[str, Any]) -> dt.datetime | None:
    """When the scheduler placed the pod (its PodScheduled condition turned True), else None; a
    pod past Pending that carries no such condition, when the kubelet started it."""
    for c in _conditions(pod):
        if c.get("type") == "PodScheduled" and c.get("status") == "True":
            return parse_time(c.get("lastTransitionTime"))
    if phase(pod) not in ("", "Pending"):
        return parse_time((pod.get("status") or {}).get("startTime"))
    return None


def node_not_ready(pod: dict[str, Any]) -> bool:
    """A running pod whose node stopped reporting: the node lifecycle controller marks the pod not
    Ready while its containers, as last reported by the kubelet, are still ready. The operator
    reads no Node objects (least privilege); this is how a lost or stalled kubelet shows on a pod."""
    if phase(pod) != "Running" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conds = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    return conds.get("Ready") == "False" and conds.get("ContainersReady") == "True"


# kwok manages the nodes that carry this annotation: their pods' addresses are fictitious (they belong
# to no host), so reaching one by its address can only fail, or leave the machine.
SIMULATED_NODE_ANNOTATION = "kwok.x-k8s.io/node"


def is_simulated_node(node: dict[str, Any] | None) -> bool:
    """True when kwok simulates this Node object (the operator's scrapes and the CLI's `top --live`
    skip its pods)."""
    return SIMULATED_NODE_ANNOTATION in (((node or {}).get("metadata") or {}).get("annotations") or {})


# What the operator reads of a pod, all modules together (this one, base/group and base/objmeta,
# decisions/lifecycle and status, builders/gang and kueue, cluster/monitor): the pod cache keeps
# these fields and nothing else (`slim`), as client-go's informer transform functions do. A key
# maps to None (kept whole) or to the shape of its value (a dict's, or each list item's).
# tests/unit/test_podinfo_slim.py holds every reader equal on a table of real pods, slim or whole.
_CONTAINER_STATUS = {"name": None, "state": None}
KEPT: dict[str, Any] = {
    "apiVersion": None, "kind": None,
    "metadata": {"name": None, "namespace": None, "uid": None, "resourceVersion": None, "labels": None,
                 "annotations": None, "ownerReferences": None, "deletionTimestamp": None},
    "spec": {"nodeName": None, "schedulerName": None, "schedulingGates": None},
    "status": {"phase": None, "reason": None, "message": None, "podIP": None, "startTime": None,
               "conditions": {"type": None, "status": None, "reason": None, "message": None,
                              "lastTransitionTime": None},
               "containerStatuses": _CONTAINER_STATUS, "initContainerStatuses": _CONTAINER_STATUS},
}
def _cut(value: Any, shape: dict[str, Any] | None) -> Any:
    if shape is None or not isinstance(value, (dict, list)):
        return value
    if isinstance(value, list):
        return [_cut(v, shape) for v in value]
    return {k: _cut(v, shape[k]) for k, v in value.items() if k in shape}


def slim(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as the cache keeps it: only the fields in KEPT (no managedFields, env, volumes,
    containers' spec, images). A new dict whose kept values are the pod's own (the cache packs it
    at once: cluster/cache.PackedStore); `pod` is left as it was."""
    return _cut(pod, KEPT)
