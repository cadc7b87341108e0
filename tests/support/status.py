"""Reading a DDPJob's status in tests."""
from __future__ import annotations

from typing import Any


def condition(status: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The status' condition of type `kind`, whatever its status (None when absent)."""
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == kind), None)
