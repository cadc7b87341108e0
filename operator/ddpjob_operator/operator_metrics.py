"""ddpjob_operator_* Prometheus metrics (CONTRACT prefix), served on --metrics-port."""
from __future__ import annotations

from prometheus_client import REGISTRY, disable_created_metrics, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .phases import Phase

# The *_created series only double the output; nothing here reads them.
disable_created_metrics()


class OperatorMetrics:
    """The operator's own metrics; one instance per process (or per test registry)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.registry = registry
        self.jobs = Gauge("ddpjob_operator_jobs", "DDPJobs known to this operator, by phase",
                          ["phase"], registry=registry)
        self.created = Counter("ddpjob_operator_jobs_created_total", "DDPJobs first seen", registry=registry)
        self.succeeded = Counter("ddpjob_operator_jobs_succeeded_total", "DDPJobs that succeeded",
                                 registry=registry)
        self.failed = Counter("ddpjob_operator_jobs_failed_total", "DDPJobs that failed, by reason",
                              ["reason"], registry=registry)
        self.restarted = Counter("ddpjob_operator_jobs_restarted_total", "Group restarts, by reason",
                                 ["reason"], registry=registry)
        self.pods_created = Counter("ddpjob_operator_pods_created_total", "Pods created", registry=registry)
        self.pods_deleted = Counter("ddpjob_operator_pods_deleted_total", "Pods deleted", registry=registry)
        self.reconcile_seconds = Histogram(
            "ddpjob_operator_reconcile_seconds", "Duration of one reconcile pass",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=registry)
        self.reconcile_errors = Counter("ddpjob_operator_reconcile_errors_total", "Failed reconcile passes",
                                        registry=registry)
        self._phases: dict[tuple[str, str], str] = {}
        for phase in Phase:
            self.jobs.labels(phase.value).set(0)

    def set_phase(self, key: tuple[str, str], phase: str | None) -> None:
        """Record a job's phase (None forgets the job) and refresh the by-phase gauge."""
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        counts = {p.value: 0 for p in Phase}
        for value in self._phases.values():
            counts[value] = counts.get(value, 0) + 1
        for value, count in counts.items():
            self.jobs.labels(value).set(count)

    def serve(self, port: int) -> None:
        """Expose /metrics on 0.0.0.0:port (0 = do not serve)."""
        if port:
            start_http_server(port, registry=self.registry)
