"""hack/gen-crd-schemas.py: core/v1 OpenAPI -> structural CRD schemas, put in the parsed CRD, which is dumped back."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ddpjob_api import crdschema as crd
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
gen = load_script("gen_crd_schemas", "hack/gen-crd-schemas.py")

Q = "io.k8s.apimachinery.pkg.api.resource.Quantity"
SCHEMAS = {
    Q: {"type": "string", "description": "a quantity"},
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {"format": "int-or-string",
                                                         "oneOf": [{"type": "integer"}, {"type": "string"}]},
    "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta": {"type": "object", "properties": {
        "name": {"type": "string"}, "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
    "io.k8s.api.core.v1.Inner": {"type": "object", "description": "Inner type.",
                                 "properties": {"size": {"$ref": f"#/components/schemas/{Q}"},
                                                "port": {"allOf": [{"$ref": "#/components/schemas/"
                                                                    "io.k8s.apimachinery.pkg.util.intstr.IntOrString"}]},
                                                "meta": {"$ref": "#/components/schemas/"
                                                                 "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}}},
    "io.k8s.api.core.v1.Outer": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "default": "", "description": "Name."},
        "inner": {"allOf": [{"$ref": "#/components/schemas/io.k8s.api.core.v1.Inner"}], "default": {},
                  "description": "The inner one."},
        "list": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                 "items": {"allOf": [{"$ref": "#/components/schemas/io.k8s.api.core.v1.Inner"}], "default": {}}},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "default": ""}},
        "opaque": {"type": "object", "description": "Anything."},
        "effect": {"type": "string", "enum": ["NoSchedule", "NoExecute"]}}},
    "io.k8s.api.core.v1.Strict": {"type": "object", "required": ["mode"], "properties": {
        "mode": {"type": "string", "enum": ["A", "B"]}}},
    "io.k8s.api.core.v1.Loop": {"type": "object", "properties": {
        "self": {"$ref": "#/components/schemas/io.k8s.api.core.v1.Loop"}}},
}


def ref(name):
    return {"$ref": f"#/components/schemas/io.k8s.api.core.v1.{name}"}


def test_refs_inlined_with_structural_rules():
    out = gen.structural(ref("Outer"), SCHEMAS)
    props = out["properties"]
    assert out["required"] == ["name"] and "default" not in props["name"]
    assert props["inner"]["description"] == "The inner one."        # the field's own text wins
    assert "default" not in props["inner"]
    size = props["inner"]["properties"]["size"]
    assert size["x-kubernetes-int-or-string"] is True and size["pattern"] == gen.QUANTITY_PATTERN
    assert props["inner"]["properties"]["port"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    # A template's metadata: labels and annotations only, as Kubernetes takes in one.
    assert set(props["inner"]["properties"]["meta"]["properties"]) == {"labels"}
    assert "x-kubernetes-list-type" not in props["list"] and "description" not in props["list"]["items"]
    assert props["labels"]["additionalProperties"] == {"type": "string"}
    assert props["opaque"]["x-kubernetes-preserve-unknown-fields"] is True
    assert "$ref" not in str(out) and "allOf" not in str(out) and "oneOf" not in str(out)
    # An optional enum also takes "" (Pod validation reads it as unset); a required one does not.
    assert props["effect"]["enum"] == ["NoSchedule", "NoExecute", ""]
    assert gen.structural(ref("Strict"), SCHEMAS)["properties"]["mode"]["enum"] == ["A", "B"]


def test_recursive_and_missing_types_are_errors():
    with pytest.raises(gen.GenError, match="recursive type io.k8s.api.core.v1.Loop"):
        gen.structural(ref("Loop"), SCHEMAS)
    with pytest.raises(gen.GenError, match="no schema io.k8s.api.core.v1.Nope"):
        gen.structural(ref("Nope"), SCHEMAS)


CRD_TEXT = """\
# a comment that must survive
spec:
  versions:
    - name: v1
      schema:
        openAPIV3Schema:
          properties:
            spec:
              properties:
                trainer:
                  description: >-
                    env: this folded text looks like a key
                  properties:
                    env: {type: string}
                env:
                  description: Extra env. [core/v1 EnvVar list]
                  type: array
                  items: {type: object, x-kubernetes-preserve-unknown-fields: true}
                scheduling:
                  properties:
                    tolerations:
                      type: array
                after: {type: string}
"""


def test_generation_replaces_only_the_generated_fields(monkeypatch):
    monkeypatch.setattr(gen, "FIELDS", {("env",): ("Outer", True), ("scheduling", "tolerations"): ("Inner", True)})
    monkeypatch.setattr(gen, "EXTRA", {("env",): {"items": {"properties": {"name": {"minLength": 1}}}}})
    out = gen.generate(CRD_TEXT, SCHEMAS)
    assert out.startswith("# a comment that must survive\n")
    doc = yaml.safe_load(out)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert doc["trainer"] == yaml.safe_load(CRD_TEXT)["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"]["spec"]["properties"]["trainer"]
    assert doc["env"]["description"] == "Extra env. [core/v1 Outer list]"
    assert doc["env"]["items"]["properties"]["name"] == {"description": "Name.", "type": "string", "minLength": 1}
    assert doc["scheduling"]["properties"]["tolerations"]["description"] == "Kubernetes [core/v1 Inner list]"
    assert doc["after"] == {"type": "string"}
    assert gen.generate(out, SCHEMAS) == out                      # idempotent


def test_a_change_outside_the_generated_fields_is_an_error(monkeypatch):
    monkeypatch.setattr(gen, "FIELDS", {("env",): ("Outer", True)})
    gen.same_outside_generated(CRD_TEXT, CRD_TEXT.replace("Extra env.", "Other env."))  # a generated field
    with pytest.raises(gen.GenError, match="outside the generated ones"):
        gen.same_outside_generated(CRD_TEXT, CRD_TEXT.replace("after: {type: string}", "after: {type: integer}"))


def test_missing_field_is_an_error(monkeypatch):
    monkeypatch.setattr(gen, "FIELDS", {("volumes",): ("Inner", True)})
    with pytest.raises(gen.GenError, match="CRD has no field .*volumes"):
        gen.generate(CRD_TEXT, SCHEMAS)


# -- the CRD as generated ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_props():
    return crd.version_schema()["properties"]["spec"]["properties"]


@pytest.mark.parametrize("path", sorted(gen.FIELDS))
def test_pod_level_fields_are_fully_typed(spec_props, path):
    node = spec_props[path[0]]
    for key in path[1:]:
        node = node["properties"][key]
    type_name, is_list = gen.FIELDS[path]
    assert node["description"].endswith(f"[core/v1 {type_name}{' list' if is_list else ''}]")
    body = node["items"] if is_list else node
    assert body.get("properties") and not body.get("x-kubernetes-preserve-unknown-fields")


def test_quantities_accept_numbers_and_strings_only_in_kubernetes_syntax(spec_props):
    import re

    q = spec_props["resources"]["properties"]["limits"]["additionalProperties"]
    assert q["x-kubernetes-int-or-string"] is True
    assert all(re.match(q["pattern"], v) for v in ("8Gi", "500m", "1.5", "2", "1e3"))
    assert not any(re.match(q["pattern"], v) for v in ("8 GB", "lots", "1.2.3"))


def _fields(node, path=""):
    for key, sub in (node.get("properties") or {}).items():
        yield f"{path}.{key}", sub
        yield from _fields(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _fields(node["items"], path + "[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _fields(node["additionalProperties"], path + "{}")


def test_every_field_has_a_description():
    """`kubectl explain ddpjob.<field>` is the user's manual: no `<no description>` anywhere."""
    root = crd.version_schema()
    missing = [p for p, sub in _fields(root) if not sub.get("description") and p != ".metadata"]
    assert missing == []
    assert root["description"] and root["properties"]["status"]["description"]


def test_crd_size_and_how_it_is_applied():
    """spec.template embeds Kubernetes' whole pod schema: the CRD is past the 256 KiB annotation that
    client-side `kubectl apply` writes, so every install instruction applies it server-side. etcd
    refuses objects over 1.5 MiB (its default request limit): keep a margin."""
    import json
    import re

    size = len(json.dumps(crd.load_crd(), separators=(",", ":")))
    assert 256 * 1024 < size < 1024 * 1024, size
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "hack/gen-manifests.sh",
            ROOT / "manifests/operator.yaml"]
    applies = [(p.name, line) for p in docs for line in p.read_text().splitlines()
               if re.search(r"kubectl apply\b.*(manifests|crds)", line)]
    assert len(applies) >= 4, applies
    assert [a for a in applies if "--server-side" not in a[1]] == []


def test_the_template_keeps_no_unknown_field():
    """Structural pruning would drop a misspelt field of spec.template silently (and the pods would
    run without the user's initContainer): nothing below it keeps unknown fields, its metadata
    takes labels and annotations only, and containers are optional (the operator brings its own)."""
    template = crd.version_schema()["properties"]["spec"]["properties"]["template"]
    kept = [p for p, sub in _fields(template) if sub.get("x-kubernetes-preserve-unknown-fields")]
    assert kept == []
    assert set(template["properties"]["metadata"]["properties"]) == {"labels", "annotations"}
    pod = template["properties"]["spec"]
    assert "containers" not in pod.get("required", []) and "initContainers" in pod["properties"]
    assert pod["properties"]["containers"]["items"]["required"] == ["name"]
    fields = [r["message"].split(" must")[0].split(":")[0] for r in pod["x-kubernetes-validations"]]
    assert fields == ["spec.template.spec.restartPolicy", "spec.template.spec.hostname",
                      "spec.template.spec.subdomain", "spec.template.spec.containers"]
