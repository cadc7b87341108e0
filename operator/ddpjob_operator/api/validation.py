"""Validate a DDPJob dict the way the API server would: the CRD's schema plus its CEL rules.

The schema is read from the CRD file (crd.py), translated from Kubernetes' OpenAPI dialect
to JSON Schema; the CRD's CEL rules (x-kubernetes-validations) are evaluated as written, by a CEL
library, because `ddpjob run --local` has no API server to evaluate them. The CRD stays their one
home: a rule added there is enforced here with no change to this file.
"""
from __future__ import annotations

import copy
import functools
import re
from typing import Any

import jsonschema

from ddpjob_operator.api import crd as crd_mod
from ddpjob_operator.api.spec import API_VERSION, KIND

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


def _is_quantity(value: Any) -> Any:
    """Kubernetes' CEL library function `isQuantity(string)`: a resource quantity such as 16Gi."""
    from celpy import celtypes

    return celtypes.BoolType(isinstance(value, str) and _QUANTITY.match(value) is not None)


@functools.cache
def _program(rule: str) -> Any:
    """One CEL rule compiled once (cel-python, the RE2 regex engine the API server's CEL uses too)."""
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule), functions={"isQuantity": _is_quantity})


def _rule_holds(rule: str, value: Any) -> tuple[bool, str]:
    """(holds, why not) for one rule with `self` bound to value."""
    import celpy

    try:
        result = _program(rule).evaluate({"self": celpy.json_to_cel(value)})
    except celpy.CELEvalError as exc:
        return False, str(exc)
    if isinstance(result, celpy.CELEvalError):
        return False, str(result)
    return bool(result), ""


def _cel(schema: dict, value: Any, path: str) -> list[str]:
    """The CRD's own x-kubernetes-validations, evaluated where the API server evaluates them: at each
    node of the schema that the object has. Transition rules (oldSelf) need the stored object, which a
    local run has not: they stay the API server's."""
    errs: list[str] = []
    for check in schema.get("x-kubernetes-validations") or ():
        if "oldSelf" in check["rule"]:
            continue
        holds, why = _rule_holds(check["rule"], value)
        if not holds:
            message = check.get("message") or f"{path}: failed rule: {check['rule']}"
            errs.append(message + (f" (the rule could not be evaluated: {why})" if why else ""))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            child = props.get(key) if key in props else (extra if isinstance(extra, dict) else None)
            if child is not None and sub is not None:
                errs.extend(_cel(child, sub, f"{path}.{key}" if path else key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            errs.extend(_cel(schema["items"], sub, f"{path}[{i}]"))
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
    if not str((obj.get("metadata") or {}).get("name") or ""):
        # The API server needs a name before any rule runs; the root's rules read it.
        return errs + ["metadata.name: required field is missing"]
    raw, _ = _raw_and_json_schema()
    errs.extend(e for e in _cel(raw, defaulted, "") if e not in errs)
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
