"""A per-step job's torchft Lighthouse (builders/lighthouse.py), and the labels that keep it apart
from the job's training pods."""
from __future__ import annotations

import functools

import pytest

from ddpjob_api import contract, labels
from ddpjob_api.names import lighthouse_id_url, lighthouse_name, lighthouse_url
from ddpjob_operator.base import podinfo
from ddpjob_operator.builders.lighthouse import lighthouse_command, render_lighthouse_pod, render_lighthouse_service
from ddpjob_operator.builders.pods import render_pod
from ddpjob_operator.builders.render import render_objects
from ddpjob_operator.builders.service import render_service
from tests.support.builders import make_job, make_manifest

FT = {"mode": "perStep", "minReplicas": 1, "timeoutSeconds": 3}
job = functools.partial(make_job, "train", namespace="ml", uid="uid-1", image="reg/trainer:1", nodes=2)


def ft_job(**spec):
    return job(faultTolerance={**FT, **spec.pop("faultTolerance", {})}, **spec)


def test_command_carries_the_spec_quorum_timing():
    cmd = lighthouse_command(ft_job(nodes=4, faultTolerance={"minReplicas": 2, "timeoutSeconds": 5}))
    assert cmd == ["python", "-m", "ddpjob_trainer.lighthouse", "--min_replicas", "2", "--quorum_tick_ms", "100",
                   "--join_timeout_ms", "5000", "--heartbeat_timeout_ms", "2500",
                   "--bind", f"0.0.0.0:{contract.FT_LIGHTHOUSE_PORT}",
                   "--id-bind", f"0.0.0.0:{contract.FT_LIGHTHOUSE_ID_PORT}"]


def test_a_job_without_fault_tolerance_has_no_lighthouse_command():
    with pytest.raises(ValueError, match="ml/train has no spec.faultTolerance"):
        lighthouse_command(job())


def test_pod_is_owned_labelled_apart_and_restarts_in_place():
    pod = render_lighthouse_pod(ft_job())
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == lighthouse_name(ft_job()) == "train-ft"
    assert meta["namespace"] == "ml"
    assert meta["ownerReferences"][0]["uid"] == "uid-1" and meta["ownerReferences"][0]["controller"] is True
    # The job-name label (the operator's pod watch sees it) and its own role (nothing counts it as a rank).
    assert meta["labels"][labels.JOB_NAME] == "train"
    assert meta["labels"][labels.ROLE] == labels.ROLE_LIGHTHOUSE
    assert labels.NODE_RANK not in meta["labels"] and labels.ATTEMPT not in meta["labels"]
    assert podinfo.lighthouse(pod) and podinfo.rank(pod) == -1
    assert spec["restartPolicy"] == "Always"
    # Not PID 1: a deletion's SIGTERM ends it at once, and its successor can take the name.
    assert spec["shareProcessNamespace"] is True and spec["terminationGracePeriodSeconds"] <= 5
    assert spec["automountServiceAccountToken"] is False
    (c,) = spec["containers"]
    assert c["image"] == "reg/trainer:1"
    assert c["command"][:3] == ["python", "-m", "ddpjob_trainer.lighthouse"]
    assert c["ports"] == [{"name": "lighthouse", "containerPort": contract.FT_LIGHTHOUSE_PORT, "protocol": "TCP"},
                          {"name": "lighthouse-id", "containerPort": contract.FT_LIGHTHOUSE_ID_PORT, "protocol": "TCP"}]
    assert c["readinessProbe"]["tcpSocket"] == {"port": "lighthouse"}
    assert "nvidia.com/gpu" not in str(c["resources"]) and c["resources"]["requests"]["cpu"]
    for key in ("hostname", "subdomain", "topologySpreadConstraints", "schedulerName", "volumes"):
        assert key not in spec, key


def test_pod_passes_restricted_pod_security_and_takes_the_jobs_own_settings():
    pod = render_lighthouse_pod(ft_job(
        gpusPerNode=8, podSecurityContext={"runAsUser": 1000}, securityContext={"readOnlyRootFilesystem": True},
        imagePullSecrets=[{"name": "reg"}], imagePullPolicy="Always",
        scheduling={"nodeSelector": {"pool": "train"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                    "priorityClassName": "high", "schedulerName": "volcano"}))
    spec = pod["spec"]
    (c,) = spec["containers"]
    # Restricted: non-root, RuntimeDefault seccomp, no privilege escalation, every capability dropped.
    assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"},
                                       "runAsUser": 1000}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "readOnlyRootFilesystem": True}
    assert spec["imagePullSecrets"] == [{"name": "reg"}] and c["imagePullPolicy"] == "Always"
    assert spec["nodeSelector"] == {"pool": "train"} and spec["priorityClassName"] == "high"
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    # No GPU, and not the gang scheduler's: a gang waits for its members, the Lighthouse is none.
    assert "nvidia.com/gpu" not in str(c["resources"]) and "schedulerName" not in spec


def test_service_is_a_cluster_ip_on_the_lighthouse_port_selecting_the_lighthouse_only():
    svc = render_lighthouse_service(ft_job())
    assert svc["metadata"]["name"] == "train-ft"
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert svc["spec"]["clusterIP"] == "None"  # headless: the name resolves to the ready pod, no kube-proxy needed
    assert svc["spec"]["selector"] == {labels.JOB_NAME: "train", labels.ROLE: labels.ROLE_LIGHTHOUSE}
    port, id_port = svc["spec"]["ports"]
    assert port["port"] == contract.FT_LIGHTHOUSE_PORT and port["targetPort"] == "lighthouse"
    assert id_port["port"] == contract.FT_LIGHTHOUSE_ID_PORT and id_port["targetPort"] == "lighthouse-id"
    assert lighthouse_url(ft_job()) == f"http://train-ft.ml.svc:{contract.FT_LIGHTHOUSE_PORT}"
    # The groups find the id of its incarnation at the Service's other port (ddpjob_trainer.lighthouse).
    assert lighthouse_id_url(lighthouse_url(ft_job())) == f"http://train-ft.ml.svc:{contract.FT_LIGHTHOUSE_ID_PORT}"


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:40000", "http://127.0.0.1:40001"),
    ("http://[fd00::7]:29510", "http://[fd00::7]:29511"),
])
def test_the_lighthouse_id_is_at_the_next_port_of_the_same_host(url, expected):
    assert lighthouse_id_url(url) == expected


def test_a_lighthouse_url_without_a_port_is_refused_naming_it():
    with pytest.raises(ValueError, match="'http://lh' names no port"):
        lighthouse_id_url("http://lh")


def _matches(selector: dict[str, str], pod: dict) -> bool:
    return all(pod["metadata"]["labels"].get(k) == v for k, v in selector.items())


def test_per_step_training_pods_are_selected_and_spread_without_the_lighthouse():
    j = ft_job()
    lighthouse, trainer = render_lighthouse_pod(j), render_pod(j, 1)
    assert trainer["metadata"]["labels"][labels.ROLE] == labels.ROLE_TRAINER and not podinfo.lighthouse(trainer)
    headless = render_service(j)["spec"]["selector"]
    assert _matches(headless, trainer) and not _matches(headless, lighthouse)
    spread = [c["labelSelector"]["matchLabels"] for c in trainer["spec"]["topologySpreadConstraints"]]
    assert spread and all(_matches(s, trainer) and not _matches(s, lighthouse) for s in spread)


def test_a_job_without_fault_tolerance_keeps_its_labels_and_selectors():
    j = job()
    assert labels.ROLE not in render_pod(j, 0)["metadata"]["labels"]
    assert render_service(j)["spec"]["selector"] == {labels.JOB_NAME: "train"}


def test_training_selector_leaves_the_lighthouse_out():
    assert labels.training_selector("train") == f"{labels.JOB_NAME}=train,{labels.ROLE}!={labels.ROLE_LIGHTHOUSE}"


def test_render_shows_the_lighthouse_first_for_a_per_step_job_only():
    def kinds(**spec):
        objs = render_objects(make_manifest("train", stored=False, nodes=2, **spec), namespace="ml")
        return [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert kinds(faultTolerance=FT) == [("Service", "train-ft"), ("Pod", "train-ft"), ("Service", "train"),
                                        ("Pod", "train-0"), ("Pod", "train-1")]
    assert kinds() == [("Service", "train"), ("Pod", "train-0"), ("Pod", "train-1")]
