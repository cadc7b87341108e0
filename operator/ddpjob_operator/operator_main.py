"""`ddpjob operator`: configure kopf and run the reconciler until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import logging

import kopf
from kopf._core.engines.peering import detect_own_id  # kopf's own id, shared with our peering check

from kubernetes.config import ConfigException

from .config import OperatorConfig
from .controller import Reconciler
from .handlers import register
from .k8s import COMPONENT, K8s
from .operator_metrics import OperatorMetrics

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
    settings.peering.standalone = not cfg.peering
    if cfg.peering:
        settings.peering.name = cfg.peering
        settings.peering.priority = cfg.priority
        # Auto-detect: peer through the KopfPeering CRDs when installed (the Helm chart does),
        # run alone otherwise, so `ddpjob operator` works on a bare cluster too.
        settings.peering.mandatory = False
        settings.peering.clusterwide = cfg.all_namespaces
    return settings


def run_operator(cfg: OperatorConfig) -> int:
    """Run until stopped; returns the process exit code."""
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:
        # kopf logs every handler call at INFO ("Handler ... succeeded"): thousands of lines per job.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics = OperatorMetrics()
    try:
        metrics.serve(cfg.metrics_port)
        k8s = K8s()
    except OSError as exc:
        log.error("cannot serve metrics on port %s: %s", cfg.metrics_port, exc)
        return 2
    except ConfigException as exc:
        log.error("no Kubernetes credentials: neither in-cluster config nor a kubeconfig (%s)", exc)
        return 2
    namespaces = () if cfg.all_namespaces else (cfg.namespaces or ("default",))
    log.info("ddpjob operator: namespaces=%s peering=%s metrics=:%s health=:%s/healthz",
             "ALL" if cfg.all_namespaces else ",".join(namespaces), cfg.peering or "standalone",
             cfg.metrics_port, cfg.health_port)
    registry = kopf.OperatorRegistry()

    async def main() -> None:
        reconciler = Reconciler(cfg, k8s, metrics)
        register(registry, reconciler)
        identity = detect_own_id(manual=False)
        reconciler.identity = identity
        await kopf.operator(
            registry=registry,
            settings=operator_settings(cfg),
            standalone=not cfg.peering,
            priority=cfg.priority,
            clusterwide=cfg.all_namespaces,
            namespaces=namespaces,
            identity=identity,
            liveness_endpoint=f"http://0.0.0.0:{cfg.health_port}/healthz" if cfg.health_port else None,
        )

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0
