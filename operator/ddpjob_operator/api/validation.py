"""Validate a DDPJob dict the way the API server would: the CRD's schema plus its CEL rules.

The schema is read from the CRD file (crd.py), translated from Kubernetes' OpenAPI dialect
to JSON Schema; the CEL rules are re-expressed below, with the same messages, because
`ddpjob run --local` has no API server to evaluate them.
"""
from __future__ import annotations

import copy
import functools
import re
from typing import Any, TypeGuard

import jsonschema

from ddpjob_operator.api import crd as crd_mod
from ddpjob_operator.api import labels
from ddpjob_operator.api.spec import API_VERSION, KIND

MAX_NAME = 58            # `<name>-<rank>` <= 63 characters for ranks up to 9999
MAX_NODES = 10000
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def _translate(node: Any) -> Any:
    """Kubernetes structural schema -> JSON Schema (draft 4, which OpenAPI 3.0 follows)."""
    if isinstance(node, list):
        return [_translate(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _translate(v) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k not in ("nullable", "format", "default", "description")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    # The API server rejects unknown fields (kubectl's strict field validation); do the same
    # except where the CRD keeps unknown fields on purpose (deep Kubernetes types).
    if ("properties" in out and not node.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in out):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=4)
def _schema(path: str) -> tuple[dict, dict]:
    raw = crd_mod.version_schema(crd_mod.load_crd(path))
    return raw, _translate(raw)


def _raw_and_json_schema() -> tuple[dict, dict]:
    return _schema(str(crd_mod.crd_path()))


def _defaults(schema: dict, value: Any) -> Any:
    """Apply the schema's defaults (as the API server does before validation)."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    for key, sub in (schema.get("properties") or {}).items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            value[key] = _defaults(sub, value[key])
    return value


def apply_defaults(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of the DDPJob with the CRD's defaults filled in."""
    raw, _ = _raw_and_json_schema()
    return _defaults(raw, copy.deepcopy(obj))


def _path(error: jsonschema.ValidationError) -> str:
    parts: list[str] = []
    for p in error.absolute_path:
        parts.append(f"[{p}]" if isinstance(p, int) else ("." if parts else "") + str(p))
    return "".join(parts) or "<root>"


def _schema_message(error: jsonschema.ValidationError) -> str:
    where = _path(error)
    if error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        names = ", ".join(f"{where}.{e}" if where != "<root>" else e for e in extra)
        return f"{names}: unknown field"
    if error.validator == "anyOf" and error.schema.get("anyOf") == [{"type": "integer"}, {"type": "string"}]:
        return f"{where}: must be an integer or a string, got {error.instance!r}"
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return f"{where + '.' if where != '<root>' else ''}{missing}: required field is missing"
    return f"{where}: {error.message}"


def _cel(obj: dict[str, Any]) -> list[str]:
    """The CRD's x-kubernetes-validations, re-expressed (same messages)."""
    errs: list[str] = []
    name = str((obj.get("metadata") or {}).get("name") or "")
    if not name:
        errs.append("metadata.name: required field is missing")
    else:
        if len(name) > MAX_NAME:
            errs.append(f"metadata.name: must be at most {MAX_NAME} characters so that every pod's DNS "
                        f"name `<name>-<rank>` fits 63 characters (got {len(name)})")
        if not _DNS1035.match(name):
            errs.append("metadata.name: must be a DNS-1035 label (lowercase letters, digits, '-', "
                        "starting with a letter): it names the headless Service")
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return errs

    def is_int(v: Any) -> TypeGuard[int]:
        return isinstance(v, int) and not isinstance(v, bool)

    nodes = spec.get("nodes")
    if is_int(nodes) and nodes < 1:
        errs.append("spec.nodes must be >= 1")
    if is_int(nodes) and nodes > MAX_NODES:
        errs.append(f"spec.nodes must be <= {MAX_NODES}")
    def bad_int_or_auto(v: Any, low: int) -> bool:
        """The CRD's `type(self) == int ? self >= low : self == 'auto'` (other types: the schema's)."""
        return isinstance(v, (int, str)) and v != "auto" and not (is_int(v) and v >= low)

    if bad_int_or_auto(spec.get("nprocPerNode"), 1):
        errs.append('spec.nprocPerNode must be "auto" or an integer >= 1')
    gpus = spec.get("gpusPerNode")
    if is_int(gpus) and gpus < 0:
        errs.append("spec.gpusPerNode must be >= 0")
    nproc = spec.get("nprocPerNode")
    if is_int(nproc) and is_int(gpus) and 0 < gpus < nproc:
        errs.append('spec.nprocPerNode must be <= spec.gpusPerNode: each process of a GPU job drives one GPU '
                    'of its pod ("auto" = one per GPU)')
    if spec.get("rdma") is not None and not (is_int(gpus) and gpus > 0):
        errs.append("spec.rdma needs spec.gpusPerNode > 0: RDMA carries NCCL's traffic between GPUs (a CPU job's "
                    "gloo uses TCP)")
    trainer = spec.get("trainer")
    if isinstance(trainer, dict) and bad_int_or_auto(trainer.get("numWorkers"), 0):
        errs.append('spec.trainer.numWorkers must be "auto" or an integer >= 0')
    for port in ("masterPort", "metricsPort"):
        val = spec.get(port)
        if is_int(val) and not 1 <= val <= 65535:
            errs.append(f"spec.{port} must be between 1 and 65535")
    if spec.get("masterPort") is not None and spec.get("masterPort") == spec.get("metricsPort"):
        errs.append("spec.masterPort and spec.metricsPort must differ")
    shm = spec.get("shmSize")
    if shm is not None and not ((is_int(shm) and shm > 0) or (isinstance(shm, str) and _QUANTITY.match(shm))):
        errs.append("spec.shmSize must be a quantity such as 16Gi")
    elastic = spec.get("elastic")
    if isinstance(elastic, dict):
        lo, hi = elastic.get("minNodes"), elastic.get("maxNodes")
        for key, val in (("minNodes", lo), ("maxNodes", hi)):
            if is_int(val) and val < 1:
                errs.append(f"spec.elastic.{key} must be >= 1")
        if is_int(elastic.get("maxRestarts")) and elastic["maxRestarts"] < 0:
            errs.append("spec.elastic.maxRestarts must be >= 0")
        if is_int(lo) and is_int(nodes) and lo > nodes:
            errs.append("spec.elastic.minNodes must be <= spec.nodes")
        if is_int(hi) and is_int(nodes) and nodes > hi:
            errs.append("spec.elastic.maxNodes must be >= spec.nodes")
        if is_int(lo) and is_int(hi) and lo > hi:
            errs.append("spec.elastic.minNodes must be <= spec.elastic.maxNodes")
    sched = spec.get("scheduling") if isinstance(spec.get("scheduling"), dict) else {}
    gang = sched.get("gang") if isinstance(sched.get("gang"), dict) else {}
    if "scheduleTimeoutSeconds" in gang and gang.get("scheduler") != "coscheduling":
        errs.append("spec.scheduling.gang.scheduleTimeoutSeconds applies to scheduler coscheduling only")
    if "queue" in gang and gang.get("scheduler") != "volcano":
        errs.append("spec.scheduling.gang.queue applies to scheduler volcano only (Kueue queues are set "
                    "with the kueue.x-k8s.io/queue-name label)")
    fp = spec.get("failurePolicy")
    if isinstance(fp, dict):
        for key, low in (("maxRestarts", 0), ("podStartTimeoutSeconds", 1)):
            if is_int(fp.get(key)) and fp[key] < low:
                errs.append(f"spec.failurePolicy.{key} must be >= {low}")
        keep = fp.get("keepFailedAttempts")
        if is_int(keep) and not 0 <= keep <= 10:
            errs.append("spec.failurePolicy.keepFailedAttempts must be between 0 and 10")
    for key, low in (("hangTimeoutSeconds", 1), ("ttlSecondsAfterFinished", 0), ("activeDeadlineSeconds", 1)):
        if is_int(spec.get(key)) and spec[key] < low:
            errs.append(f"spec.{key} must be >= {low}")
    tpl = spec.get("template") if isinstance(spec.get("template"), dict) else {}
    meta = tpl.get("metadata") if isinstance(tpl.get("metadata"), dict) else {}
    for where, mapping, what in (("spec.podLabels", spec.get("podLabels"), "labels"),
                                 ("spec.podAnnotations", spec.get("podAnnotations"), "annotations"),
                                 ("spec.template.metadata.labels", meta.get("labels"), "labels"),
                                 ("spec.template.metadata.annotations", meta.get("annotations"), "annotations")):
        if isinstance(mapping, dict) and any(labels.reserved(str(k)) for k in mapping):
            errs.append(f"{where} must not use ddpjob.dev/ keys (the operator's own {what})")
    pod = tpl.get("spec") if isinstance(tpl.get("spec"), dict) else {}
    if pod.get("restartPolicy") not in (None, "Never", ""):
        errs.append("spec.template.spec.restartPolicy must be Never: the operator restarts the whole group "
                    "(a pod restarting on its own would rejoin a rendezvous the other ranks have left)")
    for key in ("hostname", "subdomain"):
        if pod.get(key) is not None:
            errs.append(f"spec.template.spec.{key} must not be set: the operator names every pod "
                        f"<job>-<rank> in the subdomain <job>, its stable DNS name")
    owned = ("image", "command", "args", "terminationMessagePolicy")
    containers = pod.get("containers") if isinstance(pod.get("containers"), list) else []
    if any(isinstance(c, dict) and c.get("name") == labels.CONTAINER and any(c.get(k) is not None for k in owned)
           for c in containers):
        errs.append("spec.template.spec.containers: the trainer container's image, command, args and "
                    "terminationMessagePolicy are the operator's (spec.image, spec.command, spec.args; the "
                    "launcher's termination message)")
    return errs


def validate_manifest(obj: Any) -> list[str]:
    """Problems with a DDPJob dict, each naming the field; [] when the API server would accept it."""
    if not isinstance(obj, dict):
        return [f"<root>: a DDPJob must be a mapping, got {type(obj).__name__}"]
    errs: list[str] = []
    if obj.get("apiVersion") != API_VERSION:
        errs.append(f"apiVersion: must be {API_VERSION}, got {obj.get('apiVersion')!r}")
    if obj.get("kind") != KIND:
        errs.append(f"kind: must be {KIND}, got {obj.get('kind')!r}")
    _, schema = _raw_and_json_schema()
    defaulted = apply_defaults(obj)
    validator = jsonschema.Draft4Validator(schema)
    for error in sorted(validator.iter_errors(defaulted), key=lambda e: list(map(str, e.absolute_path))):
        errs.append(_schema_message(error))
    errs.extend(e for e in _cel(defaulted) if e not in errs)
    return errs


class InvalidDDPJob(ValueError):
    """A DDPJob that the API server would refuse; str() lists every problem."""

    def __init__(self, problems: list[str]):
        super().__init__("invalid DDPJob:\n  " + "\n  ".join(problems))
        self.problems = problems


def check_manifest(obj: Any) -> None:
    """Raise InvalidDDPJob when validate_manifest finds problems."""
    problems = validate_manifest(obj)
    if problems:
        raise InvalidDDPJob(problems)
