"""`ddpjob render FILE`: the Services and Pods the operator would create, as YAML."""
from __future__ import annotations

from typing import Any

import click
import yaml

from ddpjob_api.spec import from_manifest
from ddpjob_api.validation import InvalidDDPJob, apply_defaults, check_manifest
from ddpjob_operator.builders import gang
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.builders.lighthouse import render_lighthouse_pod, render_lighthouse_service
from ddpjob_operator.builders.pods import render_pod
from ddpjob_operator.builders.service import render_service


def render_objects(obj: dict[str, Any], *, namespace: str | None = None,
                   config: OperatorConfig | None = None) -> list[dict[str, Any]]:
    """Validated DDPJob dict -> [Service, PodGroup (gang scheduling only), Pod 0, ..., Pod n-1], after
    the Lighthouse's Service and Pod for a per-step job (spec.faultTolerance), made first as the
    operator makes them."""
    check_manifest(obj)
    obj = apply_defaults(obj)
    if namespace and not (obj.get("metadata") or {}).get("namespace"):
        obj["metadata"]["namespace"] = namespace
    job = from_manifest(obj)
    pods = [render_pod(job, r, attempt=0, config=config) for r in range(job.spec.nodes)]
    podgroup = gang.render_podgroup(job, pods[0])
    lighthouse = ([render_lighthouse_service(job), render_lighthouse_pod(job)] if job.spec.fault_tolerance is not None
                  else [])
    return lighthouse + [render_service(job)] + ([podgroup] if podgroup else []) + pods


def render_file(path: str, namespace: str | None = None) -> str:
    """Every DDPJob in the YAML file at `path`, rendered as a multi-document YAML string."""
    with open(path, encoding="utf-8") as fh:
        docs = [d for d in yaml.safe_load_all(fh) if d]
    out: list[dict[str, Any]] = []
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "DDPJob":
            try:
                out.extend(render_objects(doc, namespace=namespace))
            except InvalidDDPJob as exc:
                # click prints ClickException as "Error: ..." with exit code 1, no traceback.
                raise click.ClickException(f"{path}: {exc}") from exc
    if not out:
        raise click.ClickException(f"{path}: no DDPJob documents found")
    return yaml.safe_dump_all(out, sort_keys=False)
