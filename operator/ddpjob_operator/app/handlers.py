"""Thin kopf handlers: DDPJob events feed the Reconciler's job cache and ask for a pass.

Pods are not watched through kopf: its label filters are applied client-side, after every pod
event of the namespace was decoded. Our own informer (cache.py) asks the API server for our pods
only, and keeps the cache that passes read.

The handlers are level-based (on.event: no kopf diffs, nothing kopf stores on the object), so kopf
gets a diff base that keeps nothing (`WatchOnlyDiffBase`): by default it deep-copies every event's
whole body (status and managedFields too) to build a diff nobody reads, about 85 % of its CPU per
event on a large job (bench/kopf_event_cost.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import kopf

from ddpjob_api.spec import GROUP, PLURAL, VERSION
from ddpjob_operator.app.controller import Reconciler


class WatchOnlyDiffBase(kopf.DiffBaseStorage):
    """kopf's diff base for watch-only handlers: an empty essence, built without copying the body,
    never stored on the object nor read from it. Only change and daemon handlers (on.create,
    on.update, on.field, daemons, timers) read diffs; `register` attaches none."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler, *, informers: Sequence[Any] = ()) -> None:
    """Attach the handlers to `registry` (watch-only handlers: no finalizers, no annotations)."""

    # A plain OperatorRegistry has no fallback login: use the kubernetes client's config
    # (in-cluster service account, else the current kubeconfig), like our own I/O does.
    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    # Startup handlers run before kopf's watches start, so the pod cache is listing by the
    # time the first DDPJob event asks for a pass (passes wait until it has synced).
    @kopf.on.startup(registry=registry)
    async def start(memo: kopf.Memo, **_: Any) -> None:
        loop = asyncio.get_running_loop()
        for informer in informers:
            informer.start(loop)
        memo.scrape = loop.create_task(reconciler.scrape_loop())

    # /healthz (the chart's readiness and liveness probe) answers 200 only once the pod cache has
    # listed the operator's pods: before that no pass can run, and an operator that cannot reach
    # the API server (a wrong address, a dead route) must not look ready to `helm install --wait`.
    # kopf serves a failed probe as a 500; PermanentError: no retry inside the probe request.
    @kopf.on.probe(id="podCacheSynced", registry=registry, errors=kopf.ErrorsMode.PERMANENT)
    def pod_cache_synced(**_: Any) -> bool:
        if not reconciler.pods.synced:
            raise kopf.PermanentError("the pod cache has not listed the operator's pods yet")
        return True

    @kopf.on.cleanup(registry=registry)
    async def stop(memo: kopf.Memo, **_: Any) -> None:
        for informer in informers:
            informer.stop()
        task = getattr(memo, "scrape", None)
        if task is not None:
            task.cancel()
        await reconciler.shutdown()

    # Every DDPJob event, including the initial listing after a restart (= resume).
    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def job_event(event: kopf.RawEvent, **_: Any) -> None:
        obj: dict[str, Any] = event.get("object") or {}  # type: ignore[assignment]  # kopf's RawBody: a dict
        if event.get("type") == "DELETED":
            reconciler.job_deleted(obj)
        else:
            reconciler.job_event(obj)
