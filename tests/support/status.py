"""Reading a DDPJob's status in tests: from the object, and from the tables `kubectl get ddpj` and
`ddpjob list` print."""
from __future__ import annotations

import re
from typing import Any


def condition(status: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The status' condition of type `kind`, whatever its status (None when absent)."""
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == kind), None)


def table_row(header: str, row: str) -> dict[str, str]:
    """A `kubectl get` (or `ddpjob list`) row by column, cut at the header's offsets (values may
    contain spaces: PROGRESS "96% (265/276)"; an absent value is "")."""
    starts = [(m.start(), m.group()) for m in re.finditer(r"\S+", header)]
    bounds = [s for s, _ in starts[1:]] + [None]
    return {name: row[start:end].strip() for (start, name), end in zip(starts, bounds)}
