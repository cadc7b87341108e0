"""ddpjob_operator_* Prometheus metrics, served on --metrics-port.

Every series carries `namespace` (as Kubeflow's `job_namespace`); per-job gauges also carry
`ddpjob` (one series per existing job, removed with it). Counters' labelled series are born at 0
(all known reasons, as soon as a namespace is known) so that `increase()` counts the first event;
so are the recovery histograms' (each kind of restart: decisions/inplace's InPlace, Group and Replace).
The scrape gauges (SCRAPE_GAUGES) say what the latest scrape of each Running job read, fresher than
status.progress (written once per progress interval) and at no write: one series per Running job
whatever its rank count (100 jobs of 256 ranks: 100 per gauge), removed when it stops running;
per-rank series are the ranks' own (`ddpjob_trainer_*`, scraped from the pods).
"""
from __future__ import annotations

import collections
import contextlib
import datetime as dt
import time
from typing import Any, Iterable

from prometheus_client import REGISTRY, disable_created_metrics, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from ddpjob_api.contract import GOODPUT_CATEGORIES
from ddpjob_api.phases import Cond, FailReason, Phase, Recovery, RestartReason
from ddpjob_operator.decisions import inplace, progress
from ddpjob_operator.decisions.lifecycle import INIT_START_ERRORS
from ddpjob_operator.base.objmeta import parse_time
from ddpjob_operator.decisions.samples import MonitorReport

# The *_created series only double the output; nothing here reads them.
disable_created_metrics()

# status.reason of a Failed job (lifecycle.decide, status.create_refused) and Failure.reason of a
# group restart: every one is a 0-valued series from the start.
FAILURE_REASONS = tuple(sorted({*(r.value for r in FailReason),
                                Cond.FAILED_CREATE_POD.value} | INIT_START_ERRORS))
RESTART_REASONS = tuple(r.value for r in RestartReason)
RECOVERY_KINDS = (Recovery.IN_PLACE, Recovery.GROUP, Recovery.REPLACE)
# In place aims at seconds, a group restart takes minutes (pods deleted, scheduled, pulled).
RECOVERY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
# 0 is a bucket of its own: a resume from the step it failed at lost nothing.
STEPS_LOST_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)
Key = tuple[str, str]   # (namespace, name)
# What the latest scrape of a Running job found: gauge suffix -> help.
SCRAPE_GAUGES = {
    "step": "The slowest rank's step at the operator's latest scrape of each Running DDPJob",
    "slowest_rank": "The rank furthest behind at that scrape (the lowest on ties)",
    "steps_behind": "Steps the slowest rank is behind the rank furthest ahead, at that scrape",
    "samples_per_second": "Samples per second of all ranks together, at that scrape",
    "ranks_reporting": "Ranks whose metrics that scrape read",
    "scrape_timestamp_seconds": "Unix time of the operator's latest scrape that read any rank (its age: time() - this)",
}


class _Series:
    """One series of a JobGauge, as prometheus_client's `gauge.labels(...)` hands out."""

    __slots__ = ("_values", "_key")

    def __init__(self, values: dict[tuple[str, ...], float], key: tuple[str, ...]) -> None:
        self._values, self._key = values, key

    def set(self, value: float) -> None:
        self._values[self._key] = float(value)


class JobGauge:
    """A gauge with a series per DDPJob, its values kept as plain floats by label values and turned
    into samples when /metrics is read. A prometheus_client Gauge child holds 590-750 bytes (its
    locks, its value object, its dicts: tracemalloc of the operator at 2,000 and 6,000 pods, and of
    tests/unit/test_operator_metrics.py's 1,000 series), a float here under 200; the operator keeps
    some 17 per-job series: 0.7 KiB per pod of a 10-pod job. Same use as a Gauge:
    `.labels(*values).set(v)`, `.remove(*values)` (KeyError when absent)."""

    def __init__(self, name: str, documentation: str, labelnames: list[str], *, registry: CollectorRegistry) -> None:
        self._name, self._doc, self._labelnames = name, documentation, labelnames
        self._values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Series:
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: {len(self._labelnames)} label values, got {values}")
        return _Series(self._values, tuple(map(str, values)))

    def remove(self, *values: str) -> None:
        del self._values[tuple(map(str, values))]

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._doc, labels=self._labelnames)
        # dict() copies in one step under the GIL: the loop's thread may set a series meanwhile.
        for values, value in dict(self._values).items():
            family.add_metric(list(values), value)
        yield family


class OperatorMetrics:
    """The operator's own metrics; one instance per process (or per test registry)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, *, namespaces: Iterable[str] = ()):
        self.registry = registry
        self.jobs = Gauge("ddpjob_operator_jobs", "DDPJobs known to this operator, by namespace and phase",
                          ["namespace", "phase"], registry=registry)
        self.jobs_created = Counter("ddpjob_operator_jobs_created_total", "DDPJobs first seen",
                                    ["namespace"], registry=registry)
        self.jobs_succeeded = Counter("ddpjob_operator_jobs_succeeded_total", "DDPJobs that succeeded",
                                      ["namespace"], registry=registry)
        self.jobs_failed = Counter("ddpjob_operator_jobs_failed_total", "DDPJobs that failed, by reason",
                                   ["namespace", "reason"], registry=registry)
        self.jobs_restarted = Counter("ddpjob_operator_jobs_restarted_total", "Group restarts, by reason",
                                      ["namespace", "reason"], registry=registry)
        self.pods_created_total = Counter("ddpjob_operator_pods_created_total", "Pods created",
                                          ["namespace"], registry=registry)
        self.pods_deleted_total = Counter("ddpjob_operator_pods_deleted_total", "Pods deleted",
                                          ["namespace"], registry=registry)
        self.hang_timeout = JobGauge(
            "ddpjob_operator_job_hang_timeout_seconds",
            "spec.hangTimeoutSeconds of each DDPJob that sets it (the DDPJobStalled alert's threshold)",
            ["namespace", "ddpjob"], registry=registry)
        self.failed_at = JobGauge(
            "ddpjob_operator_job_failed_timestamp_seconds",
            "Unix time each existing failed DDPJob failed (status.completionTime), by reason",
            ["namespace", "ddpjob", "reason"], registry=registry)
        self.pending_since = JobGauge(
            "ddpjob_operator_job_pending_since_timestamp_seconds",
            "Unix time each Pending DDPJob began waiting for its pods (status.startTime: its start, resume or "
            "Kueue admission); none while Kueue holds it in a queue. The DDPJobPendingTooLong alert",
            ["namespace", "ddpjob"], registry=registry)
        self.recovery_seconds = Histogram(
            "ddpjob_operator_recovery_seconds", "Seconds from a worker or pod failure to the first step every rank "
            "took after it (status.restartHistory's recoverySeconds), by kind of restart (InPlace, Group, Replace)",
            ["namespace", "kind"], buckets=RECOVERY_BUCKETS, registry=registry)
        self.recovery_steps_lost = Histogram(
            "ddpjob_operator_recovery_steps_lost", "Steps done again after a restart (the step reached at the failure "
            "less the step resumed from: status.restartHistory's stepsLost), by kind of restart (InPlace, Group, Replace)",
            ["namespace", "kind"], buckets=STEPS_LOST_BUCKETS, registry=registry)
        self.reconcile_seconds = Histogram(
            "ddpjob_operator_reconcile_seconds", "Duration of one reconcile pass",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=registry)
        self.reconcile_errors = Counter("ddpjob_operator_reconcile_errors_total", "Failed reconcile passes",
                                        registry=registry)
        self.goodput_ratio = JobGauge(
            "ddpjob_operator_job_goodput_ratio", "Training's share of each DDPJob's wall time so far "
            "(status.goodput.ratio: decisions/goodput.py, docs/goodput.md)", ["namespace", "ddpjob"], registry=registry)
        self.goodput_seconds = JobGauge(
            "ddpjob_operator_job_goodput_seconds", "Seconds of each DDPJob's wall time so far by category "
            "(status.goodput.seconds: queued, starting, training, checkpointing, evaluating, recovering, recomputing, "
            "stalled, suspended; they sum to its wall time)", ["namespace", "ddpjob", "category"], registry=registry)
        self.scraped = {name: JobGauge(f"ddpjob_operator_job_{name}", text, ["namespace", "ddpjob"], registry=registry)
                        for name, text in SCRAPE_GAUGES.items()}
        self._phases: dict[Key, str] = {}
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()   # (namespace, phase): jobs
        self._failed: dict[Key, str] = {}
        self._pending: dict[Key, float] = {}
        self._namespaces: set[str] = set()
        for ns in namespaces:
            self.namespace_seen(ns)

    def namespace_seen(self, namespace: str) -> None:
        """Create this namespace's series at 0 (once)."""
        if namespace in self._namespaces:
            return
        self._namespaces.add(namespace)
        for phase in Phase:
            self.jobs.labels(namespace, phase.value).set(0)
        for counter in (self.jobs_created, self.jobs_succeeded, self.pods_created_total, self.pods_deleted_total):
            counter.labels(namespace)
        for reason in FAILURE_REASONS:
            self.jobs_failed.labels(namespace, reason)
        for reason in RESTART_REASONS:
            self.jobs_restarted.labels(namespace, reason)
        for kind in RECOVERY_KINDS:
            self.recovery_seconds.labels(namespace, kind)
            self.recovery_steps_lost.labels(namespace, kind)

    def set_phase(self, key: Key, phase: str | None) -> None:
        """Record a job's phase (None forgets the job and its per-job series). Only the counts of
        its old and new phase change: every pass calls this, and counting every job's phase again
        made a pass's cost grow with the number of jobs (15 % of the operator's time while 1,000
        jobs came up, bench/results/operator_scale_profile/)."""
        old = self._phases.get(key)
        if phase is None:
            self._phases.pop(key, None)
            self._forget_job(key)
        else:
            self.namespace_seen(key[0])
            self._phases[key] = phase
        if phase == old:
            return
        for value, change in ((old, -1), (phase, 1)):
            if value is not None:
                self._counts[(key[0], value)] += change
                self.jobs.labels(key[0], value).set(self._counts[(key[0], value)])

    def record_scrape(self, key: Key, report: MonitorReport, *, when: float) -> None:
        """A Running job's scrape: its gauges now say what it read (a scrape that read no rank
        leaves them as they were; the timestamp tells how old they are)."""
        lag = progress.laggard(report.ranks)
        if lag is None:
            return
        prog = report.progress or {}
        values = {"step": prog.get("step"), "slowest_rank": lag[0], "steps_behind": lag[1],
                  "samples_per_second": prog.get("samplesPerSecond"), "ranks_reporting": len(report.ranks),
                  "scrape_timestamp_seconds": when}
        for name, value in values.items():
            if value is None:
                self._remove(self.scraped[name], key)
            else:
                self.scraped[name].labels(*key).set(float(value))

    def forget_scrape(self, key: Key) -> None:
        """The job stopped running or is gone: no scrape gauges for it."""
        for gauge in self.scraped.values():
            self._remove(gauge, key)

    def _forget_job(self, key: Key) -> None:
        self.forget_scrape(key)
        self._remove(self.goodput_ratio, key)
        for category in GOODPUT_CATEGORIES:
            self._remove(self.goodput_seconds, key + (category,))
        self._forget_pending(key)
        self._remove(self.hang_timeout, key)
        self._remove(self.failed_at, key + (self._failed.pop(key, ""),))

    def record_pass(self, key: Key, *, prev_status: dict[str, Any], status: dict[str, Any],
                    restarted: str | None = None, hang_timeout: float | None = None) -> None:
        """Everything one reconcile pass of job `key` tells the metrics: its phase, the counters
        for what changed (first sight, success, failure, a group restart, a recovery), its per-job gauges."""
        ns = key[0]
        phase, old = status.get("phase"), prev_status.get("phase")
        self.set_phase(key, phase)
        if old is None:
            self.jobs_created.labels(ns).inc()
        if phase != old and phase == Phase.SUCCEEDED.value:
            self.jobs_succeeded.labels(ns).inc()
        reason = str(status.get("reason") or "Failed")
        if phase != old and phase == Phase.FAILED.value:
            self.jobs_failed.labels(ns, reason).inc()
        if restarted is not None:
            self.jobs_restarted.labels(ns, restarted).inc()
        for kind, seconds, lost in inplace.recoveries(prev_status, status):
            self.recovery_seconds.labels(ns, kind).observe(seconds)
            if lost is not None:
                self.recovery_steps_lost.labels(ns, kind).observe(lost)
        if hang_timeout is not None:
            self.hang_timeout.labels(*key).set(float(hang_timeout))
        else:
            self._remove(self.hang_timeout, key)
        self._track_pending(key, status)
        ledger = status.get("goodput") or {}
        if ledger.get("seconds"):  # computed in every pass, written or not: fresher than the status
            self.goodput_ratio.labels(*key).set(float(ledger.get("ratio") or 0.0))
            for category in GOODPUT_CATEGORIES:
                self.goodput_seconds.labels(*key, category).set(float(ledger["seconds"].get(category) or 0.0))
        if phase == Phase.FAILED.value and self._failed.get(key) != reason:
            self._remove(self.failed_at, key + (self._failed.pop(key, ""),))
            when = parse_time(status.get("completionTime")) or dt.datetime.now(dt.timezone.utc)
            self.failed_at.labels(*key, reason).set(when.timestamp())
            self._failed[key] = reason

    def _track_pending(self, key: Key, status: dict[str, Any]) -> None:
        """pending_since while the job is Pending and not queued: from status.startTime (so an operator
        restart keeps it), else from when this process first saw it waiting."""
        # Kueue's gate holds the pods on purpose (kueue.admission's reason Queued): waiting in a queue
        # is no stuck job; the clock starts at admission, which is where startTime moves to.
        queued = any(c.get("type") == Cond.ADMITTED and c.get("reason") == "Queued"
                     for c in status.get("conditions") or [])
        if status.get("phase") != Phase.PENDING.value or queued:
            self._forget_pending(key)
            return
        started = parse_time(status.get("startTime"))
        since = started.timestamp() if started else self._pending.get(key, time.time())
        self._pending[key] = since
        self.pending_since.labels(*key).set(since)

    def _forget_pending(self, key: Key) -> None:
        if self._pending.pop(key, None) is not None:
            self._remove(self.pending_since, key)

    @staticmethod
    def _remove(gauge: Gauge | JobGauge, labels: tuple[str, ...]) -> None:
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)

    def count_pods(self, namespace: str, *, created: int = 0, deleted: int = 0) -> None:
        """Pods this pass created / deleted in `namespace`."""
        self.namespace_seen(namespace)
        if created:
            self.pods_created_total.labels(namespace).inc(created)
        if deleted:
            self.pods_deleted_total.labels(namespace).inc(deleted)

    def serve(self, port: int) -> None:
        """Expose /metrics on 0.0.0.0:port (0 = do not serve)."""
        if port:
            start_http_server(port, registry=self.registry)
