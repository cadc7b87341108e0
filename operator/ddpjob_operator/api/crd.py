"""Locate and load the DDPJob CRD file (the one source of truth for the schema)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddpjob_trainer import crdschema

CRD_RELPATH = Path("charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml")
CRD_ENV = "DDPJOB_CRD_PATH"


class CRDNotFound(FileNotFoundError):
    """The CRD file is neither where DDPJOB_CRD_PATH says nor in the repository."""


def crd_path() -> Path:
    """$DDPJOB_CRD_PATH, else the chart's file found upwards from this package."""
    env = os.environ.get(CRD_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise CRDNotFound(f"{CRD_ENV}={env}: no such file")
        return path
    here = Path(__file__).resolve()
    candidates = [here.parent / "crds" / CRD_RELPATH.name]  # a copy packaged beside the code
    candidates += [parent / CRD_RELPATH for parent in here.parents]
    for cand in candidates:
        if cand.is_file():
            return cand
    raise CRDNotFound(f"DDPJob CRD not found (looked for {CRD_RELPATH} above {here.parent}); set {CRD_ENV}")


def load_crd(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The CRD document as a dict (cached; do not mutate)."""
    return crdschema.load_crd_file(str(path or crd_path()))


def version_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of the stored version (of this CRD file unless `crd` is given)."""
    return crdschema.version_schema(crd or load_crd())
