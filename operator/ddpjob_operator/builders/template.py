"""spec.template, the user's pod, merged with what the operator sets on it (pure).

A field of the pod, or of its `trainer` container, comes from four layers, lowest first:

  default   the operator's defaults (hardened securityContext, one pod per node, no service links)
  template  spec.template: the user's pod
  flat      the shorthand fields (spec.volumes, spec.resources, spec.scheduling.*, ...)
  owned     what the job needs to work (rank identity, the launcher, env, GPUs, /dev/shm)

and the rule tables below say how each field combines them. A field that only the template sets
is the template's, and so are its other containers and init containers. Without a template the
pod is exactly what the flat fields alone always gave, key order included.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from ddpjob_api import labels
from ddpjob_api.spec import JobSpec


@dataclass(frozen=True)
class Layers:
    """One field as the operator's layers set it; None: unset there. A falsy flat value is unset
    too: that is how the shorthands have always been read (`nodeSelector: {}` sets nothing)."""

    default: Any = None
    flat: Any = None
    owned: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "flat", self.flat or None)


Rule = Callable[[Layers, Any], Any]


def _top(v: Layers, tpl: Any) -> Any:
    """The highest layer that sets the field wins."""
    return copy.deepcopy(next((x for x in (v.owned, v.flat, tpl, v.default) if x is not None), None))


def _owned(v: Layers, tpl: Any) -> Any:
    """The operator's alone: what makes the pod one rank of the job. The schema refuses a template
    that sets one of these; one that got past it (an older CRD) is dropped here."""
    return copy.deepcopy(v.owned)


def _concat(v: Layers, tpl: Any) -> list[Any] | None:
    """The operator's entries, then the template's, then the flat field's. Nothing is dropped: a
    name given twice (a volume, a port) is the API server's to refuse, naming the field."""
    out = [copy.deepcopy(x) for layer in (v.owned, tpl, v.flat) for x in (layer or [])]
    return out or None


def _keys(v: Layers, tpl: Any) -> dict[str, Any]:
    """A securityContext: key by key, the operator's defaults under the template's under the flat
    field's; capabilities merge per list, so a job that only adds NET_RAW still drops the rest;
    capabilities the operator adds (owned) are added to whatever list that gives."""
    out = copy.deepcopy(v.default or {})
    user = {**copy.deepcopy(tpl or {}), **copy.deepcopy(v.flat or {})}
    caps = [layer["capabilities"] for layer in (v.default, tpl, v.flat) if (layer or {}).get("capabilities")]
    if user.get("privileged"):
        # The API refuses privileged together with allowPrivilegeEscalation: false.
        out.pop("allowPrivilegeEscalation", None)
    user.pop("capabilities", None)
    out.update(user)
    if caps:
        out["capabilities"] = copy.deepcopy({k: c for layer in caps for k, c in layer.items()})
    # The operator's own additions (spec.rdma's IPC_LOCK) join the list whoever else sets it.
    for cap in ((v.owned or {}).get("capabilities") or {}).get("add") or []:
        added = out.setdefault("capabilities", {}).setdefault("add", [])
        if cap not in added:
            added.append(cap)
    return out


def _resources(v: Layers, tpl: Any) -> dict[str, Any]:
    """limits and requests merge per resource name (the flat field's win); the operator's limits
    (nvidia.com/gpu = gpusPerNode) win over both, and an extended resource's request, when one is
    given, must equal its limit."""
    out: dict[str, Any] = {}
    for layer in (tpl, v.flat):
        for key, value in (layer or {}).items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **copy.deepcopy(value)}
            else:
                out[key] = copy.deepcopy(value)
    for name, amount in ((v.owned or {}).get("limits") or {}).items():
        out.setdefault("limits", {})[name] = amount
        if name in (out.get("requests") or {}):
            out["requests"][name] = amount
    return out


# How each field combines the layers; any other field: _top.
POD_RULES: dict[str, Rule] = {
    "hostname": _owned, "subdomain": _owned, "restartPolicy": _owned,
    "securityContext": _keys, "volumes": _concat, "imagePullSecrets": _concat,
}
CONTAINER_RULES: dict[str, Rule] = {
    "name": _owned, "image": _owned, "command": _owned, "args": _owned, "terminationMessagePolicy": _owned,
    # envvars.pod_env: the operator's variables, the template container's, spec.env's (by name).
    "env": _owned,
    "ports": _concat, "volumeMounts": _concat, "envFrom": _concat,
    "resources": _resources, "securityContext": _keys,
}
CONTAINERS = "containers"


def pod_template(job: JobSpec) -> dict[str, Any]:
    """spec.template ({} when absent)."""
    return job.spec.template or {}


def pod_spec(job: JobSpec) -> dict[str, Any]:
    """spec.template.spec, the template's pod fields ({} when absent)."""
    return pod_template(job).get("spec") or {}


def trainer_index(template: dict[str, Any]) -> int | None:
    """Where the template's `trainer` container is in its containers (None: it has none)."""
    containers = (template.get("spec") or {}).get(CONTAINERS) or []
    return next((i for i, c in enumerate(containers) if c.get("name") == labels.CONTAINER), None)


def trainer_container(template: dict[str, Any]) -> dict[str, Any]:
    """The template's `trainer` container ({} when it has none)."""
    i = trainer_index(template)
    return {} if i is None else template["spec"][CONTAINERS][i]


def template_env(job: JobSpec) -> list[tuple[int, dict[str, Any]]]:
    """(index, entry) of the template container's env entries that spec.env leaves standing."""
    flat = {e.get("name") for e in job.env}
    return [(i, e) for i, e in enumerate(trainer_container(pod_template(job)).get("env") or [])
            if e.get("name") not in flat]


def user_env(job: JobSpec) -> list[dict[str, Any]]:
    """The user's variables, in order: the template container's, then spec.env (which wins by name)."""
    return [dict(e) for _, e in template_env(job)] + [dict(e) for e in job.env]


def user_metadata(job: JobSpec, key: str, flat: dict[str, str] | None) -> dict[str, str]:
    """The template's labels or annotations (`key`) under the flat shorthand's (`flat`: spec.podLabels
    or spec.podAnnotations), without the operator's reserved keys: the operator's own labels and
    annotations go on top."""
    tpl = (pod_template(job).get("metadata") or {}).get(key)
    label = key == "labels"
    return {**labels.user_keys(tpl, label=label), **labels.user_keys(flat, label=label)}


def _merge(fields: dict[str, Layers], rules: dict[str, Rule], tpl: dict[str, Any],
           containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, layers in fields.items():
        value = containers if key == CONTAINERS else rules.get(key, _top)(layers, tpl.get(key))
        if value is not None:
            out[key] = value
    # What the operator does not set at all is the template's, after the operator's fields.
    out.update({k: copy.deepcopy(v) for k, v in tpl.items() if k not in fields})
    return out


def merge_template(template: dict[str, Any], *, pod: dict[str, Layers],
                   container: dict[str, Layers]) -> dict[str, Any]:
    """The pod spec: `template` (spec.template) under the operator's layers, per field and in the
    order `pod` and `container` list them (`pod` names where `containers` goes), then the fields
    only the template sets.

    The trainer container is the template's container named `trainer`, kept in its place, or a
    new one first; the template's other containers and its init containers are copied as they are."""
    tpl = template.get("spec") or {}
    trainer = _merge(container, CONTAINER_RULES, trainer_container(template))
    containers = [copy.deepcopy(c) for c in tpl.get(CONTAINERS) or []]
    i = trainer_index(template)
    if i is None:
        containers.insert(0, trainer)
    else:
        containers[i] = trainer
    return _merge(pod if CONTAINERS in pod else {CONTAINERS: Layers(), **pod}, POD_RULES, tpl, containers)
