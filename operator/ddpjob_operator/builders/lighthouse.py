"""A per-step job's torchft Lighthouse: its pod and the Service its replica groups reach it by
(pure builders).

The Lighthouse runs in a small pod of its own, not in a training pod that may be the one lost. It
keeps no state worth keeping (the groups' membership, rebuilt from their next heartbeats), so the
kubelet restarts a crashed one in place (restartPolicy Always) and the operator recreates a deleted
one (decisions/lifecycle.lighthouse). It carries the job-name label, so the operator's pod watch
sees it, and role=lighthouse, so nothing that selects training pods does (labels.ROLE).
"""
from __future__ import annotations

from typing import Any

from ddpjob_api import contract, labels
from ddpjob_api.names import lighthouse_name
from ddpjob_api.spec import JobSpec
from ddpjob_operator.builders import template
from ddpjob_operator.builders.pods import CONTAINER_SECURITY_DEFAULTS, POD_SECURITY_DEFAULTS
from ddpjob_operator.builders.service import child_metadata

CONTAINER = "lighthouse"
PORT_NAME = "lighthouse"
ID_PORT_NAME = "lighthouse-id"
# How often the Lighthouse checks whether a quorum can be issued (torchft's default).
QUORUM_TICK_MS = 100
# It keeps nothing to flush: its groups rebuild its state with their next heartbeats.
GRACE_SECONDS = 5
# The Lighthouse serves a few heartbeats per group and second, and its id once per rank and step:
# no GPU, a sliver of a core. But torchft's package imports torch: about 0.5 GiB in use once started (the trainer image, measured on the real nodes), and a 256Mi limit had it
# OOM-killed in a crash loop before it ever listened.
RESOURCES: dict[str, Any] = {"requests": {"cpu": "50m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}


# A group is counted gone once its heartbeats stop for this share of timeoutSeconds. A survivor's
# quorum waits for exactly that: torchft's Lighthouse forms a new one only with more than half of
# the groups that still heartbeat (two groups: the lost one's heartbeats must expire), or after the
# join timeout (three or more). With the whole timeout, a pod killed outright cost its peer 3.35 s
# at the default 3 (bench/perstep_loss.py at 3af1179): its peer's gloo saw the closed connection at
# once and then waited for the Lighthouse. Half still means 15 heartbeats missed at the default:
# torchft's Manager sends one every 0.1 s from a Rust thread that no Python step holds up. A peer
# alive but slow keeps the whole timeoutSeconds in its collectives.
HEARTBEAT_SHARE = 0.5


def lighthouse_command(job: JobSpec) -> list[str]:
    """torchft's Lighthouse with the spec's quorum timing, in our entry point, which also serves the
    id of this incarnation of it (ddpjob_trainer.lighthouse: a recreated Lighthouse starts its
    quorum ids again, and the groups fold the id into them). A survivor's quorum waits up to
    spec.faultTolerance.timeoutSeconds for the groups that still heartbeat (join timeout), and a
    group whose heartbeats stop is gone after HEARTBEAT_SHARE of it (heartbeat timeout): the pause
    a lost group costs the others is bounded by the one timeout the spec sets."""
    ft = job.spec.fault_tolerance
    if ft is None:
        raise ValueError(f"DDPJob {job.namespace}/{job.name} has no spec.faultTolerance: it runs no Lighthouse")
    return ["python", "-m", "ddpjob_trainer.lighthouse", "--min_replicas", str(ft.min_replicas),
            "--quorum_tick_ms", str(QUORUM_TICK_MS), "--join_timeout_ms", str(ft.timeout_seconds * 1000),
            "--heartbeat_timeout_ms", str(round(ft.timeout_seconds * 1000 * HEARTBEAT_SHARE)),
            "--bind", f"0.0.0.0:{contract.FT_LIGHTHOUSE_PORT}", "--id-bind", f"0.0.0.0:{contract.FT_LIGHTHOUSE_ID_PORT}"]


def _security(default: dict[str, Any], *layers: Any) -> dict[str, Any]:
    """The hardened defaults under the job's own keys (template's, then the flat field's), as the
    training pods get them: an image that needs runAsUser says so once, for both."""
    out = dict(default)
    for layer in layers:
        out.update(layer or {})
    return out


def render_lighthouse_pod(job: JobSpec) -> dict[str, Any]:
    """The Lighthouse pod `names.lighthouse_name`: the job's image (the built-in trainer's ships
    torchft), its pod security settings, pull secrets and node placement (nodeSelector, tolerations,
    priority: the nodes the job may use), none of what makes a training pod (GPUs, /dev/shm, the
    one-pod-per-node spread, a gang scheduler, Kueue), no API token."""
    spec, sched, tpl = job.spec, job.scheduling, template.pod_spec(job)
    trainer = template.trainer_container(template.pod_template(job))
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "command": lighthouse_command(job),
        "ports": [{"name": PORT_NAME, "containerPort": contract.FT_LIGHTHOUSE_PORT, "protocol": "TCP"},
                  {"name": ID_PORT_NAME, "containerPort": contract.FT_LIGHTHOUSE_ID_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": PORT_NAME}, "periodSeconds": 2},
        "resources": RESOURCES,
        "securityContext": _security(CONTAINER_SECURITY_DEFAULTS, trainer.get("securityContext"),
                                     spec.security_context),
    }
    if spec.image_pull_policy or trainer.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec.image_pull_policy or trainer.get("imagePullPolicy")
    pod: dict[str, Any] = {
        "restartPolicy": "Always",
        # Not PID 1 (pods.share_process_namespace): PID 1 ignores the SIGTERM it has no handler for,
        # and a deleted Lighthouse would hold its name, so its successor, for the whole grace period.
        "shareProcessNamespace": True,
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": _security(POD_SECURITY_DEFAULTS, tpl.get("securityContext"), spec.pod_security_context),
        "containers": [container],
    }
    placement = {"priorityClassName": sched.priority_class_name or tpl.get("priorityClassName"),
                 "nodeSelector": sched.node_selector or tpl.get("nodeSelector"),
                 "tolerations": sched.tolerations or tpl.get("tolerations"),
                 "imagePullSecrets": (tpl.get("imagePullSecrets") or []) + (spec.image_pull_secrets or [])}
    pod.update({k: v for k, v in placement.items() if v})
    meta = child_metadata(job, lighthouse_name(job), {labels.ROLE: labels.ROLE_LIGHTHOUSE})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod}


def render_lighthouse_service(job: JobSpec) -> dict[str, Any]:
    """The headless Service `names.lighthouse_name` of the Lighthouse pod: the groups reach it by one
    name (names.lighthouse_url), which resolves to whichever pod runs it now, once it is ready.
    Headless, not a ClusterIP: a virtual IP needs kube-proxy (or its like) on every node, and a
    name that resolves straight to the pod does not; torchft's clients resolve it again when they
    reconnect to a recreated Lighthouse."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(job, lighthouse_name(job), {labels.ROLE: labels.ROLE_LIGHTHOUSE}),
        "spec": {
            "clusterIP": "None",
            "selector": {labels.JOB_NAME: job.name, labels.ROLE: labels.ROLE_LIGHTHOUSE},
            "ports": [{"name": PORT_NAME, "port": contract.FT_LIGHTHOUSE_PORT, "targetPort": PORT_NAME,
                       "protocol": "TCP"},
                      {"name": ID_PORT_NAME, "port": contract.FT_LIGHTHOUSE_ID_PORT, "targetPort": ID_PORT_NAME,
                       "protocol": "TCP"}],
        },
    }
