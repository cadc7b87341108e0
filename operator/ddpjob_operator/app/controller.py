"""One reconcile pass per job: read the caches, decide and compute the status (pure), write the
status once, create and delete children as decided (`children`), post events.

Passes read the job and its pods from caches fed by watches, so a pass that changes nothing
sends nothing to the API server: jobs at rest cost no requests. Passes for one job never overlap and
bursts of triggers coalesce into a few passes (`workqueue`); status changes nobody acts on (node
counts) are written at most once per `coalesce` seconds, and not at all on their own while the
pods come up (`decisions.writes.write_wait`).
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
import time
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException

from ddpjob_api import contract, labels
from ddpjob_api.phases import Phase
from ddpjob_api.spec import from_manifest
from ddpjob_operator.base import podinfo
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.base.group import Group
from ddpjob_operator.base.objmeta import owned_by, resource_version
from ddpjob_operator.app.children import Children
from ddpjob_operator.app.operator_metrics import OperatorMetrics
from ddpjob_operator.app.workqueue import Key, WorkQueue
from ddpjob_operator.builders import gang
from ddpjob_operator.builders.stacks import render_stacks_configmap
from ddpjob_operator.cluster.cache import PeerGate, Store, key_of, pod_store
from ddpjob_operator.cluster.k8s import K8s
from ddpjob_operator.decisions import stacks
from ddpjob_operator.decisions.lifecycle import decide
from ddpjob_operator.decisions.samples import MonitorReport
from ddpjob_operator.decisions.status import create_refused, job_status
from ddpjob_operator.decisions.writes import (COMING_UP, progress_interval_now, quiet_come_up, scrape_needs_pass,
                                              settled, urgent, write_wait, yield_factor)

if TYPE_CHECKING:
    from ddpjob_operator.cluster.monitor import Monitor

log = logging.getLogger("ddpjob.controller")
MONITOR_TIMEOUT = 30.0
# Status writes per pass: a 409 (someone wrote in between) re-reads the job and decides again.
WRITE_ATTEMPTS = 4
MAX_SCRAPE_BACKOFF = 8
# Jobs scraped at once (each job's pods together, all of them within the monitor's own bound on
# requests): the others of a round wait for a slot, holding no task.
SCRAPES_IN_FLIGHT = 32
# A job's first come-up: its pods' moves (created, scheduled, started) are folded into one pass
# this long after the first of them, not one per burst (WorkQueue's debounce): at 1,000 jobs of 10
# the passes of jobs whose pods came up one by one were the operator's largest part while pods
# were still being created. The job's Running write waits at most this long, stretched as the
# progress interval is while hundreds of jobs come up (decisions/writes.yield_factor: at 1,000
# jobs of 10 a job still ran 6-8 passes, kwok starting its pods a few at a time); a failure, a
# deletion or any later attempt's pods kick at once.
COME_UP_FOLD = 1.0
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
    """Merge patch (RFC 7386) turning prev into new: a key that disappeared becomes null, inside
    an object that both hold too (a merge patch merges objects: progress.eta left out of the new
    progress would stay), while lists are replaced whole."""
    patch = dict(new)
    for key, old in prev.items():
        if key not in new:
            patch[key] = None
        elif isinstance(old, dict) and isinstance(new[key], dict):
            patch[key] = status_patch(old, new[key])
    return patch


class Reconciler:
    """The pass over one job (`reconcile`), run by `queue`; what it decided to make or delete goes
    through `children`. Owns the scrape schedule and what passes keep between them."""

    def __init__(self, config: OperatorConfig, k8s: K8s, metrics: OperatorMetrics, *,
                 monitor: Any = "auto", jobs: Store | None = None, pods: Store | None = None,
                 gate: PeerGate | None = None, coalesce: float = 5.0):
        self.config = config
        self.k8s = k8s
        self.metrics = metrics
        self.monitor = _load_monitor(config, k8s) if monitor == "auto" else monitor
        self.jobs = jobs if jobs is not None else Store()
        self.pods = pods if pods is not None else pod_store()
        self.pods.listeners.append(self._pod_changed)
        # A short pause before a pass that pod events asked for folds their burst into one pass (a
        # 64-pod group's pods each move three times within a second); a new job and a job's own
        # kick run at once.
        self.queue = WorkQueue(lambda key, scrape: self.reconcile(*key, scrape=scrape), ready=self.pods.wait_synced,
                               failed=self.metrics.reconcile_errors.inc, gate=gate, debounce=0.1)
        self.children = Children(config, k8s, metrics, self.pods, current=self._current)
        self.scrape_interval = max(float(config.scrape_interval), 1.0)
        self.progress_interval = max(float(config.progress_interval), 0.0)
        self.coalesce = coalesce
        self.come_up_fold = COME_UP_FOLD
        self.coming_up = 0   # jobs whose pods come up or that have no status yet, counted each scrape tick
        # Jobs whose pods come up quietly (decisions/writes.quiet_come_up): how many pods make the
        # job Running, and the names of those seen Running since the last pass.
        self._quiet: dict[Key, tuple[int, set[str]]] = {}
        self._written_rv: dict[Key, str] = {}      # resourceVersion of our own last status write
        self._last_write: dict[Key, float] = {}    # loop time of that write
        # Last state of each job's pods that vanished (PodGC marks a lost node's pod Failed +
        # DisruptionTarget just before it force-deletes it): lifecycle.decide's evidence.
        self._departed: dict[Key, dict[str, dict[str, Any]]] = {}
        # Jobs whose metrics endpoints do not answer are scraped every Nth interval (N doubles up
        # to MAX_SCRAPE_BACKOFF): jobs running their own command often serve no metrics at all.
        self._scrape_every: dict[Key, int] = {}
        # The latest scrape of each Running job, folded into its passes until the job stops running;
        # its events are taken (posted) by the next pass.
        self._reports: dict[Key, MonitorReport] = {}

    # -- triggers ------------------------------------------------------------------------
    def job_event(self, obj: dict[str, Any]) -> None:
        """A DDPJob watch event: cache it; pass over it unless it is the echo of our own write."""
        key = key_of(obj)
        new = self.jobs.get(*key) is None
        self.jobs.upsert(obj, notify=False)
        if resource_version(obj) and self._written_rv.get(key) == resource_version(obj):
            return
        self.queue.kick(*key, at_once=new)  # a new job has no burst to wait for

    def job_deleted(self, obj: dict[str, Any]) -> None:
        """A DDPJob is gone (its watch said so)."""
        self.jobs.delete(obj, notify=False)
        self.forget(*key_of(obj), uid=(obj.get("metadata") or {}).get("uid"))

    def _current(self, job) -> bool:
        """The cache still holds this job as decided on: not deleted, replaced by a namesake or its
        spec edited (suspended, say); else a creation in progress stops and a pass decides again."""
        meta = (self.jobs.get(job.namespace, job.name) or {}).get("metadata") or {}
        return meta.get("uid") == job.uid and int(meta.get("generation") or 0) == job.generation

    def _pod_changed(self, etype: str, pod: dict[str, Any]) -> None:
        job_name = ((pod.get("metadata") or {}).get("labels") or {}).get(labels.JOB_NAME)
        if job_name:
            key = (key_of(pod)[0], job_name)
            if etype == "DELETED" and not podinfo.lighthouse(pod):  # a lost Lighthouse is made again, no evidence
                self._departed.setdefault(key, {})[podinfo.name(pod)] = pod
            self._scrape_every.pop(key, None)
            quiet = self._quiet.pop(key, None)
            if quiet is not None and etype != "DELETED" and podinfo.plain_progress(pod):
                expected, running = quiet
                if podinfo.phase(pod) == "Running":
                    running.add(podinfo.name(pod))
                if len(running) < expected:
                    self._quiet[key] = quiet  # nothing for a pass to write or do yet
                    return
                self.queue.kick(*key, at_once=True)  # the last pod started: the Running write
                return
            if etype != "DELETED" and podinfo.coming_up(pod) and self._first_come_up(key):
                if key not in self.queue.dirty:  # a pending pass has not read the pods yet
                    self.queue.kick_later(key, self.come_up_fold * yield_factor(self.coming_up))
                return
            self.queue.kick(*key)

    def _first_come_up(self, key: Key) -> bool:
        """The job's first attempt is coming up (its cached status: Pending, attempt 0)."""
        status = (self.jobs.get(*key) or {}).get("status") or {}
        return status.get("phase") in (None, Phase.PENDING.value) and not status.get("attempt")

    def progress_interval_now(self) -> float:
        """The progress interval, stretched while jobs come up (decisions/writes.progress_interval_now)."""
        return progress_interval_now(self.progress_interval, self.coming_up)

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        """A DDPJob is gone: drop everything kept about it (a running pass ends by itself)."""
        key = (namespace, name)
        obj = self.jobs.get(namespace, name)
        if obj is not None and (uid is None or (obj.get("metadata") or {}).get("uid") == uid):
            uid = uid or (obj.get("metadata") or {}).get("uid")
            self.jobs.delete(obj, notify=False)
        for table in (self._written_rv, self._last_write, self._departed, self._quiet):
            table.pop(key, None)
        self.queue.forget(key)
        self._stop_scraping(key, uid)
        self.metrics.set_phase(key, None)
        if uid:
            self.children.forget(uid)

    def _stop_scraping(self, key: Key, uid: str | None) -> None:
        """Drop what the scrape schedule keeps about a job (gone, or no longer running)."""
        self._scrape_every.pop(key, None)
        self._reports.pop(key, None)
        self.metrics.forget_scrape(key)
        if uid and self.monitor is not None:
            try:
                self.monitor.forget(uid)
            except Exception:
                log.exception("monitor.forget failed")

    async def shutdown(self) -> None:
        """Stop timers and in-flight passes (on operator exit), then the I/O pool."""
        await self.queue.shutdown()
        close = getattr(self.monitor, "close", None)
        if close is not None:
            await close()
        self.k8s.close()

    # -- scheduling ------------------------------------------------------------------------
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
            running = self.tally()
            # One round at a time (the monitor bounds the requests of all jobs together).
            await self.scrape_round([key for key in running if tick % self._scrape_every.get(key, 1) == 0])

    def tally(self) -> list[Key]:
        """The running jobs (to scrape); counts the jobs coming up meanwhile (progress_interval_now)."""
        phases = [((obj.get("status") or {}).get("phase"), key_of(obj)) for obj in self.jobs.items()]
        self.coming_up = sum(1 for phase, _ in phases if phase is None or phase in COMING_UP)
        return [key for phase, key in phases if phase == Phase.RUNNING.value]

    async def scrape_round(self, keys: list[Key]) -> None:
        """Scrape `keys`, at most SCRAPES_IN_FLIGHT jobs at a time, and return when every one has
        ended. A job's scrape waits for its slot before it starts, holding nothing: started all at
        once, every job's scrape queued a task per pod on the monitor's bound and the last ones
        waited behind all the others, past their MONITOR_TIMEOUT (1,917 of them while 50,000 pods
        were created: bench/results/operator_memory_50k_attempt/)."""
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(SCRAPES_IN_FLIGHT)
        running: set[asyncio.Task] = set()   # asyncio keeps only weak references to tasks

        async def one(key: Key) -> None:
            try:
                await self._scrape_and_kick(key)
            finally:
                slots.release()
        try:
            for key in keys:
                await slots.acquire()
                task = loop.create_task(one(key))
                running.add(task)
                task.add_done_callback(running.discard)
            for _ in range(SCRAPES_IN_FLIGHT):   # every slot free again: the round's scrapes have ended
                await slots.acquire()
        finally:
            for task in list(running):           # the loop cancelled (operator exit): so are its scrapes
                task.cancel()

    async def _scrape_and_kick(self, key: Key) -> None:
        try:
            if await self.scrape(*key):
                self.queue.kick(*key)
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
        try:
            report = await asyncio.wait_for(self.monitor.observe(obj, self._pods(namespace, name, uid)), MONITOR_TIMEOUT)
        except Exception as exc:  # noqa: BLE001  (progress is optional; lifecycle is not)
            log.warning("monitor.observe %s/%s failed: %s", namespace, name, exc)
            return False
        if report.stacks:
            await self._keep_stacks(obj, report.stacks)
            report = dataclasses.replace(report, stacks=[])
        if (self.jobs.get(namespace, name) or {}).get("status", {}).get("phase") == Phase.RUNNING.value:
            self.metrics.record_scrape(key, report, when=time.time())  # not for a job that ended meanwhile
        if report.unreachable:
            self._scrape_every[key] = min(self._scrape_every.get(key, 1) * 2, MAX_SCRAPE_BACKOFF)
        else:
            self._scrape_every.pop(key, None)
        old = self._reports.get(key)
        if old is not None and old.events:
            report = dataclasses.replace(report, events=old.events + report.events)  # not posted yet
        self._reports[key] = report
        since = asyncio.get_running_loop().time() - self._last_write.get(key, float("-inf"))
        return scrape_needs_pass(obj.get("status") or {}, progress=report.progress, conditions=report.conditions,
                                 events=len(report.events), mlflow_run=report.mlflow_run,
                                 progress_due=since >= self.progress_interval_now())

    async def _keep_stacks(self, obj: dict[str, Any], captures: list[tuple[dict, str, str | None]]) -> None:
        """Add the pods' new stack captures to the job's ConfigMap (decisions/stacks.py says what is
        kept), created owned by the job; one that is not the job's is left alone. Best effort: a
        capture that could not be kept is fetched again at the next scrape."""
        job = from_manifest(obj)
        name = contract.stacks_configmap(job.name)
        try:
            existing = await self.k8s.get_child("ConfigMap", job.namespace, name, job=job.name)
            if existing is not None and not owned_by(existing, job.uid):
                log.warning("ConfigMap %s/%s is not DDPJob %s's: its pods' captured stacks are not kept there",
                            job.namespace, name, job.name)
                return
            old = (existing or {}).get("data") or {}
            data = stacks.merged(old, captures)
            if existing is None:
                await self.k8s.create(render_stacks_configmap(job, data))
            elif data != old:
                patch = {"data": {**{k: None for k in old if k not in data}, **data}}
                await self.k8s.patch_child("ConfigMap", job.namespace, name, patch, job=job.name,
                                           resource_version=resource_version(existing))
        except ApiException as exc:
            log.warning("could not keep the captured stacks of %s/%s in ConfigMap %s: %s", job.namespace, job.name,
                        name, exc.reason)
            if self.monitor is not None:
                self.monitor.fetch_stacks_again(job.uid)

    # -- one pass ------------------------------------------------------------------------
    def _children(self, namespace: str, name: str, uid: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """The cached training pods of the job with this uid (not those of an earlier job of the same
        name) and its Lighthouse pod if it is a per-step job (None: there is none). One read of the
        cache: each read decodes every pod of the job."""
        pods: list[dict[str, Any]] = []
        lighthouse = None
        for p in self.pods.by_index(namespace, name):
            if not owned_by(p, uid):
                continue
            if podinfo.lighthouse(p):
                lighthouse = p
            else:
                pods.append(p)
        return pods, lighthouse

    def _pods(self, namespace: str, name: str, uid: str) -> list[dict[str, Any]]:
        """The cached training pods of the job with this uid (`_children` without the Lighthouse)."""
        return self._children(namespace, name, uid)[0]

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
            pods, lighthouse = self._children(namespace, name, job.uid)
            group = Group.of(pods, departed=self._departed.get(key, {}).values())
            prev = dict(obj.get("status") or {})
            now = dt.datetime.now(dt.timezone.utc)
            decision = decide(job, group, now=now, prev_status=prev, config=self.config,
                              hang_overdue=report is not None and report.hang_overdue,
                              ranks=report.ranks if report is not None else None, lighthouse=lighthouse)
            status, events = job_status(job, group, now=now, prev_status=prev, config=self.config,
                                        decision=decision, report=report, podgroup=podgroup)
            if settled(prev, status):
                break
            if not urgent(prev, status, events=len(events) + len(report.events if report else [])):
                since = asyncio.get_running_loop().time() - self._last_write.get(key, float("-inf"))
                wait = write_wait(prev, status, since_write=since, coalesce=self.coalesce,
                                  progress_interval=self.progress_interval_now())
                if wait is None:
                    break  # node counts of pods coming up: the next write that is due carries them
                if wait > 0:
                    self.queue.kick_later(key, wait)  # fold this change into a later write
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
        refused = await self.children.act(job, group.pods + ((lighthouse,) if lighthouse else ()), decision)
        if decision.restarted is not None:
            # The new group is created by a later pass once the old pods' names are free; their
            # DELETED events usually bring it, but a lost node's pods were gone before this pass.
            self.queue.kick(namespace, name, at_once=True)
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
                self.queue.kick_later(key, REFUSED_RETRY_SECONDS)  # e.g. a quota: try again
        for etype, reason, message in events + (report.events if report is not None else []):
            await self.k8s.post_event(obj, etype, reason, message)

        self._quiet_after(key, job, decision, refused=bool(refused))
        if decision.phase is not Phase.RUNNING:
            self._stop_scraping(key, job.uid if decision.phase.finished else None)
        self.metrics.record_pass(key, prev_status=prev, status=status,
                                 restarted=decision.restarted.reason if decision.restarted else None,
                                 hang_timeout=job.spec.hang_timeout_seconds)
        if decision.requeue_after is not None and not decision.delete_job:
            self.queue.kick_later(key, decision.requeue_after)
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)

    def _quiet_after(self, key: Key, job, decision, *, refused: bool) -> None:
        """Whether the job's pods may now come up without a pass each (decisions/writes.quiet_come_up).
        The pods Running are read from the cache as it is now, not as the pass began: a pod that
        started while the pass waited on the API server counts (its event came under the old entry)."""
        self._quiet.pop(key, None)
        if not quiet_come_up(job, decision, refused=refused):
            return
        current = Group.of(self._pods(*key, job.uid)).attempts.get(decision.attempt)
        pods = current.pods if current is not None else ()
        if not all(podinfo.plain_progress(p) for p in pods):
            return  # a pod shows something: its moves ask for passes as before
        running = {podinfo.name(p) for p in pods if podinfo.phase(p) == "Running"}
        if len(running) >= job.spec.nodes:
            self.queue.kick(*key, at_once=True)  # all started during this pass: the next one writes Running
            return
        # A fold that pods' moves during this pass asked for would find what this one did (this
        # pass's own deadlines are set after this).
        self.queue.cancel_later(key)
        self._quiet[key] = (job.spec.nodes, running)

    async def _read_podgroup(self, job, namespace: str, name: str) -> dict[str, Any] | None:
        """A gang-scheduled job's PodGroup, read only while some pod of the job waits for a node
        (the GangScheduled condition shows its status then; a placed gang needs no request)."""
        api = gang.api_of(job)
        if api is None or Phase.parse((job.raw.get("status") or {}).get("phase")) in (Phase.SUCCEEDED, Phase.FAILED):
            return None
        # A failed attempt's kept pods (ended, bound) are no part of the gang being placed.
        pods = [p for p in self._pods(namespace, name, job.uid) if not podinfo.ended(p)]
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
