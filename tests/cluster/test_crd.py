"""The DDPJob CRD on the real API server: installs, defaults, and refuses bad specs by field name."""
from __future__ import annotations

import json

import pytest
import yaml

from ddpjob_operator.crd import crd_path
from tests.cluster.conftest import wait_for


def install_crd(cluster) -> None:
    """kubectl apply the chart's CRD and wait until it is Established (idempotent)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_path()))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd/ddpjobs.ddpjob.dev")


@pytest.fixture(scope="module")
def crd(cluster):
    install_crd(cluster)
    return cluster


def manifest(name="job", **spec):
    return {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
            "spec": {"image": "reg/trainer:1", "nodes": 2, **spec}}


def apply(cluster, ns, obj):
    return cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(obj), check=False)


def test_crd_established_with_short_name_and_columns(crd, namespace):
    out = crd.kubectl("api-resources", "--api-group=ddpjob.dev", "-o", "wide").stdout
    assert "ddpj" in out and "DDPJob" in out and "true" in out  # namespaced
    assert apply(crd, namespace, manifest()).returncode == 0
    head = crd.kubectl("get", "ddpj", "-n", namespace).stdout.splitlines()[0].split()
    assert head[:6] == ["NAME", "PHASE", "READY", "PROGRESS", "LOSS", "RESTARTS"] and head[-1] == "AGE"


def test_defaults_applied_by_the_api_server(crd, namespace):
    apply(crd, namespace, manifest("defaults"))
    spec = json.loads(crd.kubectl("get", "ddpj", "defaults", "-n", namespace, "-o", "json").stdout)["spec"]
    assert spec["nprocPerNode"] == "auto" and spec["gpusPerNode"] == 0
    assert spec["masterPort"] == 29500 and spec["metricsPort"] == 9400
    assert spec["failurePolicy"] == {"maxRestarts": 3, "restartOnHang": False}
    assert spec["cleanPodPolicy"] == "Running" and spec["launcher"] is True and spec["suspend"] is False


@pytest.mark.parametrize("name,spec,field", [
    ("job", {"nodes": 0}, "spec.nodes"),
    ("job", {"nprocPerNode": "many"}, "spec.nprocPerNode"),
    ("job", {"nprocPerNode": 0}, "spec.nprocPerNode"),
    ("job", {"gpusPerNode": -1}, "spec.gpusPerNode"),
    ("job", {"nodes": 4, "elastic": {"minNodes": 6, "maxNodes": 2}}, "spec.elastic.minNodes"),
    ("job", {"masterPort": 70000}, "spec.masterPort"),
    ("job", {"metricsPort": 0}, "spec.metricsPort"),
    ("job", {"masterPort": 9400}, "spec.masterPort and spec.metricsPort must differ"),
    ("job", {"shmSize": "lots"}, "spec.shmSize"),
    ("job", {"cleanPodPolicy": "Sometimes"}, "spec.cleanPodPolicy"),
    ("job", {"failurePolicy": {"maxRestarts": -1}}, "spec.failurePolicy.maxRestarts"),
    ("job", {"activeDeadlineSeconds": 0}, "spec.activeDeadlineSeconds"),
    ("job", {"trainer": {"model": "vgg19"}}, "spec.trainer.model"),
    ("job", {"trainer": {"batch_size": 8}}, "spec.trainer.batch_size"),   # unknown key: strict decoding
    ("j" * 59, {}, "metadata.name"),
])
def test_invalid_spec_refused_naming_the_field(crd, namespace, name, spec, field):
    proc = apply(crd, namespace, manifest(name, **spec))
    assert proc.returncode != 0, f"accepted: {spec}"
    assert field in proc.stderr, proc.stderr
    # The local validator (same CRD file) agrees and names the same field.
    from ddpjob_operator.validation import validate_manifest
    assert any(field in p for p in validate_manifest(manifest(name, **spec)))


@pytest.mark.parametrize("change,field", [
    ({"nodes": 3}, "spec.nodes is immutable"),
    ({"gpusPerNode": 8}, "spec.gpusPerNode is immutable"),
    ({"image": "reg/trainer:2"}, "spec.image is immutable"),
    ({"command": ["torchrun", "x.py"]}, "spec.command is immutable"),
    ({"trainer": {"epochs": 5}}, "spec.trainer is immutable"),
])
def test_immutable_fields_but_suspend_may_change(crd, namespace, change, field):
    assert apply(crd, namespace, manifest("imm", trainer={"epochs": 1})).returncode == 0
    proc = crd.kubectl("patch", "ddpj", "imm", "-n", namespace, "--type", "merge",
                       "-p", json.dumps({"spec": change}), check=False)
    assert proc.returncode != 0 and field in proc.stderr, proc.stderr
    crd.kubectl("patch", "ddpj", "imm", "-n", namespace, "--type", "merge", "-p", '{"spec":{"suspend":true}}')


def test_status_fields_are_not_pruned(crd, namespace, api):
    from kubernetes import client

    apply(crd, namespace, manifest("st"))
    status = {"phase": "Running", "restarts": 2, "masterAddr": "st-0.st.x.svc", "attempt": 2,
              "nodes": {"total": 2, "pending": 0, "running": 2, "succeeded": 0, "failed": 0, "ready": "2/2"},
              "progress": {"epoch": 1, "step": 10, "totalSteps": 100, "percent": 10.0, "loss": 0.5,
                           "samplesPerSecond": 99.5, "eta": "1m", "lastStepTime": "2026-11-22T00:00:00Z"},
              "conditions": [{"type": "Running", "status": "True", "reason": "Running", "message": "",
                              "lastTransitionTime": "2026-11-22T00:00:00Z"}]}
    co = client.CustomObjectsApi(api)
    co.patch_namespaced_custom_object_status("ddpjob.dev", "v1alpha1", namespace, "ddpjobs", "st",
                                             {"status": status})
    got = wait_for(lambda: co.get_namespaced_custom_object("ddpjob.dev", "v1alpha1", namespace, "ddpjobs", "st")
                   .get("status"), timeout=10, desc="status written")
    for key, value in status.items():
        assert got[key] == value, key
