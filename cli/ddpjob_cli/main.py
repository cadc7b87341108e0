"""`ddpjob` command line: run (local), render, operator, and the cluster commands (jobs.py)."""
from __future__ import annotations

import sys

import click

from ddpjob_operator.base.config import LOG_FORMATS, LOG_LEVELS, OperatorConfig

# The flags' defaults are OperatorConfig's: one place (the chart's values.yaml is checked against it).
_OP = OperatorConfig()


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("ddpjob")
    except metadata.PackageNotFoundError:  # imported from a source tree, not installed
        return "unknown (not installed)"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=_version(), prog_name="ddpjob", message="%(prog)s %(version)s")
def main() -> None:
    """DDPJob: multi-node PyTorch DDP on Kubernetes, and the same job on this machine."""


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--local", "local", is_flag=True, required=True,
              help="Run the job's nodes as processes on this machine (the only mode so far).")
@click.option("--summary-json", type=click.Path(dir_okay=False), default=None,
              help="Write the run's summary (phase, world size, accuracy, ...) here.")
@click.option("--metrics-port-base", type=int, default=None,
              help="Node N serves its metrics on this port + N (default: free ports).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Where logs and relative checkpoint dirs go (default: a temp dir).")
@click.option("--no-progress", is_flag=True, help="Plain log lines instead of a progress bar.")
def run(file, local, summary_json, metrics_port_base, workdir, no_progress) -> None:
    """Run the DDPJob in FILE; exit 0 only when it succeeded."""
    from .local import run_local

    sys.exit(run_local(file, summary_json=summary_json, metrics_port_base=metrics_port_base,
                       workdir=workdir, progress=not no_progress))


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--namespace", "-n", default=None, help="Namespace when the file names none.")
def render(file, namespace) -> None:
    """Print the Service and Pods the operator would create for FILE (YAML)."""
    from ddpjob_operator.builders.render import render_file

    click.echo(render_file(file, namespace=namespace), nl=False)


@main.command()
@click.option("--namespace", "-n", "namespaces", multiple=True, envvar="DDPJOB_NAMESPACES",
              help="Watch this namespace (repeatable).")
@click.option("--all-namespaces", "-A", is_flag=True, envvar="DDPJOB_ALL_NAMESPACES")
@click.option("--metrics-port", type=int, default=_OP.metrics_port, envvar="DDPJOB_OPERATOR_METRICS_PORT", show_default=True)
@click.option("--health-port", type=int, default=_OP.health_port, envvar="DDPJOB_HEALTH_PORT", show_default=True)
@click.option("--default-runtime-class", default=_OP.default_runtime_class, envvar="DDPJOB_DEFAULT_RUNTIME_CLASS", show_default=True)
@click.option("--cluster-domain", default=_OP.cluster_domain, envvar="DDPJOB_CLUSTER_DOMAIN")
@click.option("--scrape-interval", type=float, default=_OP.scrape_interval, envvar="DDPJOB_SCRAPE_INTERVAL", show_default=True)
@click.option("--progress-interval", type=click.FloatRange(min=0), default=_OP.progress_interval,
              envvar="DDPJOB_PROGRESS_INTERVAL", show_default=True,
              help="Seconds between writes of a running job's status.progress; a phase or condition "
                   "change is written at once.")
@click.option("--scrape-url-template", default=_OP.scrape_url_template, envvar="DDPJOB_SCRAPE_URL_TEMPLATE",
              help="Override where pod metrics are scraped; placeholders {pod} {rank} {ip} {port} "
                   "{rank_port} (= metricsPort + node rank) {namespace} {job}, "
                   "e.g. http://127.0.0.1:{rank_port}/metrics")
@click.option("--unschedulable-timeout", type=float, default=_OP.unschedulable_timeout, envvar="DDPJOB_UNSCHEDULABLE_TIMEOUT", show_default=True)
@click.option("--peering", default=_OP.peering, envvar="DDPJOB_PEERING", show_default=True,
              help="kopf peering name; empty for standalone.")
@click.option("--priority", type=int, default=_OP.priority, envvar="DDPJOB_PRIORITY", show_default=True)
@click.option("--mlflow-tracking-uri", default=_OP.mlflow_tracking_uri, envvar="DDPJOB_MLFLOW_TRACKING_URI",
              help="MLflow tracking URI of jobs whose spec.trainer.mlflow names none (they opt in with mlflow: {}).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default=_OP.log_level,
              envvar="DDPJOB_LOG_LEVEL", show_default=True)
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default=_OP.log_format, envvar="DDPJOB_LOG_FORMAT",
              show_default=True, help="json: one object per line (time, level, logger, message).")
def operator(namespaces, all_namespaces, **opts) -> None:
    """Run the operator against the current kubeconfig (or in-cluster config)."""
    from ddpjob_operator.app.operator_main import run_operator

    namespaces = tuple(n for ns in namespaces for n in ns.split(",") if n)
    if not namespaces and not all_namespaces:
        # Watching one namespace nobody named (kubectl's "default") would leave every job in the
        # others silently unreconciled.
        raise click.UsageError("name what to watch: --namespace/-n NS (repeatable, or comma-separated) "
                               "or --all-namespaces/-A")
    if namespaces and all_namespaces:
        raise click.UsageError("--namespace and --all-namespaces exclude each other")
    opts["log_level"] = opts["log_level"].upper()
    cfg = OperatorConfig(namespaces=namespaces, all_namespaces=all_namespaces, **opts)
    sys.exit(run_operator(cfg))


def _add_cluster_commands() -> None:
    from .jobs import COMMANDS

    for command in COMMANDS:
        main.add_command(command)


_add_cluster_commands()
