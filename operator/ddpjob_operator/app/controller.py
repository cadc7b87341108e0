"""One reconcile pass per job: read the caches, decide (pure), write status once, act, post events.

Passes read the job and its pods from caches fed by watches, so a pass that changes nothing
sends nothing to the API server: jobs at rest cost no requests. Passes for one job never overlap;
bursts of triggers (a 64-pod group emits hundreds of pod events) coalesce into a few passes, and
status changes nobody acts on (node counts) are written at most once per `coalesce` seconds.
Periodic work is only the scrape schedule of running jobs (pods' metrics, not the API server)
and one timer per job for its next deadline (activeDeadlineSeconds, TTL, unschedulable timeout).
A scrape is not a pass: it runs one only when it found something to write now
(`decisions.writes.scrape_needs_pass`); progress alone is written once per progress interval.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

from kubernetes.client.rest import ApiException

from ddpjob_operator.builders import gang
from ddpjob_operator.api import labels, podinfo
from ddpjob_operator.cluster.cache import PeerGate, Store, key_of
from ddpjob_operator.api.config import OperatorConfig
from ddpjob_operator.api.group import Group
from ddpjob_operator.cluster.k8s import K8s
from ddpjob_operator.decisions.lifecycle import Decision, decide
from ddpjob_operator.api.objmeta import resource_version
from ddpjob_operator.app.operator_metrics import OperatorMetrics
from ddpjob_operator.api.phases import Phase
from ddpjob_operator.builders.pods import render_pod

if TYPE_CHECKING:
    from ddpjob_operator.cluster.monitor import Monitor, MonitorReport
from ddpjob_operator.builders.service import render_service
from ddpjob_operator.api.spec import from_manifest
from ddpjob_operator.decisions.status import NAME_CONFLICT, CreateRefusal, create_refused, job_status, refusal, split_creates
from ddpjob_operator.decisions.writes import scrape_needs_pass, urgent, write_wait

log = logging.getLogger("ddpjob.controller")
Key = tuple[str, str]
# Test knob: seconds to wait between pod creations (lets a test kill the operator mid-creation).
CREATE_DELAY_ENV = "DDPJOB_DEBUG_CREATE_DELAY"
MONITOR_TIMEOUT = 30.0
# Status writes per pass: a 409 (someone wrote in between) re-reads the job and decides again.
WRITE_ATTEMPTS = 4
MAX_SCRAPE_BACKOFF = 8
# Pods POSTed per pass: a larger group is created over several passes (the job kicks itself), so
# another job's requests queue behind at most one batch in the K8s facade's pool, not a whole group.
CREATE_BATCH = 32
REFUSED_RETRY_SECONDS = 10.0  # a refusal that may pass later (403 from a quota): try again after this


def _load_monitor(config: OperatorConfig, k8s: K8s) -> Monitor | None:
    """The progress/health monitor; the operator works without it."""
    from ddpjob_operator.cluster.monitor import Monitor, SimulatedNodes  # here, not at the top: imports aiohttp; unit tests pass monitor=None

    try:
        return Monitor(config, simulated=SimulatedNodes(k8s.get_node))
    except Exception:  # a broken monitor must not stop the operator
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


def foreign_service(job, svc: dict[str, Any] | None) -> CreateRefusal | None:
    """A refusal naming the Service that holds this job's Service name when it is not this job's
    headless Service; None when it is (or it has gone meanwhile: the next pass creates it)."""
    if svc is None:
        return None
    name = (svc.get("metadata") or {}).get("name") or job.name
    if not owned_by(svc, job.uid):
        why = f"service {name} exists and is not owned by this DDPJob"
    elif (svc.get("spec") or {}).get("clusterIP") != "None":
        why = f"service {name} is not headless (clusterIP {(svc.get('spec') or {}).get('clusterIP')})"
    else:
        return None
    return CreateRefusal(pod=name, code=409, reason=NAME_CONFLICT, kind="service",
                         message=f"{why}: pods would get a MASTER_ADDR that does not resolve; "
                                 "rename the job or delete that service")


def foreign_podgroup(job, pg: dict[str, Any] | None) -> CreateRefusal | None:
    """A refusal naming the PodGroup that holds this job's PodGroup name when it is not this
    job's: the gang scheduler would wait for that group's minMember, not ours."""
    if pg is None or owned_by(pg, job.uid):
        return None
    name = (pg.get("metadata") or {}).get("name") or job.name
    return CreateRefusal(pod=name, code=409, reason=NAME_CONFLICT, kind="podgroup",
                         message=f"podgroup {name} exists and is not owned by this DDPJob: the gang "
                                 "scheduler would place the pods by its rules; rename the job or delete it")


class Reconciler:
    """Serialises and coalesces reconcile passes per job; owns the scrape schedule and timers."""

    def __init__(self, config: OperatorConfig, k8s: K8s, metrics: OperatorMetrics, *,
                 monitor: Any = "auto", jobs: Store | None = None, pods: Store | None = None,
                 gate: PeerGate | None = None, coalesce: float = 5.0):
        self.config = config
        self.k8s = k8s
        self.metrics = metrics
        self.monitor = _load_monitor(config, k8s) if monitor == "auto" else monitor
        self.jobs = jobs if jobs is not None else Store()
        self.pods = pods if pods is not None else Store(index_label=labels.JOB_NAME)
        self.pods.listeners.append(self._pod_changed)
        self.gate = gate
        if gate is not None:
            gate.store.listeners.append(lambda *_: self._unblock())
        self.scrape_interval = max(float(config.scrape_interval), 1.0)
        self.progress_interval = max(float(config.progress_interval), 0.0)
        self.create_delay = float(os.environ.get(CREATE_DELAY_ENV) or 0)
        # A short pause before each pass folds a burst of pod events into one pass.
        self.debounce = 0.1
        self.coalesce = coalesce
        self._written_rv: dict[Key, str] = {}      # resourceVersion of our own last status write
        self._last_write: dict[Key, float] = {}    # loop time of that write
        self._dirty: dict[Key, bool] = {}          # pending pass; True = also scrape
        self._workers: dict[Key, asyncio.Task] = {}
        self._timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}
        self._services: dict[str, int] = {}        # job uid -> attempt its Service was last seen in
        self._podgroups: dict[str, int] = {}       # job uid -> attempt its PodGroup was last seen in
        self._blocked: set[Key] = set()            # passes held back by a higher-priority peer
        # Last state of each job's pods that vanished (PodGC marks a lost node's pod Failed +
        # DisruptionTarget just before it force-deletes it): lifecycle.decide's evidence.
        self._departed: dict[Key, dict[str, dict[str, Any]]] = {}
        # Jobs whose metrics endpoints do not answer are scraped every Nth interval (N doubles up
        # to MAX_SCRAPE_BACKOFF): jobs running their own command often serve no metrics at all.
        self._scrape_every: dict[Key, int] = {}
        # The latest scrape of each Running job, folded into its passes until the job stops running;
        # its events are taken (posted) by the next pass.
        self._reports: dict[Key, MonitorReport] = {}
        self._at_once: set[Key] = set()            # the pending pass skips the debounce

    # -- triggers ------------------------------------------------------------------------
    def kick(self, namespace: str, name: str, *, scrape: bool = False, at_once: bool = False) -> None:
        """Ask for a pass over this job (coalesced with any pass already pending); `at_once`: no
        pause to fold a burst of events in (the next batch of a group being created)."""
        key = (namespace, name)
        self._dirty[key] = self._dirty.get(key, False) or scrape
        if at_once:
            self._at_once.add(key)
        if key not in self._workers:
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

    def job_event(self, obj: dict[str, Any]) -> None:
        """A DDPJob watch event: cache it; pass over it unless it is the echo of our own write."""
        key = key_of(obj)
        self.jobs.upsert(obj, notify=False)
        if resource_version(obj) and self._written_rv.get(key) == resource_version(obj):
            return
        self.kick(*key)

    def job_deleted(self, obj: dict[str, Any]) -> None:
        """A DDPJob is gone (its watch said so)."""
        self.jobs.delete(obj, notify=False)
        self.forget(*key_of(obj), uid=(obj.get("metadata") or {}).get("uid"))

    def _pod_changed(self, etype: str, pod: dict[str, Any]) -> None:
        job_name = ((pod.get("metadata") or {}).get("labels") or {}).get(labels.JOB_NAME)
        if job_name:
            key = (key_of(pod)[0], job_name)
            if etype == "DELETED":
                self._departed.setdefault(key, {})[podinfo.name(pod)] = pod
            self._scrape_every.pop(key, None)
            self.kick(*key)

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        """A DDPJob is gone: drop everything kept about it (a running pass ends by itself)."""
        key = (namespace, name)
        obj = self.jobs.get(namespace, name)
        if obj is not None and (uid is None or (obj.get("metadata") or {}).get("uid") == uid):
            uid = uid or (obj.get("metadata") or {}).get("uid")
            self.jobs.delete(obj, notify=False)
        for table in (self._written_rv, self._last_write, self._dirty, self._departed):
            table.pop(key, None)
        self._blocked.discard(key)
        self._at_once.discard(key)
        self._stop_scraping(key, uid)
        timer = self._timers.pop(key, None)
        if timer:
            timer[1].cancel()
        self.metrics.set_phase(key, None)
        if uid:
            self._services.pop(uid, None)
            self._podgroups.pop(uid, None)

    def _stop_scraping(self, key: Key, uid: str | None) -> None:
        """Drop what the scrape schedule keeps about a job (gone, or no longer running)."""
        self._scrape_every.pop(key, None)
        self._reports.pop(key, None)
        if uid and self.monitor is not None:
            try:
                self.monitor.forget(uid)
            except Exception:
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
        close = getattr(self.monitor, "close", None)
        if close is not None:
            await close()
        self.k8s.close()

    # -- scheduling ------------------------------------------------------------------------
    async def _work(self, key: Key) -> None:
        backoff = 1.0
        try:
            await self.pods.wait_synced()  # an unsynced cache would make launched pods look deleted
            while key in self._dirty:
                if key in self._at_once:
                    self._at_once.discard(key)
                    await asyncio.sleep(0)  # other jobs' passes still get their turn
                else:
                    await asyncio.sleep(self.debounce)
                scrape = self._dirty.pop(key)
                wait = self.held_back()
                if wait is not None:
                    # A higher-priority peer acts; retry when it would be presumed dead (its
                    # keep-alives move that time, and its leaving wakes us through the peer cache).
                    self._blocked.add(key)
                    self.kick_later(key, wait)
                    continue
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
        finally:
            if self._workers.get(key) is asyncio.current_task():
                del self._workers[key]

    def held_back(self) -> float | None:
        """Seconds until a live higher-priority peer would be presumed dead; None = act now."""
        until = self.gate.blocking_until() if self.gate is not None else None
        if until is None:
            return None
        return max(1.0, (until - dt.datetime.now(dt.timezone.utc)).total_seconds())

    def _unblock(self) -> None:
        """The peering object changed: passes held back may run now (or wait again)."""
        blocked, self._blocked = self._blocked, set()
        for key in blocked:
            self.kick(*key)

    async def scrape_loop(self) -> None:
        """Every scrape interval: scrape each running job's pods (not the API server), and run a
        pass only for a job whose scrape found something to write now. A job whose pods do not
        answer is scraped every MAX_SCRAPE_BACKOFF-th interval, never given up: a start-up that is
        slow to serve its first sample (a cold image, a long rendezvous) changes no pod to wake it."""
        if self.monitor is None:
            return
        tick = 0
        while True:
            await asyncio.sleep(self.scrape_interval)
            tick += 1
            due = []
            for obj in self.jobs.items():
                key = key_of(obj)
                if ((obj.get("status") or {}).get("phase") == Phase.RUNNING.value
                        and tick % self._scrape_every.get(key, 1) == 0):
                    due.append(key)
            # One round at a time (the monitor bounds the requests of all jobs together).
            await asyncio.gather(*(self._scrape_and_kick(key) for key in due))

    async def _scrape_and_kick(self, key: Key) -> None:
        try:
            if await self.scrape(*key):
                self.kick(*key)
        except Exception:  # a scrape is optional; the next tick tries again
            log.exception("scrape of %s/%s failed", *key)

    async def scrape(self, namespace: str, name: str) -> bool:
        """Scrape a running job's pods now and keep the report for its passes; True when it holds
        something to write now (decisions.writes.scrape_needs_pass)."""
        key = (namespace, name)
        obj = self.jobs.get(namespace, name)
        if self.monitor is None or obj is None or (obj.get("status") or {}).get("phase") != Phase.RUNNING.value:
            return False
        uid = (obj.get("metadata") or {}).get("uid") or ""
        report = await self._observe(obj, [p for p in self.pods.by_index(namespace, name) if owned_by(p, uid)])
        if report is None:
            return False
        every = self._scrape_every.get(key, 1)
        if report.unreachable:
            self._scrape_every[key] = min(every * 2, MAX_SCRAPE_BACKOFF)
        else:
            self._scrape_every.pop(key, None)
        old = self._reports.get(key)
        if old is not None and old.events:
            report = dataclasses.replace(report, events=old.events + report.events)  # not posted yet
        self._reports[key] = report
        since = asyncio.get_running_loop().time() - self._last_write.get(key, float("-inf"))
        return scrape_needs_pass(obj.get("status") or {}, progress=report.progress, conditions=report.conditions,
                                 events=len(report.events), mlflow_run=report.mlflow_run,
                                 progress_due=since >= self.progress_interval)

    # -- one pass ------------------------------------------------------------------------
    async def _observe(self, obj: dict[str, Any], pods: list[dict[str, Any]]) -> MonitorReport | None:
        try:
            return await asyncio.wait_for(self.monitor.observe(obj, pods), MONITOR_TIMEOUT)
        except Exception as exc:  # noqa: BLE001  (progress is optional; lifecycle is not)
            meta = obj.get("metadata") or {}
            log.warning("monitor.observe %s/%s failed: %s", meta.get("namespace"), meta.get("name"), exc)
            return None

    async def reconcile(self, namespace: str, name: str, *, scrape: bool = False) -> None:
        """Decide from the caches, write status once (if it changed), act, post events."""
        started = time.monotonic()
        key = (namespace, name)
        obj = self.jobs.get(namespace, name)
        if obj is None:
            self.forget(namespace, name)
            return
        if scrape:
            await self.scrape(namespace, name)
        # The latest scrape counts while the job runs; its events are this pass's to post.
        report = self._reports.get(key) if (obj.get("status") or {}).get("phase") == Phase.RUNNING.value else None
        if report is not None and report.events:
            self._reports[key] = dataclasses.replace(report, events=[])

        job = from_manifest(obj)  # built again only when a conflict brings a newer object
        podgroup = await self._read_podgroup(job, namespace, name)
        for _ in range(WRITE_ATTEMPTS):
            group = Group.of((p for p in self.pods.by_index(namespace, name) if owned_by(p, job.uid)),
                             departed=self._departed.get(key, {}).values())
            prev = dict(obj.get("status") or {})
            now = dt.datetime.now(dt.timezone.utc)
            decision = decide(job, group, now=now, prev_status=prev, config=self.config,
                              stalled=report is not None and report.stalled)
            status, events = job_status(job, group, now=now, prev_status=prev, config=self.config,
                                        decision=decision, report=report, podgroup=podgroup)
            if status == prev:
                break
            if not urgent(prev, status, events=len(events) + len(report.events if report else [])):
                since = asyncio.get_running_loop().time() - self._last_write.get(key, float("-inf"))
                wait = write_wait(prev, status, since_write=since, coalesce=self.coalesce,
                                  progress_interval=self.progress_interval)
                if wait > 0:
                    self.kick_later(key, wait)  # fold this change into a later write
                    break
            try:
                written = await self.k8s.patch_status(namespace, name, status_patch(prev, status),
                                                      resource_version=resource_version(obj) or None)
            except ApiException as exc:
                if exc.status == 404:
                    self.forget(namespace, name)
                    return
                if exc.status == 409:
                    # Someone wrote since our read: decide again from the current object.
                    fresh = await self.k8s.get_job(namespace, name)
                    if fresh is None:
                        self.forget(namespace, name)
                        return
                    self.jobs.upsert(fresh, notify=False)
                    obj, job = fresh, from_manifest(fresh)
                    continue
                if not 400 <= exc.status < 500 or report is None:
                    raise
                # Refused with the monitor's part (the schema's 422, or a 400 for a body a pod's
                # metrics made invalid): never let what a pod says block the lifecycle.
                log.warning("status of %s/%s refused with the monitor report (%s); writing it without",
                            namespace, name, exc.reason)
                report = None
                self._reports.pop(key, None)
                continue
            self._wrote(key, written)
            break
        else:
            raise RuntimeError(f"status of {namespace}/{name}: {WRITE_ATTEMPTS} conflicting writes in a row")

        # Actions only after the status (attempt, counters) is safely stored.
        refused = await self._act(job, group.pods, decision)
        if decision.restarted is not None:
            # The new group is created by a later pass once the old pods' names are free; their
            # DELETED events usually bring it, but a lost node's pods were gone before this pass.
            self.kick(namespace, name)
        # Older attempts' records are history.
        gone = Group.of(self._departed.pop(key, {}).values()).between(decision.attempt)
        if gone:
            self._departed[key] = {podinfo.name(p): p for p in gone}
        if refused:
            # The API server refused a pod (a 4xx naming the field): say so in the job.
            new, more = create_refused(job, status, refused, now=now, config=self.config)
            self._wrote(key, await self.k8s.patch_status(namespace, name, status_patch(status, new)))
            status, events = new, events + more
            if not any(r.permanent for r in refused):
                self.kick_later(key, REFUSED_RETRY_SECONDS)  # e.g. a quota: try again
        for etype, reason, message in events + (report.events if report is not None else []):
            await self.k8s.post_event(obj, etype, reason, message)

        if decision.phase is not Phase.RUNNING:
            self._stop_scraping(key, job.uid if decision.phase.finished else None)
        self.metrics.record_pass(key, prev_status=prev, status=status,
                                 restarted=decision.restarted.reason if decision.restarted else None,
                                 hang_timeout=job.hang_timeout_seconds)
        if decision.requeue_after is not None and not decision.delete_job:
            self.kick_later(key, decision.requeue_after)
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)

    async def _read_podgroup(self, job, namespace: str, name: str) -> dict[str, Any] | None:
        """A gang-scheduled job's PodGroup, read only while some pod of the job waits for a node
        (the GangScheduled condition shows its status then; a placed gang needs no request)."""
        api = gang.api_of(job)
        if api is None or Phase.parse((job.raw.get("status") or {}).get("phase")) in (Phase.SUCCEEDED, Phase.FAILED):
            return None
        # A failed attempt's kept pods (ended, bound) are no part of the gang being placed.
        pods = [p for p in self.pods.by_index(namespace, name) if owned_by(p, job.uid) and not podinfo.ended(p)]
        bound = sum(1 for p in pods if (p.get("spec") or {}).get("nodeName"))
        if bound == len(pods) or bound >= gang.min_member(job):  # no pods yet, or the gang is placed
            return None
        try:
            return await self.k8s.get_child(gang.KIND, namespace, gang.podgroup_name(job), job=name,
                                            api_version=api.api_version)
        except ApiException as exc:
            log.debug("podgroup of %s/%s unreadable: %s", namespace, name, exc.reason)
            return None

    def _wrote(self, key: Key, written: dict[str, Any] | None) -> None:
        """Our write is the newest state: the next pass must see it before its watch echo."""
        self._written_rv[key] = resource_version(written)
        self._last_write[key] = asyncio.get_running_loop().time()
        if written:
            self.jobs.upsert(written, notify=False)

    async def _act(self, job, pods: tuple[dict[str, Any], ...], decision: Decision) -> list:
        """Delete, create, delete the job, as decided; returns the pod creates the API refused."""
        by_name = {podinfo.name(p): p for p in pods}
        deletes = [self.k8s.delete_pod(job.namespace, n, job=job.name, uid=(by_name[n].get("metadata") or {}).get("uid"))
                   for n in decision.delete_pods]
        if deletes:
            results = await asyncio.gather(*deletes)
            self.metrics.count_pods(job.namespace, deleted=sum(bool(r) for r in results))
        refused = []
        if decision.create_ranks:
            refused = await self._create(job, decision)
        if decision.delete_job:
            log.info("deleting %s/%s: ttlSecondsAfterFinished passed", job.namespace, job.name)
            await self.k8s.delete_job(job.namespace, job.name)
        return refused

    async def _ensure_shared(self, job, obj: dict[str, Any], *, attempt: int, seen: dict[str, int],
                             conflict: Callable[[Any, dict[str, Any] | None], CreateRefusal | None]
                             ) -> CreateRefusal | None:
        """Create a child the whole job shares (its Service, its PodGroup), once per job; a refusal
        when it cannot be made or is someone else's. Nothing watches these, so a later creation
        pass (a restart) reads it back, once per attempt (not per batch): someone may have
        deleted it, and the new group's rendezvous (or gang) would then never form."""
        kind, name, api_version = obj["kind"], obj["metadata"]["name"], obj["apiVersion"]
        if seen.get(job.uid) not in (None, attempt):
            if await self.k8s.get_child(kind, job.namespace, name, job=job.name, api_version=api_version) is None:
                del seen[job.uid]
            else:
                seen[job.uid] = attempt
        if job.uid in seen:
            return None
        try:
            created = await self.k8s.create(obj)
        except ApiException as exc:
            refused = refusal(name, exc.status, exc.body)
            if refused is None:
                raise
            if exc.status == 404 and kind == gang.KIND:  # the API group is not served: no scheduler CRD
                refused = dataclasses.replace(refused, message=(
                    f"this cluster does not serve {api_version} {kind}s: install the scheduler that "
                    f"spec.scheduling.gang names (or remove spec.scheduling.gang)"))
            return dataclasses.replace(refused, kind=kind.lower())
        if created is None:
            # 409: after an operator restart it is ours; anyone else's would stand in for ours.
            found = conflict(job, await self.k8s.get_child(kind, job.namespace, name, job=job.name,
                                                           api_version=api_version))
            if found:
                return found
        seen[job.uid] = attempt
        return None

    async def _create(self, job, decision: Decision) -> list:
        # The Service and PodGroup outlive group restarts: POST them once per job (a 409 after an
        # operator restart also means they exist). A Service that is not ours (or not headless)
        # would give the pods a MASTER_ADDR that never resolves, so no pods until it is sorted out.
        service = render_service(job)
        shared: list[tuple[Any, Any, Any]] = [(service, self._services, foreign_service)]
        if gang.api_of(job) is not None:
            pod = render_pod(job, 0, attempt=decision.attempt, config=self.config)
            shared.append((gang.render_podgroup(job, pod), self._podgroups, foreign_podgroup))
        for obj, seen, conflict in shared:
            refused = await self._ensure_shared(job, obj, attempt=decision.attempt, seen=seen, conflict=conflict)
            if refused:
                return [refused]
        ranks = list(decision.create_ranks)
        if len(ranks) > CREATE_BATCH:
            ranks = ranks[:CREATE_BATCH]
            self.kick(job.namespace, job.name, at_once=True)  # the rest in later passes, other jobs' between
        pods = [render_pod(job, r, attempt=decision.attempt, config=self.config, restarts=decision.restarts,
                           counted_restarts=decision.counted_restarts) for r in ranks]
        if self.create_delay > 0:
            refusals: list = []
            for pod in pods:
                refusals += await self._create_pods(job, [pod])
                await asyncio.sleep(self.create_delay)
            return refusals
        return await self._create_pods(job, pods)

    async def _create_pods(self, job, pods: list[dict[str, Any]]) -> list[CreateRefusal]:
        results = await asyncio.gather(*(self.k8s.create(p) for p in pods), return_exceptions=True)
        made, refused = split_creates(pods, results)
        self._created(job.namespace, made)
        # A 409 is usually our own pod the cache has not shown yet; a pod of that name made by
        # someone else would keep the job waiting forever without a word, so look at its owner.
        for pod, res in zip(pods, results):
            if res is not None:
                continue
            name = pod["metadata"]["name"]
            other = await self.k8s.get_child("Pod", job.namespace, name, job=job.name)
            if other is not None and not owned_by(other, job.uid):
                refused.append(CreateRefusal(pod=name, code=409, reason=NAME_CONFLICT,
                                             message=f"pod {name} exists and is not owned by this DDPJob"))
        return refused

    def _created(self, namespace: str, pods: list[dict[str, Any] | None]) -> None:
        made = [p for p in pods if p is not None]  # None: it existed already (409)
        self.metrics.count_pods(namespace, created=len(made))
        for pod in made:
            if pod.get("metadata"):
                self.pods.upsert(pod, notify=False)  # seen by the next pass even before its watch event

