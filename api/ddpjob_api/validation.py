"""Validate a DDPJob dict the way the API server would: the CRD's schema plus its CEL rules.

The schema is read from the CRD file and checked by the CRD's evaluator, which the trainer
checks `spec.trainer` with too (ddpjob_api.crdschema: Kubernetes' keywords on jsonschema); the
CRD's CEL rules (x-kubernetes-validations) are evaluated as written, by a CEL library, because
`ddpjob run --local` has no API server to evaluate them. The CRD stays their one home: a rule added
there is enforced here with no change to this file.
"""
from __future__ import annotations

import copy
from typing import Any

import jsonschema

from ddpjob_api.spec import API_VERSION, KIND
from ddpjob_api import crdschema


def _schema() -> dict[str, Any]:
    return crdschema.version_schema()


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
    return _defaults(_schema(), copy.deepcopy(obj))


def _message(error: jsonschema.ValidationError) -> str:
    where = crdschema.field(error) or "<root>"
    if error.validator == "properties":  # a key the schema does not know (its own errors carry theirs)
        return f"{where}: unknown field"
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return f"{where + '.' if where != '<root>' else ''}{missing}: required field is missing"
    if error.validator == "x-kubernetes-validations":
        # A rule's own message names its field; the evaluation error says why a rule failed unevaluated.
        message = error.message if error.validator_value.get("message") else f"{where}: {error.message}"
        return message + (f" (the rule could not be evaluated: {error.cause})" if error.cause else "")
    return f"{where}: {error.message}"


def validate_manifest(obj: Any) -> list[str]:
    """Problems with a DDPJob dict, each naming the field; [] when the API server would accept it.
    The CRD's CEL rules come after the schema's own checks, and only once the object has a name
    (the API server needs one before any rule runs; the root's rules read it)."""
    if not isinstance(obj, dict):
        return [f"<root>: a DDPJob must be a mapping, got {type(obj).__name__}"]
    errs: list[str] = []
    if obj.get("apiVersion") != API_VERSION:
        errs.append(f"apiVersion: must be {API_VERSION}, got {obj.get('apiVersion')!r}")
    if obj.get("kind") != KIND:
        errs.append(f"kind: must be {KIND}, got {obj.get('kind')!r}")
    named = bool(str((obj.get("metadata") or {}).get("name") or ""))
    found = crdschema.Validator(_schema()).iter_errors(apply_defaults(obj))
    for error in sorted(found, key=lambda e: (e.validator == "x-kubernetes-validations", list(map(str, e.absolute_path)))):
        if named or error.validator != "x-kubernetes-validations":
            errs.append(_message(error))
    return list(dict.fromkeys(errs)) + ([] if named else ["metadata.name: required field is missing"])


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
