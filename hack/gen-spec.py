#!/usr/bin/env python3
"""Generate api/ddpjob_api/specgen.py, the DDPJob spec as typed dataclasses, from the CRD's schema.

The CRD is where a field's type and default are written (charts/ddpjob-operator/crds/); every
reader of a DDPJob goes through these classes, so a default is applied once, as the API server
would, and never copied by hand. One frozen dataclass per object of ours below spec; a field takes
the CRD's `default:`, is Optional (None) where the CRD has none, and is required where the CRD
requires it. `from_dict` (ddpjob_api.specobject, one for all classes) applies the defaults to a spec
as written (absent or null: the default).

Objects the CRD holds in Kubernetes' own core/v1 schemas (hack/gen-crd-schemas.py FIELDS: the pod
template, resources, volumes, tolerations...) pass through to the pods as they are, and objects with
no fixed fields (maps, x-kubernetes-preserve-unknown-fields) are open: both stay `dict[str, Any]`.
So does spec.trainer, which the trainer reads and defaults itself (ddpjob_trainer.config).

`make spec` writes the file; `--check` exits 1 when it is stale (tests/unit/test_generated_spec.py
compares it in memory).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from ddpjob_api.specobject import camel

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml"
OUT = ROOT / "api/ddpjob_api/specgen.py"
ROOT_CLASS = "DDPJobSpec"
# The trainer's own config: it parses, defaults and validates it (the CRD gives it no defaults);
# the operator passes it on as given.
OPEN = {("trainer",)}


def _core_fields() -> set[tuple[str, ...]]:
    """The spec fields whose schema is Kubernetes' own (hack/gen-crd-schemas.py FIELDS)."""
    spec = importlib.util.spec_from_file_location("gen_crd_schemas", ROOT / "hack/gen-crd-schemas.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return set(module.FIELDS)


def literal(value: Any) -> str:
    """Python source for a default from the CRD, strings in the house's double quotes."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    return repr(value)


def snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def pascal(name: str) -> str:
    return name[:1].upper() + name[1:]


def _summary(description: str | None) -> str:
    """The description's first sentence, on one line."""
    text = " ".join((description or "").split())
    return re.split(r"(?<=[.:;])\s", text, maxsplit=1)[0].rstrip(".:;") if text else ""


@dataclass
class Field:
    key: str                 # the CRD's name
    type: str                # the annotation
    default: Any             # the CRD's default, or NO_DEFAULT
    required: bool
    nested: str | None       # the generated class of an object field


@dataclass
class Class:
    name: str
    path: str
    doc: str
    fields: list[Field]


NO_DEFAULT = object()


class Generator:
    def __init__(self, schema: dict[str, Any], core: set[tuple[str, ...]]) -> None:
        self.core = core | OPEN
        self.classes: list[Class] = []
        self.names: set[str] = set()
        self.root = self.object_class(ROOT_CLASS, (), schema)

    def _open(self, path: tuple[str, ...], node: dict[str, Any]) -> bool:
        return (path in self.core or not node.get("properties")
                or bool(node.get("x-kubernetes-preserve-unknown-fields")))

    def annotation(self, path: tuple[str, ...], node: dict[str, Any], parent: str) -> tuple[str, str | None]:
        """(type annotation, generated class or None) of the field at `path`."""
        if node.get("x-kubernetes-int-or-string"):
            return "int | str", None
        kind = node.get("type")
        if kind == "object":
            if self._open(path, node):
                extra = node.get("additionalProperties")
                value = self.annotation(path + ("*",), extra, parent)[0] if isinstance(extra, dict) else "Any"
                return f"dict[str, {value}]", None
            name = pascal(path[-1])
            if name in self.names:
                name = parent + name
            cls = self.object_class(name, path, node)
            return cls, cls
        if kind == "array":
            item = node.get("items") or {}
            if path in self.core or item.get("type") == "object":
                return "list[dict[str, Any]]", None
            return f"list[{self.annotation(path + ('[]',), item, parent)[0]}]", None
        return {"string": "str", "integer": "int", "number": "float", "boolean": "bool"}[kind], None

    def object_class(self, name: str, path: tuple[str, ...], node: dict[str, Any]) -> str:
        self.names.add(name)
        required = set(node.get("required") or [])
        fields = []
        for key, sub in node["properties"].items():
            # from_dict finds a field's key by camel-casing its name.
            assert camel(snake(key)) == key, f"{key}: snake_case does not round-trip; name it in specobject"
            annotation, nested = self.annotation(path + (key,), sub, name)
            fields.append(Field(key, annotation, sub.get("default", NO_DEFAULT), key in required, nested))
        where = ".".join(("spec",) + path)
        self.classes.append(Class(name, where, _summary(node.get("description")), fields))
        return name

    # -- emitting ---------------------------------------------------------------------------
    @staticmethod
    def _declaration(f: Field) -> str:
        if f.default is NO_DEFAULT:
            return f"{snake(f.key)}: {f.type}" if f.required else f"{snake(f.key)}: {f.type} | None = None"
        if f.nested:
            return f"{snake(f.key)}: {f.type} = field(default_factory=lambda: {f.nested}.from_dict({literal(f.default)}))"
        if isinstance(f.default, (dict, list)):
            return f"{snake(f.key)}: {f.type} = field(default_factory=lambda: {literal(f.default)})"
        return f"{snake(f.key)}: {f.type} = {literal(f.default)}"

    def emit_class(self, cls: Class) -> str:
        doc = f"{cls.path}: {cls.doc}." if cls.doc else f"{cls.path}."
        lines = ["@dataclass(frozen=True, slots=True, kw_only=True)", f"class {cls.name}(SpecObject):",
                 f'    """{doc}"""', ""]
        return "\n".join(lines + [f"    {self._declaration(f)}" for f in cls.fields])

    def source(self) -> str:
        head = f'''\
# Generated by hack/gen-spec.py from {CRD.relative_to(ROOT)}: do not edit (`make spec`).
"""The DDPJob spec as typed dataclasses, with the CRD's defaults: generated from its schema."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddpjob_api.specobject import SpecObject
'''
        # The classes a class refers to come before it (innermost first), as they were found.
        return head + "".join(f"\n\n{self.emit_class(c)}\n" for c in self.classes)


def spec_schema(text: str) -> dict[str, Any]:
    crd = yaml.load(text, Loader=yaml.CSafeLoader)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def generate(text: str | None = None) -> str:
    """The generated module for the CRD text (the checked-in CRD by default)."""
    return Generator(spec_schema(CRD.read_text() if text is None else text), _core_fields()).source()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is not up to date")
    args = ap.parse_args(argv)
    source = generate()
    if args.check:
        if not OUT.exists() or OUT.read_text() != source:
            print(f"{OUT.relative_to(ROOT)} is stale: run `make spec` (hack/gen-spec.py)", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
