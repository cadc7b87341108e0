"""Kubernetes' own vocabulary, written once: an object's resourceVersion and owner, an API error's
Status body, and metav1.Time (RFC 3339 in UTC, whole seconds, a trailing Z) in both directions."""
from __future__ import annotations

import datetime as dt
import json
import sys
from typing import Any, overload

# Strings this long or shorter are shared between the cached objects that hold them (sys.intern):
# keys, label values, condition types and reasons, node names and timestamps repeat across
# thousands of pods and jobs, and every decoded watch event brings its own copies.
SHARED_LEN = 64


def owned_by(pod: dict[str, Any], uid: str) -> bool:
    """True when the pod's controller owner is the DDPJob with this uid."""
    return any(ref.get("uid") == uid for ref in (pod.get("metadata") or {}).get("ownerReferences") or [])


def _key(key: Any) -> Any:
    return sys.intern(key) if type(key) is str else key


def shared(value: Any) -> Any:
    """A decoded JSON value rebuilt with its dict keys and short strings interned (equal to it;
    `value` is left as it was): what the informer caches keep."""
    if type(value) is str:  # not a subclass (an enum's str value): sys.intern takes exact str only
        return sys.intern(value) if len(value) <= SHARED_LEN else value
    if isinstance(value, dict):
        return {_key(k): shared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shared(v) for v in value]
    return value


def resource_version(obj: dict[str, Any] | None) -> str:
    """metadata.resourceVersion, "" when there is none (an object not read from the API server)."""
    return str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")


def error_body(body: Any) -> dict[str, Any]:
    """An API error's body (JSON text, bytes or a dict) as a dict: the Status the API server sent,
    {"message": text} for a body that is no JSON (a proxy's page), {} for anything else."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return {"message": body}
    return body if isinstance(body, dict) else {}


@overload
def format_time(t: dt.datetime | float) -> str: ...
@overload
def format_time(t: None) -> None: ...
def format_time(t: dt.datetime | float | None) -> str | None:
    """A datetime (naive = UTC) or Unix seconds -> '2026-11-22T16:00:00Z', as Kubernetes writes times."""
    if t is None:
        return None
    if not isinstance(t, dt.datetime):
        t = dt.datetime.fromtimestamp(t, tz=dt.timezone.utc)
    elif t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> dt.datetime | None:
    """A metav1.Time (or any RFC 3339 string) -> an aware datetime; None for none or for text
    that is not a time (a field someone else wrote is data, not a reason to fail a pass)."""
    if not value:
        return None
    try:
        t = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def now() -> str:
    """The current time as Kubernetes writes it."""
    return format_time(dt.datetime.now(dt.timezone.utc))
