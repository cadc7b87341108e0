"""The DDPJob as its readers see it: the typed spec with the CRD's defaults (specgen.py, generated
from the CRD: the one place a default is written), the job's identity, and what derives from both."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ddpjob_api.specgen import DDPJobSpec, Scheduling

GROUP = "ddpjob.dev"
VERSION = "v1alpha1"
KIND = "DDPJob"
PLURAL = "ddpjobs"
API_VERSION = f"{GROUP}/{VERSION}"


@dataclass(frozen=True)
class JobSpec:
    """A DDPJob: `spec` typed and defaulted; `raw` the object as given (metadata, status)."""

    name: str
    namespace: str
    uid: str
    spec: DDPJobSpec
    raw: dict[str, Any] = field(repr=False, compare=False)

    # -- the spec's fields under the names the operator has always used ------------------------

    @property
    def nproc_per_node(self) -> int:
        """Processes per node, `auto` resolved (resolve_nproc)."""
        return resolve_nproc(self.spec.nproc_per_node, self.spec.gpus_per_node)

    @property
    def command(self) -> list[str] | None:
        """The user's command (None, also when empty: the built-in trainer runs)."""
        return self.spec.command or None

    @property
    def args(self) -> list[str] | None:
        return self.spec.args or None

    @property
    def trainer(self) -> dict[str, Any]:
        """spec.trainer as given: the trainer reads and defaults it (ddpjob_trainer.config)."""
        return self.spec.trainer or {}

    @property
    def env(self) -> list[dict[str, Any]]:
        return self.spec.env or []

    @property
    def nccl(self) -> dict[str, Any]:
        return self.spec.nccl or {}

    @property
    def scheduling(self) -> Scheduling:
        """spec.scheduling (every field unset when absent)."""
        return self.spec.scheduling or Scheduling()

    # -- derived ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Total processes: nodes x processes per node."""
        return self.spec.nodes * self.nproc_per_node

    @property
    def min_nodes(self) -> int:
        """Fewest nodes the rendezvous accepts: spec.elastic.minNodes, else spec.nodes."""
        minimum = self.spec.elastic.min_nodes if self.spec.elastic else None
        return self.spec.nodes if minimum is None else minimum

    @property
    def max_nodes(self) -> int:
        """Most nodes that may join the rendezvous: spec.elastic.maxNodes, else spec.nodes."""
        maximum = self.spec.elastic.max_nodes if self.spec.elastic else None
        return self.spec.nodes if maximum is None else maximum

    @property
    def uses_builtin_trainer(self) -> bool:
        """True when the job runs our trainer rather than the user's command."""
        return not self.command

    @property
    def one_pod_per_node(self) -> bool:
        """spec.scheduling.onePodPerNode: at most one of the job's pods per node unless false.
        The CRD gives it no `default:` (it would need spec.scheduling to default to {} too), so
        unset means true here."""
        return self.scheduling.one_pod_per_node is not False

    @property
    def keep_failed_attempts(self) -> int:
        """How many failed attempts back the terminated pods stay after a group restart (0: none)."""
        return max(0, self.spec.failure_policy.keep_failed_attempts)

    @property
    def generation(self) -> int:
        """metadata.generation (0 when unknown)."""
        return int((self.raw.get("metadata") or {}).get("generation") or 0)


def resolve_nproc(nproc: Any, gpus_per_node: int) -> int:
    """`auto` means one process per GPU, or one on a CPU node."""
    if nproc in (None, "auto"):
        return gpus_per_node if gpus_per_node > 0 else 1
    return int(nproc)


def spec_of(obj: dict[str, Any]) -> DDPJobSpec:
    """A DDPJob object's spec, typed, with the CRD's defaults (no copy: for a reader that keeps none
    of it, such as a scrape)."""
    return DDPJobSpec.from_dict(obj.get("spec") or {})


def from_manifest(obj: dict[str, Any]) -> JobSpec:
    """Build a JobSpec from a DDPJob object (as applied or as read from the API)."""
    obj = copy.deepcopy(obj)
    meta = obj.get("metadata") or {}
    return JobSpec(name=meta.get("name", ""), namespace=meta.get("namespace") or "default", uid=meta.get("uid", ""),
                   spec=spec_of(obj), raw=obj)
