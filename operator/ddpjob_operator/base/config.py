"""Operator-level settings (CLI flags, each also settable by a DDPJOB_* env var)."""
from __future__ import annotations

from dataclasses import dataclass

# The choices of --log-level and --log-format (the chart's values.schema.json enums are held to these).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class OperatorConfig:
    """What one operator process is told at start; immutable for its lifetime."""

    namespaces: tuple[str, ...] = ()          # empty needs all_namespaces (the CLI refuses neither)
    all_namespaces: bool = False
    metrics_port: int = 8080                  # ddpjob_operator_* exposition
    health_port: int = 8081                   # liveness endpoint (/healthz)
    default_runtime_class: str = "nvidia"     # used when gpusPerNode > 0 and the job sets none
    cluster_domain: str = ""                  # "" -> <pod>.<svc>.<ns>.svc (resolv.conf search does the rest)
    scrape_interval: float = 15.0             # seconds between progress scrapes of running jobs
    # seconds between writes of a running job's status.progress (a change of phase or of a
    # condition is written at once, with the freshest progress)
    progress_interval: float = 30.0
    # Tests and local runs point the scraper at localhost: a str.format template with
    # {pod}, {rank}, {ip}, {port}, {namespace}, {job}; empty -> http://{ip}:{port}/metrics
    scrape_url_template: str = ""
    unschedulable_timeout: float = 300.0      # seconds Pending+Unschedulable before a condition
    peering: str = "ddpjob"                   # kopf peering name; "" -> standalone
    priority: int = 0                         # kopf peering priority (HA replicas differ)
    log_level: str = "INFO"
    log_format: str = "text"                  # json: one object per line, for log pipelines
    # spec.trainer.mlflow.trackingUri of a job that names none (a platform team's one server); "": none
    mlflow_tracking_uri: str = ""
