"""How a generated spec class (specgen.py) reads itself from a DDPJob as written: one generic
`from_dict`, so that the generated classes hold only their fields and the CRD's defaults."""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T", bound="SpecObject")


def camel(name: str) -> str:
    """The CRD's name of a field (hack/gen-spec.py checks that each round-trips)."""
    return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), name)


_PLANS: dict[type, list[tuple[str, str, bool, Any]]] = {}


def _plan(cls: type) -> list[tuple[str, str, bool, Any]]:
    """(attribute, CRD key, required, nested spec class or None) per field, resolved once per class."""
    if cls in _PLANS:
        return _PLANS[cls]
    hints = typing.get_type_hints(cls)
    plan = []
    for f in dataclasses.fields(cls):
        kinds = typing.get_args(hints[f.name]) if isinstance(hints[f.name], types.UnionType) else (hints[f.name],)
        nested = next((k for k in kinds if isinstance(k, type) and issubclass(k, SpecObject)), None)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        plan.append((f.name, camel(f.name), required, nested))
    _PLANS[cls] = plan
    return plan


class SpecObject:
    """Base of the generated spec classes."""

    __slots__ = ()

    @classmethod
    def from_dict(cls: type[T], raw: Mapping[str, Any]) -> T:
        """The object as written, with the CRD's defaults where a field is absent or null (the API
        server prunes a null before it defaults); a required field that is absent is a KeyError."""
        values = {}
        for name, key, required, nested in _plan(cls):
            value = raw.get(key)
            if value is None:
                if required:
                    values[name] = raw[key]
                continue
            values[name] = nested.from_dict(value) if nested else value
        return cls(**values)
