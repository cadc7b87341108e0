"""A create the API server refused, as the children module found it (app/children.py decides what
is a refusal, at the create) and the status renders it (decisions/status.create_refused)."""
from __future__ import annotations

from dataclasses import dataclass

# API status codes of a create the API server refused for good: the pod spec itself is invalid
# (schema, admission). Anything else in 4xx (quota, PodSecurity, a namespace being deleted) may
# clear without a spec change: the job waits and the operator retries.
PERMANENT_REFUSALS = frozenset({400, 422})
# A pod name already taken by an object this job does not own: retried, as its owner may delete it.
NAME_CONFLICT = "NameConflict"


@dataclass(frozen=True)
class CreateRefusal:
    """One pod create the API server answered with a 4xx (other than 409 AlreadyExists / 429)."""

    pod: str           # the object's name (a pod's, or the job's Service's when kind is "service")
    code: int
    reason: str        # the API Status reason: Invalid, Forbidden, BadRequest, ...
    message: str       # the API's own message (names the field)
    kind: str = "pod"

    @property
    def permanent(self) -> bool:
        """True when only a different spec could be created."""
        return self.code in PERMANENT_REFUSALS
