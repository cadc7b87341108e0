"""Thin kopf handlers: every trigger just asks the Reconciler for a pass over one job."""
from __future__ import annotations

import asyncio
from typing import Any

import kopf

from . import labels as lbl
from .controller import Reconciler
from .spec import GROUP, PLURAL, VERSION


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler) -> None:
    """Attach the handlers to `registry` (watch-only handlers: no finalizers, no annotations)."""

    # A plain OperatorRegistry has no fallback login: use the kubernetes client's config
    # (in-cluster service account, else the current kubeconfig), like our own I/O does.
    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def start_resync(memo: kopf.Memo, **_: Any) -> None:
        memo.resync = asyncio.get_running_loop().create_task(reconciler.resync_loop())

    @kopf.on.cleanup(registry=registry)
    async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
        task = getattr(memo, "resync", None)
        if task is not None:
            task.cancel()
        await reconciler.shutdown()

    # Every DDPJob event, including the initial listing after a restart (= resume).
    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def job_event(type: str | None, name: str, namespace: str, uid: str, meta: kopf.Meta,
                        **_: Any) -> None:
        if type == "DELETED":
            reconciler.forget(namespace, name, uid)
            return
        reconciler.job_changed(namespace, name, uid, meta.get("resourceVersion"))

    # Any change to one of our pods (phase, deletion, eviction) re-evaluates its job.
    @kopf.on.event("", "v1", "pods", labels={lbl.JOB_NAME: kopf.PRESENT}, registry=registry)
    async def pod_event(labels: dict[str, str], namespace: str, **_: Any) -> None:
        job_name = labels.get(lbl.JOB_NAME)
        if job_name:
            reconciler.kick(namespace, job_name)
