"""`spec.trainer`'s schema is the DDPJob CRD's own, checked here as the API server checks it.

The CRD (charts/ddpjob-operator/crds/, packaged beside this module through the `crds` link) is the
one home of the trainer's keys, types, bounds, enums and CEL rules; a key or rule added there is
enforced here with no Python change. jsonschema checks the OpenAPI part, cel-python the
x-kubernetes-validations. The trainer runs without the operator (a pod, `docker run`), so it reads
the file itself rather than through ddpjob_operator.api.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRD_FILE = Path(__file__).parent / "crds" / "ddpjobs.ddpjob.dev.yaml"
# libyaml: the CRD embeds Kubernetes' pod schema, ten times faster to read than with PyYAML's parser.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=2)
def _trainer_schema(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        crd = yaml.load(fh, Loader=_LOADER)  # a safe loader, C or Python
    (version,) = (v for v in crd["spec"]["versions"] if v.get("storage"))
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["trainer"]


def trainer_schema() -> dict[str, Any]:
    """The CRD's `spec.trainer` schema (cached; do not mutate)."""
    return _trainer_schema(str(CRD_FILE))


@functools.cache
def _program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel(validator: Any, rules: list[dict[str, str]], instance: Any, schema: dict) -> Any:
    import celpy

    for check in rules:
        if "oldSelf" in check["rule"]:
            continue  # a transition rule compares with the stored object, which only the API server has
        try:
            result = _program(check["rule"]).evaluate({"self": celpy.json_to_cel(instance)})
        except celpy.CELEvalError as exc:
            result = exc
        if isinstance(result, celpy.CELEvalError) or not result:
            yield jsonschema.ValidationError(check.get("message") or f"failed rule: {check['rule']}")


def _int_or_string(validator: Any, on: bool, instance: Any, schema: dict) -> Any:
    if on and not (validator.is_type(instance, "integer") or validator.is_type(instance, "string")):
        yield jsonschema.ValidationError(f"{instance!r} is not an integer or a string")


def _properties(validator: Any, properties: dict, instance: Any, schema: dict) -> Any:
    """Draft 4's, and unknown keys refused (the API server's strict field validation)."""
    yield from jsonschema.Draft4Validator.VALIDATORS["properties"](validator, properties, instance, schema)
    if validator.is_type(instance, "object") and not schema.get("x-kubernetes-preserve-unknown-fields"):
        for key in instance:
            if key not in properties:
                yield jsonschema.ValidationError(f"unknown key (known: {', '.join(sorted(properties))})", path=[key])


_Validator = jsonschema.validators.extend(jsonschema.Draft4Validator, {
    "properties": _properties, "x-kubernetes-validations": _cel, "x-kubernetes-int-or-string": _int_or_string})


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
    for error in sorted(_Validator(schema).iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path]):
        path = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        out.append(error.message if error.message.startswith(path + " ") else f"{path}: {error.message}")
    return out
