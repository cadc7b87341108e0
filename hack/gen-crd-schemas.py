#!/usr/bin/env python3
"""Embed the real core/v1 schemas (EnvVar, Volume, Toleration, ...) in the DDPJob CRD.

The pod-level fields of a DDPJob are copied verbatim into its pods, so the API server must
refuse there what it would refuse in a Pod: a misspelt toleration key, `resources: {limts:}`.
Hand-written copies drift; these schemas come from the Kubernetes OpenAPI v3 document of the
version the project builds (hack/versions.env):

  * by default from the running local API server (`kubectl get --raw /openapi/v3/api/v1`,
    KUBECONFIG=.cache/cluster/kubeconfig, kubectl from .cache/bin), which is the authority;
  * `--openapi FILE` reads a saved copy; `--openapi gomod` reads the one shipped in the
    k8s.io/kubernetes module of that version (api/openapi-spec/v3/api__v1_openapi.json), which
    has the same types but not the enum lists the API server publishes (`--check` against it
    reports those as differences).

The CRD file is parsed and dumped by a round-tripping YAML library with only these fields replaced:
comments, hand-written fields and spec.trainer come back as they were. `--check` exits 1
when the file is not what generation would write (a unit test runs it).

Structural-schema rules applied while inlining $refs: no $ref/allOf/oneOf, Quantity and
IntOrString become `x-kubernetes-int-or-string` (Quantity with the API's quantity pattern),
an embedded ObjectMeta (a template's) keeps only labels and annotations, defaults and list/map
merge markers are dropped (the API server defaults the pod itself; list-map keys would need
defaults the CRD cannot carry).
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml"
CORE = "io.k8s.api.core.v1."
META = "io.k8s.apimachinery.pkg.apis.meta.v1."
TEMPLATE_META = ("annotations", "labels")
# What the API server accepts as a resource.Quantity (the pattern controller-gen emits too).
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
DROP = {"default", "x-kubernetes-patch-strategy", "x-kubernetes-patch-merge-key", "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "x-kubernetes-unions",
        "x-kubernetes-group-version-kind"}

# CRD field (path of keys below spec) -> (core/v1 type, is a list of it).
FIELDS: dict[tuple[str, ...], tuple[str, bool]] = {
    ("env",): ("EnvVar", True),
    ("envFrom",): ("EnvFromSource", True),
    ("resources",): ("ResourceRequirements", False),
    ("volumes",): ("Volume", True),
    ("volumeMounts",): ("VolumeMount", True),
    ("securityContext",): ("SecurityContext", False),
    ("podSecurityContext",): ("PodSecurityContext", False),
    ("imagePullSecrets",): ("LocalObjectReference", True),
    ("scheduling", "tolerations"): ("Toleration", True),
    ("scheduling", "affinity"): ("Affinity", False),
    ("scheduling", "topologySpreadConstraints"): ("TopologySpreadConstraint", True),
    ("template",): ("PodTemplateSpec", False),
}
# Rules the API server applies to these fields in a Pod beyond its OpenAPI (Go validation), kept
# here so that the DDPJob is refused, not its pods. Same limits as Kubernetes 1.36's validation.
EXTRA: dict[tuple[str, ...], dict[str, Any]] = {
    # RelaxedEnvironmentVariableValidation (GA, locked on since 1.34): printable ASCII without '='.
    ("env",): {"items": {"properties": {"name": {"minLength": 1, "pattern": "^[ -<>-~]+$"}}}},
    ("volumes",): {"items": {"properties": {"name": {"minLength": 1}}}},
}
# What the operator sets on every pod itself (template.merge_template): a template that says
# otherwise is refused with the reason rather than silently overridden. (A port of the trainer
# container named master or metrics is left to the Pod's validation: a rule over each
# container's ports costs more than a CRD may spend.)
# The same patterns as api/ddpjob_api/labels.py (RESERVED_KEY_PATTERN, RESERVED_LABEL_PATTERN;
# tests/unit/test_pod_hardening.py holds them equal): a label key Prometheus would read as one of
# the operator's (ddpjob-dev/job-name, ddpjob_dev_job_name) is the operator's too.
_RESERVED = {"annotations": ("^([^/]*[.])?ddpjob[.]dev/", "ddpjob.dev/ keys (the operator's own annotations)"),
             "labels": ("^(([^/]*[.])?ddpjob[.]dev/|ddpjob[^a-zA-Z0-9]dev[^a-zA-Z0-9])",
                        "ddpjob.dev/ keys, nor keys that Prometheus reads as one of them (ddpjob-dev/..., "
                        "ddpjob_dev_...): the operator's own labels")}
TEMPLATE_RULES: dict[str, Any] = {"properties": {
    "metadata": {"properties": {
        key: {"x-kubernetes-validations": [{
            "rule": f"self.all(k, !k.matches('{pattern}'))",
            "message": f"spec.template.metadata.{key} must not use {what}"}]}
        for key, (pattern, what) in _RESERVED.items()}},
    "spec": {"x-kubernetes-validations": [
        {"rule": "!has(self.restartPolicy) || self.restartPolicy in ['Never', '']",
         "message": "spec.template.spec.restartPolicy must be Never: the operator restarts the whole group "
                    "(a pod restarting on its own would rejoin a rendezvous the other ranks have left)",
         "fieldPath": ".restartPolicy"},
        *({"rule": f"!has(self.{key})",
           "message": f"spec.template.spec.{key} must not be set: the operator names every pod <job>-<rank> "
                      f"in the subdomain <job>, its stable DNS name",
           "fieldPath": f".{key}"} for key in ("hostname", "subdomain")),
        {"rule": "!has(self.containers) || self.containers.all(c, c.name != 'trainer' || "
                 "(!has(c.image) && !has(c.command) && !has(c.args) && !has(c.terminationMessagePolicy)))",
         "message": "spec.template.spec.containers: the trainer container's image, command, args and "
                    "terminationMessagePolicy are the operator's (spec.image, spec.command, spec.args; the "
                    "launcher's termination message)",
         "fieldPath": ".containers"},
    ]}}}
EXTRA[("template",)] = TEMPLATE_RULES
# Required in Kubernetes' type, optional in a DDPJob: the operator supplies it (its training
# container comes first in a template that names no `trainer` container, or has no containers).
OPTIONAL: dict[tuple[str, ...], dict[tuple[str, ...], list[str]]] = {
    ("template",): {("spec",): ["containers"]},
}


class GenError(RuntimeError):
    """The OpenAPI document or the CRD file is not what the generator expects."""


# -- OpenAPI -> structural schema --------------------------------------------------------------
def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _special(name: str, description: str | None) -> dict[str, Any] | None:
    """Types that are not plain objects in a structural schema."""
    out: dict[str, Any] | None = None
    if name == "io.k8s.apimachinery.pkg.api.resource.Quantity":
        out = {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN,
               "x-kubernetes-int-or-string": True}
    elif name == "io.k8s.apimachinery.pkg.util.intstr.IntOrString":
        out = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
    elif name in (META + "Time", META + "MicroTime"):
        out = {"type": "string", "format": "date-time"}
    if out is not None and description:
        out = {"description": description, **out}
    return None if out is None else _canonical(out)


def structural(node: dict[str, Any], schemas: dict[str, Any], *, stack: tuple[str, ...] = (),
               field: bool = True) -> dict[str, Any]:
    """`node` with every $ref inlined and the structural-schema rules applied.

    `field` is False for array items and map values: they get no description (kubectl explain
    shows the field's own), which keeps the CRD small."""
    desc = node.get("description")
    ref = node.get("$ref")
    if ref is None and isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
        ref = node["allOf"][0].get("$ref")
    if ref is not None:
        name = _ref_name(ref)
        if name in stack:
            raise GenError(f"recursive type {name} (via {' -> '.join(stack)})")
        target = schemas.get(name)
        if target is None:
            raise GenError(f"OpenAPI document has no schema {name}")
        special = _special(name, (desc or target.get("description")) if field else None)
        if special is not None:
            return special
        if name == META + "ObjectMeta":
            # A template's metadata: Kubernetes accepts only labels and annotations in one
            # (ValidateTemplateObjectMeta), and a misspelt key must be refused, not kept.
            target = {**target, "properties": {k: v for k, v in target["properties"].items() if k in TEMPLATE_META}}
        merged = {**target, **{k: v for k, v in node.items() if k not in ("$ref", "allOf")}}
        if desc:
            merged["description"] = desc
        return structural(merged, schemas, stack=stack + (name,), field=field)
    if node.get("format") == "int-or-string" or "oneOf" in node:
        return _special("io.k8s.apimachinery.pkg.util.intstr.IntOrString", desc if field else None)

    out: dict[str, Any] = {}
    required = set(node.get("required") or ())
    if field and desc:
        out["description"] = desc
    for key, value in node.items():
        if key in DROP or key == "description":
            continue
        if key == "properties":
            out["properties"] = {k: _optional_enum(structural(v, schemas, stack=stack), k not in required)
                                 for k, v in sorted(value.items())}
        elif key == "items":
            out["items"] = structural(value, schemas, stack=stack, field=False)
        elif key == "additionalProperties" and isinstance(value, dict):
            out["additionalProperties"] = structural(value, schemas, stack=stack, field=False)
        elif key in ("$ref", "allOf", "oneOf", "anyOf"):
            raise GenError(f"unexpected {key} left in {stack}")
        else:
            out[key] = copy.deepcopy(value)
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "type" not in out and "x-kubernetes-int-or-string" not in out:
        raise GenError(f"schema without a type in {stack}: {sorted(node)}")
    return _canonical(out)


def _optional_enum(node: dict[str, Any], optional: bool) -> dict[str, Any]:
    """An optional enum field also takes "": Pod validation reads it as unset (a toleration's
    effect "" matches every effect), and the CRD must not refuse what a Pod accepts."""
    if optional and "enum" in node and "" not in node["enum"]:
        node = {**node, "enum": [*node["enum"], ""]}
    return node


def _canonical(node: dict[str, Any]) -> dict[str, Any]:
    """Description and type first, the rest sorted: the output does not depend on the key order
    of the document (the API server and the module's copy list keys differently)."""
    first = [k for k in ("description", "type") if k in node]
    return {k: node[k] for k in first + sorted(k for k in node if k not in first)}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


_TAG = re.compile(r" ?\[core/v1 [A-Za-z]+( list)?\]$")


def field_schema(path: tuple[str, ...], schemas: dict[str, Any], description: str | None) -> dict[str, Any]:
    """The CRD schema of one pod-level field: our description, Kubernetes' type."""
    type_name, is_list = FIELDS[path]
    ref = {"$ref": f"#/components/schemas/{CORE}{type_name}"}
    if is_list:
        out = {"type": "array", "items": structural(ref, schemas, field=False)}
    else:
        out = structural(ref, schemas)
        out.pop("description", None)
    out = _merge(out, EXTRA.get(path, {}))
    for where, keys in OPTIONAL.get(path, {}).items():
        node = out
        for key in where:
            node = node["properties"][key]
        node["required"] = [k for k in node.get("required", []) if k not in keys]
        if not node["required"]:
            del node["required"]
    tag = f"[core/v1 {type_name}{' list' if is_list else ''}]"
    own = _TAG.sub("", description or "").rstrip()
    return {"description": f"{own} {tag}" if own else f"Kubernetes {tag}", **out}


# -- the CRD file: parsed, the generated fields replaced, dumped -----------------------------------
def _yaml() -> YAML:
    """A round-tripping YAML: comments, flow mappings, folded text and the quotes of the hand-written
    parts come back as they were read."""
    rt = YAML()
    rt.preserve_quotes = True
    rt.width = 100000  # a generated description stays on one line
    rt.indent(mapping=2, sequence=4, offset=2)
    # Multi-line text (Kubernetes' descriptions) as one double-quoted line with \n escapes.
    rt.representer.add_representer(str, lambda r, s: r.represent_scalar(
        "tag:yaml.org,2002:str", s, style='"' if "\n" in s else None))
    return rt


def _props(doc: Any, path: tuple[str, ...]) -> Any:
    """The properties of spec that hold the FIELDS entry at `path` ({} when there are none)."""
    parent = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for key in path[:-1]:
        parent = (parent.get("properties") or {}).get(key) or {}
    return parent.get("properties") or {}


def same_outside_generated(before: str, after: str) -> None:
    """Raise unless the two CRD texts mean the same but for the generated fields (a dump that
    changed a hand-written value, a quoted "yes" read back as a boolean, would pass no other check)."""
    docs = [YAML(typ="safe").load(text) for text in (before, after)]
    for doc in docs:
        for path in FIELDS:
            _props(doc, path).pop(path[-1], None)
    if docs[0] != docs[1]:
        raise GenError("generation changed fields outside the generated ones")


def generate(text: str, schemas: dict[str, Any]) -> str:
    """The CRD text with every FIELDS entry replaced by its generated schema; nothing else changes."""
    rt = _yaml()
    doc = rt.load(text)
    for path in FIELDS:
        props = _props(doc, path)
        if path[-1] not in props:
            raise GenError(f"CRD has no field spec.{'.'.join(path)}")
        props[path[-1]] = field_schema(path, schemas, props[path[-1]].get("description"))
    out = io.StringIO()
    rt.dump(doc, out)
    same_outside_generated(text, out.getvalue())
    return out.getvalue()


# -- inputs -------------------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    out = {}
    for line in (ROOT / "hack/versions.env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def load_openapi(source: str | None) -> dict[str, Any]:
    """The core/v1 OpenAPI v3 document from the API server, a file, or the Go module cache."""
    if source == "gomod":
        gomodcache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        path = Path(gomodcache) / f"k8s.io/kubernetes@{_versions()['KUBE_VERSION']}" \
            / "api/openapi-spec/v3/api__v1_openapi.json"
        return json.loads(path.read_text())
    if source:
        return json.loads(Path(source).read_text())
    kubectl = ROOT / ".cache/bin/kubectl"
    env = {**os.environ, "KUBECONFIG": os.environ.get("KUBECONFIG") or str(ROOT / ".cache/cluster/kubeconfig")}
    proc = subprocess.run([str(kubectl) if kubectl.exists() else "kubectl", "get", "--raw", "/openapi/v3/api/v1"],
                          capture_output=True, text=True, env=env, timeout=60)
    if proc.returncode != 0:
        raise GenError("could not read /openapi/v3/api/v1 from the API server (run `make cluster-up`, or pass "
                       f"--openapi gomod|FILE): {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--openapi", help="core/v1 OpenAPI v3 JSON file, or 'gomod' (default: the API server)")
    ap.add_argument("--crd", default=str(CRD), help="the CRD file to update in place")
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is not up to date")
    args = ap.parse_args(argv)
    schemas = load_openapi(args.openapi)["components"]["schemas"]
    crd = Path(args.crd)
    text = crd.read_text()
    new = generate(text, schemas)
    if args.check:
        if new != text:
            print(f"{crd}: generated schemas are out of date; run hack/gen-crd-schemas.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        tmp = crd.with_suffix(".yaml.tmp")
        tmp.write_text(new)
        tmp.replace(crd)
    print(f"{crd}: {len(new)} bytes ({len(FIELDS)} core/v1 fields)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
