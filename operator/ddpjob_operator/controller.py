"""One reconcile pass per job: observe, decide (pure), write status once, act, then post events.

Passes for one job never overlap; bursts of triggers (a 64-pod group emits hundreds of pod
events) coalesce into a few passes. A single periodic resync (not a per-object kopf timer,
which would put a finalizer on every DDPJob) covers deadlines, scraping and missed events.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import time
from typing import Any

from kubernetes.client.rest import ApiException

from . import podinfo
from .config import OperatorConfig
from .k8s import K8s
from .lifecycle import decide
from .operator_metrics import OperatorMetrics
from .phases import Phase
from .pods import render_pod
from .service import render_service
from .spec import from_manifest
from .status import job_status

log = logging.getLogger("ddpjob.controller")
Key = tuple[str, str]
# Test knob: seconds to wait between pod creations (lets a test kill the operator mid-creation).
CREATE_DELAY_ENV = "DDPJOB_DEBUG_CREATE_DELAY"
MONITOR_TIMEOUT = 30.0


def _load_monitor(config: OperatorConfig) -> Any:
    """Helper C's progress/health monitor when present; the operator works without it."""
    try:
        from .monitor import Monitor  # noqa: PLC0415  (optional module)
    except ImportError:
        return None
    try:
        return Monitor(config)
    except Exception:  # noqa: BLE001  (a broken monitor must not stop the operator)
        log.exception("progress monitor disabled: could not start it")
        return None


def status_patch(prev: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Merge patch turning prev into new (keys that disappeared become null)."""
    patch = dict(new)
    for key in prev:
        if key not in new:
            patch[key] = None
    return patch


def owned_by(pod: dict[str, Any], uid: str) -> bool:
    """True when the pod's controller owner is the DDPJob with this uid."""
    return any(ref.get("uid") == uid for ref in (pod.get("metadata") or {}).get("ownerReferences") or [])


class Reconciler:
    """Serialises and coalesces reconcile passes per job; owns the periodic resync."""

    def __init__(self, config: OperatorConfig, k8s: K8s, metrics: OperatorMetrics, *,
                 monitor: Any = "auto", resync_interval: float | None = None):
        self.config = config
        self.k8s = k8s
        self.metrics = metrics
        self.monitor = _load_monitor(config) if monitor == "auto" else monitor
        self.resync_interval = resync_interval or max(float(config.scrape_interval), 5.0)
        self.create_delay = float(os.environ.get(CREATE_DELAY_ENV) or 0)
        # A short pause before each pass folds a burst of pod events into one pass.
        self.debounce = 0.1
        self._written_rv: dict[Key, str] = {}      # resourceVersion of our own last status write
        self.known: dict[Key, str] = {}            # (ns, name) -> uid
        self._dirty: dict[Key, bool] = {}          # pending pass; True = also scrape
        self._workers: dict[Key, asyncio.Task] = {}
        self._timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}
        self.paused = False
        self._paused_checked_at = float("-inf")
        self.identity: str | None = None           # our kopf peering identity (set by operator_main)

    # -- triggers ------------------------------------------------------------------------
    def kick(self, namespace: str, name: str, *, scrape: bool = False) -> None:
        """Ask for a pass over this job (coalesced with any pass already pending)."""
        key = (namespace, name)
        self._dirty[key] = self._dirty.get(key, False) or scrape
        if key not in self._workers or self._workers[key].done():
            self._workers[key] = asyncio.get_running_loop().create_task(self._work(key))

    def kick_later(self, key: Key, delay: float) -> None:
        """One delayed pass (deadlines, TTL, unschedulable timeout); keeps only the soonest."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        old = self._timers.get(key)
        if old and old[0] <= when and not old[1].cancelled():
            return
        if old:
            old[1].cancel()
        self._timers[key] = (when, loop.call_at(when + 0.05, self._timer_fired, key))

    def _timer_fired(self, key: Key) -> None:
        self._timers.pop(key, None)
        self.kick(*key)

    def seen(self, namespace: str, name: str, uid: str) -> None:
        """A DDPJob exists (from its watch)."""
        self.known[(namespace, name)] = uid

    def job_changed(self, namespace: str, name: str, uid: str, resource_version: str | None) -> None:
        """A DDPJob watch event: pass over it unless it is the echo of our own status write."""
        self.seen(namespace, name, uid)
        if resource_version and self._written_rv.get((namespace, name)) == resource_version:
            return
        self.kick(namespace, name)

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        """A DDPJob is gone: drop timers, monitor state and its metrics."""
        key = (namespace, name)
        uid = uid or self.known.get(key)
        self.known.pop(key, None)
        self._written_rv.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer:
            timer[1].cancel()
        self.metrics.set_phase(key, None)
        if self.monitor is not None and uid:
            try:
                self.monitor.forget(uid)
            except Exception:  # noqa: BLE001
                log.exception("monitor.forget failed")

    async def shutdown(self) -> None:
        """Stop timers and in-flight passes (on operator exit), then the I/O pool."""
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        self._dirty.clear()
        tasks = [t for t in self._workers.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.k8s.close()

    async def _work(self, key: Key) -> None:
        backoff = 1.0
        while key in self._dirty:
            await asyncio.sleep(self.debounce)
            scrape = self._dirty.pop(key)
            if not await self.may_act():
                continue  # a higher-priority peer acts; our resync retries once it is gone
            try:
                await self.reconcile(*key, scrape=scrape)
                backoff = 1.0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  (retry with backoff; never crash the operator)
                self.metrics.reconcile_errors.inc()
                log.warning("reconcile %s/%s failed (retry in %.0fs): %s", *key, backoff, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                self._dirty[key] = self._dirty.get(key, False) or scrape

    async def resync_loop(self) -> None:
        """Every interval: one pass per known job (running jobs also get scraped)."""
        while True:
            await asyncio.sleep(self.resync_interval)
            if not await self.may_act(max_age=0.0):
                continue
            for key in list(self.known):
                self.kick(*key, scrape=True)

    async def may_act(self, *, max_age: float = 2.0) -> bool:
        """False while a live higher-priority peer exists. Every pass asks, not only the resync:
        kopf notices a new peer only eventually, and a pass started from a watch event in that
        window would let two replicas act on one job. The answer is cached for `max_age` s."""
        if not self.config.peering:
            return True
        now = time.monotonic()
        if now - self._paused_checked_at >= max_age:
            try:
                self.paused = await self._peering_paused()
            except Exception as exc:  # noqa: BLE001  (an API hiccup: keep the last answer)
                log.debug("peering check failed: %s", exc)
            self._paused_checked_at = now
        return not self.paused

    async def _peering_paused(self) -> bool:
        """True while a live peer with a higher priority exists (then kopf pauses us too)."""
        if not self.config.peering:
            return False
        from kopf._core.engines.peering import Peer  # noqa: PLC0415  (kopf's own liveness rules)

        namespaces = [None] if self.config.all_namespaces else list(self.config.namespaces or ("default",))
        for ns in namespaces:
            obj = await self.k8s.get_peering(self.config.peering, ns)
            for ident, info in ((obj or {}).get("status") or {}).items():
                if not isinstance(info, dict) or ident == self.identity:
                    continue
                peer = Peer(identity=ident, **info)
                if not peer.is_dead and peer.priority > self.config.priority:
                    return True
        return False

    # -- one pass ------------------------------------------------------------------------
    async def reconcile(self, namespace: str, name: str, *, scrape: bool = False) -> None:
        """Observe the job and its pods, write status once, act, post events."""
        started = time.monotonic()
        key = (namespace, name)
        obj = await self.k8s.get_job(namespace, name)
        if obj is None:
            self.forget(namespace, name)
            return
        job = from_manifest(obj)
        self.seen(namespace, name, job.uid)
        pods = [p for p in await self.k8s.list_pods(namespace, name) if owned_by(p, job.uid)]
        prev = dict(obj.get("status") or {})
        now = dt.datetime.now(dt.timezone.utc)

        report = None
        if scrape and self.monitor is not None and prev.get("phase") == Phase.RUNNING.value:
            try:
                report = await asyncio.wait_for(self.monitor.observe(obj, pods), MONITOR_TIMEOUT)
            except Exception as exc:  # noqa: BLE001  (progress is optional; lifecycle is not)
                log.warning("monitor.observe %s/%s failed: %s", namespace, name, exc)

        decision = decide(job, pods, now=now, prev_status=prev, config=self.config,
                          stalled=bool(getattr(report, "stalled", False)))
        status, events = job_status(job, pods, now=now, prev_status=prev, config=self.config,
                                    decision=decision, report=report)
        if status != prev:
            try:
                written = await self.k8s.patch_status(namespace, name, status_patch(prev, status))
            except ApiException as exc:
                if exc.status != 422 or report is None:
                    raise
                # The monitor's part was refused by the schema: never let progress block the lifecycle.
                log.warning("status of %s/%s refused with the monitor report (%s); writing it without",
                            namespace, name, exc.reason)
                report = None
                status, events = job_status(job, pods, now=now, prev_status=prev, config=self.config,
                                            decision=decision)
                written = await self.k8s.patch_status(namespace, name, status_patch(prev, status))
            self._written_rv[key] = ((written or {}).get("metadata") or {}).get("resourceVersion", "")

        # Actions only after the status (attempt, counters) is safely stored.
        by_name = {podinfo.name(p): p for p in pods}
        deletes = [self.k8s.delete_pod(namespace, n, uid=(by_name[n].get("metadata") or {}).get("uid"))
                   for n in decision.delete_pods]
        if deletes:
            results = await asyncio.gather(*deletes)
            self.metrics.pods_deleted.inc(sum(bool(r) for r in results))
        if decision.create_ranks:
            await self._create(job, decision.create_ranks, decision.attempt)
        if decision.delete_job:
            log.info("deleting %s/%s: ttlSecondsAfterFinished passed", namespace, name)
            await self.k8s.delete_job(namespace, name)

        for etype, reason, message in events:
            await self.k8s.post_event(obj, etype, reason, message)
        if report is not None:
            for etype, reason, message in getattr(report, "events", None) or []:
                await self.k8s.post_event(obj, etype, reason, message)

        self._count(key, prev, status, decision)
        if decision.requeue_after is not None and not decision.delete_job:
            self.kick_later(key, decision.requeue_after)
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)

    async def _create(self, job, ranks: list[int], attempt: int) -> None:
        await self.k8s.create(render_service(job))
        pods = [render_pod(job, r, attempt=attempt, config=self.config) for r in ranks]
        if self.create_delay > 0:
            for pod in pods:
                if await self.k8s.create(pod):
                    self.metrics.pods_created.inc()
                await asyncio.sleep(self.create_delay)
            return
        results = await asyncio.gather(*(self.k8s.create(p) for p in pods))
        self.metrics.pods_created.inc(sum(bool(r) for r in results))

    def _count(self, key: Key, prev: dict, status: dict, decision) -> None:
        phase, old = status.get("phase"), prev.get("phase")
        self.metrics.set_phase(key, phase)
        if old is None:
            self.metrics.created.inc()
        if phase != old and phase == Phase.SUCCEEDED.value:
            self.metrics.succeeded.inc()
        if phase != old and phase == Phase.FAILED.value:
            self.metrics.failed.labels(status.get("reason") or "Failed").inc()
        if decision.restarted is not None:
            self.metrics.restarted.labels(decision.restarted.reason).inc()
