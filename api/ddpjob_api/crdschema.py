"""The DDPJob CRD's schema, checked here as the API server checks it: one evaluator for both sides.

The CRD (charts/ddpjob-operator/crds/, packaged beside this module through the `crds` link) is the
one home of the keys, types, bounds, enums and CEL rules; a key or rule added there is enforced here
with no Python change. jsonschema checks the OpenAPI part, extended with Kubernetes' own keywords,
cel-python the x-kubernetes-validations. The trainer validates `spec.trainer` with it and runs
without the operator (a pod, `docker run`), so the file is packaged with it; the operator validates a
whole DDPJob with it for `ddpjob run --local`/`render`/`submit` (ddpjob_api.validation).
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRD_FILE = Path(__file__).parent / "crds" / "ddpjobs.ddpjob.dev.yaml"
CRD_ENV = "DDPJOB_CRD_PATH"  # another copy of the CRD (the images set it; a test points it at an edited one)
# The CRD embeds Kubernetes' pod schema (spec.template): libyaml reads it ten times faster than
# PyYAML's own parser (0.1 s, not 1.2 s, before `ddpjob render` can say anything).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


@functools.lru_cache(maxsize=4)
def load_crd_file(path: str) -> dict[str, Any]:
    """The CRD document at `path` (cached; do not mutate)."""
    with open(path, encoding="utf-8") as fh:
        return yaml.load(fh, Loader=_LOADER)  # a safe loader, C or Python


def crd_path() -> Path:
    """$DDPJOB_CRD_PATH, else the CRD packaged beside this module."""
    env = os.environ.get(CRD_ENV)
    if env and not os.path.isfile(env):
        raise FileNotFoundError(f"{CRD_ENV}={env}: no such file")
    return Path(env) if env else CRD_FILE


def load_crd() -> dict[str, Any]:
    """The CRD document (cached; do not mutate)."""
    return load_crd_file(str(crd_path()))


def version_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of the CRD's stored version, the one the API server validates with."""
    (version,) = (v for v in (crd or load_crd())["spec"]["versions"] if v.get("storage"))
    return version["schema"]["openAPIV3Schema"]


def trainer_schema() -> dict[str, Any]:
    """The CRD's `spec.trainer` schema (cached; do not mutate)."""
    return version_schema()["properties"]["spec"]["properties"]["trainer"]


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


def _cel(validator: Any, rules: list[dict[str, str]], instance: Any, schema: dict) -> Any:
    """Each rule with `self` bound to the value; the error's validator_value is the rule broken and
    its cause the evaluation error, if the rule could not be evaluated."""
    import celpy

    if instance is None:
        return  # the API server drops a null before any rule sees it
    # Nor does it evaluate a rule on a value of the wrong type: the type error says it all.
    if not validator.evolve(schema={k: schema[k] for k in ("type", "x-kubernetes-int-or-string") if k in schema}).is_valid(instance):
        return
    for check in rules:
        if "oldSelf" in check["rule"]:
            continue  # a transition rule compares with the stored object, which only the API server has
        try:
            result = _program(check["rule"]).evaluate({"self": celpy.json_to_cel(instance)})
        except celpy.CELEvalError as exc:
            result = exc
        if isinstance(result, celpy.CELEvalError) or not result:
            yield jsonschema.ValidationError(check.get("message") or f"failed rule: {check['rule']}", validator_value=check,
                                             cause=result if isinstance(result, celpy.CELEvalError) else None)


def _int_or_string(validator: Any, on: bool, instance: Any, schema: dict) -> Any:
    if on and not (validator.is_type(instance, "integer") or validator.is_type(instance, "string")):
        yield jsonschema.ValidationError(f"must be an integer or a string, got {instance!r}")


def _any_of(validator: Any, schemas: list, instance: Any, schema: dict) -> Any:
    """Draft 4's, except the [integer, string] that an int-or-string node also spells out: said once."""
    if not schema.get("x-kubernetes-int-or-string"):
        yield from jsonschema.Draft4Validator.VALIDATORS["anyOf"](validator, schemas, instance, schema)


def _properties(validator: Any, properties: dict, instance: Any, schema: dict) -> Any:
    """Draft 4's, and unknown keys refused (the API server's strict field validation), one error
    each with its key as the path, except where the CRD keeps unknown fields on purpose."""
    yield from jsonschema.Draft4Validator.VALIDATORS["properties"](validator, properties, instance, schema)
    if validator.is_type(instance, "object") and not schema.get("x-kubernetes-preserve-unknown-fields"):
        for key in instance:
            if key not in properties:
                yield jsonschema.ValidationError(f"unknown key (known: {', '.join(sorted(properties))})", path=[key])


Validator = jsonschema.validators.extend(jsonschema.Draft4Validator, {
    "properties": _properties, "anyOf": _any_of, "x-kubernetes-validations": _cel,
    "x-kubernetes-int-or-string": _int_or_string})


def field(error: jsonschema.ValidationError, where: str = "") -> str:
    """The error's field below `where`, as the API server names it (spec.env[0].name)."""
    for p in error.absolute_path:
        where += f"[{p}]" if isinstance(p, int) else f".{p}" if where else str(p)
    return where


def pruned(value: Any) -> Any:
    """Without null values: the API server drops them from fields that are not nullable."""
    if isinstance(value, dict):
        return {k: pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [pruned(v) for v in value]
    return value


def problems(value: Any, where: str, schema: dict[str, Any]) -> list[str]:
    """What the schema refuses in `value`, each naming its key below `where`; [] when valid.
    A CEL rule's message that already names its field is shown as it is, as the API server does."""
    out = []
    for error in sorted(Validator(schema).iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path]):
        path = field(error, where)
        out.append(error.message if error.message.startswith(path + " ") else f"{path}: {error.message}")
    return out
