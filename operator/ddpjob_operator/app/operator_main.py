"""`ddpjob operator`: configure kopf and run the reconciler until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import getpass
import logging
import os
import secrets

import kopf
from kubernetes.config import ConfigException
from prometheus_client import Counter

from ddpjob_operator.cluster.cache import PeerGate, Store, peering_informers, pod_informers, pod_store
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.app.controller import Reconciler
from ddpjob_operator.app.handlers import WatchOnlyDiffBase, register
from ddpjob_operator.cluster.k8s import COMPONENT, K8s
from ddpjob_operator.app.operator_metrics import OperatorMetrics

log = logging.getLogger("ddpjob.operator")


def operator_settings(cfg: OperatorConfig) -> kopf.OperatorSettings:
    """kopf settings: bounded watches, quiet event posting, peering per the flags."""
    settings = kopf.OperatorSettings()
    # Watches end server-side after server_timeout; the client gives up a bit later, so a
    # silently dead connection (NAT, apiserver restart) never hangs the operator.
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 60
    # We post our own transition events; kopf only posts its warnings and errors.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = COMPONENT
    # No CRD/namespace scanning: fewer RBAC rules; the namespaces are given explicitly.
    settings.scanning.disabled = True
    # Our handlers read no diffs: kopf need not copy each event's body to build one.
    settings.persistence.diffbase_storage = WatchOnlyDiffBase()
    settings.peering.standalone = not cfg.peering
    if cfg.peering:
        settings.peering.name = cfg.peering
        settings.peering.priority = cfg.priority
        # Auto-detect: peer through the KopfPeering CRDs when installed (the Helm chart does),
        # run alone otherwise, so `ddpjob operator` works on a bare cluster too.
        settings.peering.mandatory = False
        settings.peering.clusterwide = cfg.all_namespaces
    return settings


def own_identity() -> str:
    """This process's name in the peering object (given to kopf, and skipped by our gate):
    the pod's name when set (POD_ID, as kopf reads it), else user@host/pid-random."""
    return os.environ.get("POD_ID") or f"{getpass.getuser()}@{os.uname().nodename}/{os.getpid()}-{secrets.token_hex(3)}"


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_handler(fmt: str) -> logging.Handler:
    """stderr, as text or as one JSON object per line (time, level, logger, message, and the
    object a kopf line is about): the format log pipelines (Loki, Cloud Logging) parse."""
    handler = logging.StreamHandler()
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter  # kopf's own dependency
        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                           rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    return handler


def run_operator(cfg: OperatorConfig) -> int:
    """Run until stopped; returns the process exit code."""
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()), handlers=[log_handler(cfg.log_format)])
    if logging.getLogger().level > logging.DEBUG:
        # kopf logs every handler call at INFO ("Handler ... succeeded"): thousands of lines per job.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    namespaces = () if cfg.all_namespaces else cfg.namespaces
    # Series of the watched namespaces exist at 0 from the start (a replica that never acts shows 0).
    metrics = OperatorMetrics(namespaces=namespaces)
    try:
        requests = Counter("ddpjob_operator_api_requests_total",
                           "Requests this operator sent to the API server (kopf's own DDPJob list/watch "
                           "excepted), by verb and resource", ["verb", "resource"], registry=metrics.registry)
        metrics.serve(cfg.metrics_port)
        k8s = K8s(on_request=lambda verb, resource: requests.labels(verb, resource).inc())
    except OSError as exc:
        log.error("cannot serve metrics on port %s: %s", cfg.metrics_port, exc)
        return 2
    except ConfigException as exc:
        log.error("no Kubernetes credentials: neither in-cluster config nor a kubeconfig (%s)", exc)
        return 2
    log.info("ddpjob operator: namespaces=%s peering=%s metrics=:%s health=:%s/healthz",
             "ALL" if cfg.all_namespaces else ",".join(namespaces), cfg.peering or "standalone",
             cfg.metrics_port, cfg.health_port)
    registry = kopf.OperatorRegistry()

    async def main() -> None:
        identity = own_identity()
        scope = None if cfg.all_namespaces else tuple(namespaces)
        pods = pod_store()
        informers = pod_informers(k8s, pods, scope)
        gate = None
        if cfg.peering:
            peers = Store()
            informers += peering_informers(k8s, peers, cfg.peering, scope)
            gate = PeerGate(peers, identity=identity, priority=cfg.priority)
        reconciler = Reconciler(cfg, k8s, metrics, pods=pods, gate=gate)
        register(registry, reconciler, informers=informers)
        await kopf.operator(
            registry=registry,
            settings=operator_settings(cfg),
            standalone=not cfg.peering,
            priority=cfg.priority,
            clusterwide=cfg.all_namespaces,
            namespaces=namespaces,
            identity=identity,  # type: ignore[arg-type]  # kopf's Identity: a NewType of str
            liveness_endpoint=f"http://0.0.0.0:{cfg.health_port}/healthz" if cfg.health_port else None,
        )

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0
