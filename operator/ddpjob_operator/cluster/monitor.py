"""Scrape a running job's pods and turn the metrics into progress, conditions and events.

The reconcile loop (handlers/status) is the only writer of DDPJob status: it calls
`Monitor.observe(job, pods)` once per pass and merges the returned `MonitorReport`.
State kept here per job uid: the previous scrape (for rates) and a HealthTracker.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from ddpjob_api import contract
from ddpjob_api.phases import Reason, Signal
from ddpjob_api.spec import spec_of
from ddpjob_api.specgen import DDPJobSpec
from ddpjob_operator.decisions import health, progress
from ddpjob_operator.base import podinfo
from ddpjob_operator.base.group import Group
from ddpjob_operator.cluster import scrape
from ddpjob_operator.decisions.samples import MonitorReport, RankSample
from ddpjob_operator.base.objmeta import format_time
from ddpjob_operator.base.podinfo import is_simulated_node
from ddpjob_operator.base.config import OperatorConfig

log = logging.getLogger(__name__)

DEFAULT_URL_TEMPLATE = "http://{ip}:{port}/metrics"
CONDITION_TYPES = (Signal.STRAGGLER, Signal.STALLED)

# status.progress.unavailable while every running pod is on a simulated node.
SIMULATED_UNAVAILABLE = ("{n} pod(s) on simulated (kwok) nodes: their addresses answer nobody, so "
                         "they are not scraped and progress is unavailable")

# Straggler's wording when nothing is wrong (Stalled's depends on the stage: HealthTracker.calm_condition).
_NO_STRAGGLER = (Reason.NO_STRAGGLER, "every rank keeps pace with the median")


@dataclass
class _JobState:
    tracker: health.HealthTracker
    prev: tuple[float, dict[int, RankSample]] | None = None
    failing: set[str] = field(default_factory=set)
    attempt: int | None = None
    # pod name -> the newest stack capture (time) fetched from its endpoint (contract.STACKS_PATH)
    stacks_seen: dict[str, float] = field(default_factory=dict)


def scrape_url(template: str, *, pod: dict, port: int, job_name: str, namespace: str) -> str | None:
    """The metrics URL of one pod; None when it has no IP yet (default template)."""
    rank = max(podinfo.rank(pod), 0)
    ip = (pod.get("status") or {}).get("podIP") or ""
    tpl = template or DEFAULT_URL_TEMPLATE
    if "{ip}" in tpl and not ip:
        return None
    return tpl.format(pod=podinfo.name(pod), rank=rank, ip=ip, port=port,
                      rank_port=port + rank, namespace=namespace, job=job_name)


class SimulatedNodes:
    """Which nodes kwok simulates, asked of the API server once per node name (the annotation
    never changes while a node exists). Without permission to read nodes every node counts as real,
    said once in the log."""

    def __init__(self, get_node: Callable[[str], Awaitable[dict | None]], *, max_nodes: int = 20000) -> None:
        self._get = get_node
        self._known: dict[str, bool] = {}
        self._max = max_nodes
        self._blind = False

    async def __call__(self, node: str) -> bool:
        if not node or self._blind:
            return False
        if node in self._known:
            return self._known[node]
        try:
            obj = await self._get(node)
        except Exception as exc:  # noqa: BLE001  (progress is optional: scrape as before)
            if getattr(exc, "status", None) == 403:
                self._blind = True
                log.warning("may not read nodes (%s): pods on simulated (kwok) nodes are scraped "
                            "like any other", getattr(exc, "reason", exc))
            return False  # anything else: asked again next time
        simulated = is_simulated_node(obj)
        if obj is not None:
            if len(self._known) >= self._max:
                self._known.clear()
            self._known[node] = simulated
        return simulated


class Monitor:
    """Per-operator scraper of training pods (bounded concurrency, per-request timeouts)."""

    def __init__(self, config: OperatorConfig, *, concurrency: int = 32, timeout: float | None = None,
                 clock: Callable[[], float] = time.time,
                 max_body_bytes: int = scrape.MAX_BODY_BYTES,
                 simulated: Callable[[str], Awaitable[bool]] | None = None) -> None:
        self.config = config
        # Pods on simulated nodes are not scraped by their address (the default template).
        self.simulated = simulated
        self.max_body_bytes = max_body_bytes
        self.concurrency = concurrency
        # A scrape must finish well inside one interval, whatever a pod does.
        self.timeout = timeout if timeout is not None else max(1.0, min(5.0, config.scrape_interval / 2))
        self.clock = clock
        self._jobs: dict[str, _JobState] = {}
        # One bound for the whole operator (all jobs' scrapes together), made in the running loop.
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None
        # One keep-alive HTTP session for every scrape (made in the running loop, closed by close()):
        # a connection per pod is opened once, not once per scrape.
        self._session = None

    async def close(self) -> None:
        """Close the scrapes' HTTP session (on operator exit)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self, loop: asyncio.AbstractEventLoop):
        if self._sem is None or self._sem_loop is not loop:
            self._sem, self._sem_loop = asyncio.Semaphore(self.concurrency), loop
            # A session belongs to its loop: a new loop (tests) gets a new one.
            self._session = scrape.session(concurrency=self.concurrency,
                                           keepalive=self.config.scrape_interval * 2 + 5)
        return self._sem, self._session

    def forget(self, uid: str) -> None:
        """Drop what is kept about a job (deleted or finished)."""
        self._jobs.pop(uid, None)

    def fetch_stacks_again(self, uid: str) -> None:
        """The captures fetched for a job could not be kept: fetch them again next time."""
        st = self._jobs.get(uid)
        if st is not None:
            st.stacks_seen.clear()

    async def _stacks(self, st: _JobState, fresh: list[tuple[str, str, str | None]], sem, session) -> list:
        """(capture, pod, node) of the captures the pods in `fresh` ((metrics url, pod, node)) took
        since those fetched before: one GET of each such pod's STACKS_PATH, only after a capture."""
        # Each pod endpoint's stacks URL is beside its metrics URL (the last path part replaced).
        results = await scrape.fetch_all([url.rsplit("/", 1)[0] + contract.STACKS_PATH for url, _, _ in fresh],
                                         concurrency=self.concurrency, timeout=self.timeout, semaphore=sem,
                                         session=session, max_bytes=self.max_body_bytes)
        out = []
        for (_, pod_name, node), res in zip(fresh, results):
            try:
                records = json.loads(res.text) if res.text is not None else None
            except ValueError:
                records = None
            if not isinstance(records, list):
                log.info("stacks of pod %s unreadable: %s", pod_name, res.error or "not a JSON list")
                continue
            seen = st.stacks_seen.get(pod_name, 0.0)
            new = [r for r in records if isinstance(r, dict) and isinstance(r.get("time"), (int, float))
                   and r["time"] > seen]
            if new:
                st.stacks_seen[pod_name] = max(r["time"] for r in new)
            out += [(r, pod_name, node) for r in new]
        return out

    def _state(self, job: dict, spec: DDPJobSpec) -> _JobState:
        meta = job.get("metadata") or {}
        uid = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
        st = self._jobs.get(uid)
        if st is None:
            st = self._jobs[uid] = _JobState(tracker=health.HealthTracker.for_spec(spec))
            # After an operator restart keep a reported hang until steps move again.
            for c in (job.get("status") or {}).get("conditions") or []:
                if c.get("type") == Signal.STALLED and c.get("status") == "True":
                    st.tracker.active[Signal.STALLED] = health.Finding(
                        Signal.STALLED, True, (), c.get("reason", Reason.NO_PROGRESS.value), c.get("message", ""))
        st.tracker.configure(spec)
        return st

    async def observe(self, job: dict, pods: list[dict]) -> MonitorReport:
        """Scrape the job's running pods now and report progress, conditions and new events."""
        meta = job.get("metadata") or {}
        name, namespace = meta.get("name", ""), meta.get("namespace", "default")
        spec = spec_of(job)
        port = spec.metrics_port
        st = self._state(job, spec)
        attempt, running = Group.of(pods).running()
        if running:
            if st.attempt is not None and attempt != st.attempt:
                # A group restart: fresh processes, fresh counters; judge the new attempt on its own.
                st.tracker = health.HealthTracker.for_spec(spec)
                st.prev = None
            st.attempt = attempt
        targets: list[tuple[str, dict]] = []
        by_address = "{ip}" in (self.config.scrape_url_template or DEFAULT_URL_TEMPLATE)
        skipped = 0
        for pod in running:
            if (by_address and self.simulated is not None
                    and await self.simulated((pod.get("spec") or {}).get("nodeName") or "")):
                skipped += 1
                continue
            url = scrape_url(self.config.scrape_url_template, pod=pod, port=port,
                             job_name=name, namespace=namespace)
            if url:
                targets.append((url, pod))
        sem, session = self._client(asyncio.get_running_loop())
        results = await scrape.fetch_all([u for u, _ in targets], concurrency=self.concurrency,
                                         timeout=self.timeout, semaphore=sem, session=session,
                                         max_bytes=self.max_body_bytes)
        now = self.clock()
        samples: dict[int, RankSample] = {}
        failing = set()
        first_error = ""
        answered = []
        for (url, pod), res in zip(targets, results):
            pod_name = (pod.get("metadata") or {}).get("name", "")
            if res.text is None:
                failing.add(pod_name)
                if res.oversized:
                    # Named every time: an oversized body is a pod misbehaving, not a network blip.
                    log.warning("metrics of %s/%s at %s exceed the %d-byte cap; scrape dropped",
                                namespace, pod_name, url, self.max_body_bytes)
                if pod_name not in st.failing and not first_error:
                    first_error = f"{pod_name} ({url}): {res.error}"
                continue
            answered.append((url, pod, pod_name, res.text))
        parsed_all = await scrape.parse_all_async([text for *_, text in answered])
        fresh: list[tuple[str, str, str | None]] = []
        for (url, pod, pod_name, _), parsed in zip(answered, parsed_all):
            if isinstance(parsed, Exception):
                failing.add(pod_name)
                log.warning("bad metrics from %s/%s: %s", namespace, pod_name, parsed)
                continue
            node = (pod.get("spec") or {}).get("nodeName")
            for s in parsed.values():
                s.pod, s.node = pod_name, node
            samples.update(parsed)
            newest = max((float(c["time"]) for s in parsed.values() for c in s.stack_captures), default=0.0)
            if newest > st.stacks_seen.get(pod_name, 0.0):
                fresh.append((url, pod_name, node))
        stacks = await self._stacks(st, fresh, sem, session) if fresh else []
        if first_error:
            # One line per job, not per pod (800 pods would give 800 lines), when pods start failing.
            log.info("scrape of %s/%s: %d of %d pod(s) failed, e.g. %s", namespace, name, len(failing),
                     len(targets), first_error)
        st.failing = failing

        events: list[tuple[str, str, str]] = []
        prog = None
        if samples:
            prog = _finite_only(progress.compute_progress(samples, now=now, prev=st.prev)) or None
            st.prev = (now, samples)
            for f in st.tracker.update(samples, now):
                events.append(_event(f))
        elif skipped:
            prog = {"unavailable": SIMULATED_UNAVAILABLE.format(n=skipped)}
        # Nothing scraped yet (e.g. endpoints unreachable): claim no health either way, so jobs whose
        # metrics cannot be read cost no status write per scrape and show no false "Progressing".
        conditions = self._conditions(job, st, now) if st.prev is not None or st.tracker.active else []
        runs = [(s.mlflow_run_id, s.mlflow_experiment_id) for _, s in sorted(samples.items())
                if s.mlflow_run_id and s.mlflow_experiment_id]
        return MonitorReport(progress=prog, conditions=conditions, events=events,
                             stalled=Signal.STALLED in st.tracker.active,
                             hang_overdue=Signal.STALLED in st.tracker.active and st.tracker.overdue,
                             unreachable=bool(targets) and not samples,
                             mlflow_run=runs[0] if runs else None,
                             ranks=samples, stacks=stacks)

    def _conditions(self, job: dict, st: _JobState, now: float) -> list[dict]:
        """Straggler and Stalled, keeping lastTransitionTime when the status did not change."""
        existing = {c.get("type"): c for c in (job.get("status") or {}).get("conditions") or []}
        out = []
        for kind in CONDITION_TYPES:
            f = st.tracker.active.get(kind)
            if f is not None:
                status, reason, message = "True", f.reason, f.message
            elif kind == Signal.STALLED:
                # Before the first step: False with reason Starting (not Unknown): the operator does
                # see the job, and knows it has not been stuck in one stage past the timeout.
                status, (reason, message) = "False", st.tracker.calm_condition()
            else:
                status, (reason, message) = "False", _NO_STRAGGLER
            old = existing.get(kind)
            if old and old.get("status") == status and old.get("lastTransitionTime"):
                since = old["lastTransitionTime"]
            else:
                since = format_time(now)
            out.append({"type": kind, "status": status, "reason": reason, "message": message,
                        "lastTransitionTime": since})
        return out


_INT64_MAX = 2**63 - 1


def _finite_only(value):
    """`value` without NaN/±Inf floats or ints past int64: the API server rejects a status patch
    carrying them, and a rejected patch must never be something a pod's metrics can cause."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value if abs(value) <= _INT64_MAX else None
    if isinstance(value, dict):
        out = {k: _finite_only(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not None or value[k] is None}
    if isinstance(value, list):
        return [v for v in (_finite_only(x) for x in value) if v is not None]
    return value


# The Event's reason when a finding clears.
_CLEARED: dict[str, str] = {Signal.STRAGGLER: Reason.STRAGGLER_RECOVERED, Signal.STALLED: Reason.RESUMED}


def _event(f: health.Finding) -> tuple[str, str, str]:
    """A finding as an Event: Warning when a problem starts, Normal when it clears."""
    if f.active:
        return ("Warning", f.kind, f.message)
    return ("Normal", _CLEARED.get(f.kind, f.reason), f.message)
