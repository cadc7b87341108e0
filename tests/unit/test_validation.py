"""validate_manifest: the CRD schema + its CEL rules in Python, every message naming the field."""
from __future__ import annotations

import copy

import pytest

from ddpjob_operator.validation import InvalidDDPJob, apply_defaults, check_manifest, validate_manifest

GOOD = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "mnist"},
        "spec": {"image": "reg/trainer:1", "nodes": 2, "trainer": {"dataset": "digits", "model": "convnet"}}}


def with_spec(**spec):
    m = copy.deepcopy(GOOD)
    m["spec"].update(spec)
    return m


def test_good_manifest_has_no_problems():
    assert validate_manifest(GOOD) == []


@pytest.mark.parametrize("extra", [
    {"nprocPerNode": 4}, {"nprocPerNode": "auto"}, {"gpusPerNode": 8}, {"elastic": {"minNodes": 1, "maxNodes": 4}},
    {"shmSize": "16Gi"}, {"shmSize": 1073741824}, {"cleanPodPolicy": "All"}, {"suspend": True},
    {"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "x"}}]},
    {"scheduling": {"nodeSelector": {"a": "b"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In",
                                                                     "values": ["a100"]}]}]}}}}},
    {"resources": {"limits": {"cpu": 2, "memory": "8Gi"}, "requests": {"cpu": "500m"}}},
    {"env": [{"name": "1PASSWORD_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
    {"securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}, "podSecurityContext": {"fsGroup": 1000}},
    {"trainer": {"dataset": "synthetic", "model": "mlp", "optimizer": "adamw", "maxSteps": 10,
                 "synthetic": {"shape": [1, 8, 8], "numClasses": 4}, "checkpoint": {"everySteps": 0}}},
    {"command": ["torchrun", "train.py"], "launcher": False},
])
def test_valid_variants(extra):
    assert validate_manifest(with_spec(**extra)) == []


@pytest.mark.parametrize("change,field", [
    ({"nodes": 0}, "spec.nodes"),
    ({"nodes": -3}, "spec.nodes"),
    ({"nodes": "four"}, "spec.nodes"),
    ({"nprocPerNode": "many"}, "spec.nprocPerNode"),
    ({"nprocPerNode": 0}, "spec.nprocPerNode"),
    ({"gpusPerNode": -1}, "spec.gpusPerNode"),
    ({"masterPort": 70000}, "spec.masterPort"),
    ({"metricsPort": 0}, "spec.metricsPort"),
    ({"masterPort": 9400}, "spec.masterPort and spec.metricsPort must differ"),
    ({"elastic": {"minNodes": 3, "maxNodes": 8}}, "spec.elastic.minNodes must be <= spec.nodes"),
    ({"elastic": {"minNodes": 1, "maxNodes": 1}}, "spec.elastic.maxNodes must be >= spec.nodes"),
    ({"shmSize": "lots"}, "spec.shmSize"),
    ({"cleanPodPolicy": "Sometimes"}, "spec.cleanPodPolicy"),
    ({"failurePolicy": {"maxRestarts": -1}}, "spec.failurePolicy.maxRestarts"),
    ({"activeDeadlineSeconds": 0}, "spec.activeDeadlineSeconds"),
    ({"ttlSecondsAfterFinished": -5}, "spec.ttlSecondsAfterFinished"),
    ({"trainer": {"model": "vgg"}}, "spec.trainer.model"),
    ({"nproc_per_node": 2}, "spec.nproc_per_node: unknown field"),
    ({"trainer": {"batch_size": 2}}, "spec.trainer.batch_size: unknown field"),   # the trainer would exit 78
    ({"trainer": {"synthetic": {"shape": []}}}, "spec.trainer.synthetic.shape"),
    ({"image": ""}, "spec.image"),
    ({"env": [{"value": "x"}]}, "spec.env[0].name"),
    # Pod-level fields carry Kubernetes' own core/v1 schemas (hack/gen-crd-schemas.py).
    ({"env": [{"name": "A=B", "value": "x"}]}, "spec.env[0].name"),
    ({"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "kee": "k"}}}]},
     "spec.env[0].valueFrom.secretKeyRef.kee: unknown field"),
    ({"resources": {"limts": {"memory": "8Gi"}}}, "spec.resources.limts: unknown field"),
    ({"resources": {"limits": {"memory": "8 GB"}}}, "spec.resources.limits.memory"),
    ({"scheduling": {"tolerations": [{"kye": "gpu", "operator": "Exists"}]}},
     "spec.scheduling.tolerations[0].kye: unknown field"),
    ({"scheduling": {"affinity": {"nodeAffinity": {"anything": "goes"}}}},
     "spec.scheduling.affinity.nodeAffinity.anything: unknown field"),
    ({"volumes": [{"name": "d", "persistentVolumeClam": {"claimName": "x"}}]},
     "spec.volumes[0].persistentVolumeClam: unknown field"),
    ({"volumeMounts": [{"name": "d"}]}, "spec.volumeMounts[0].mountPath"),
    ({"podSecurityContext": {"fsGroup": "root"}}, "spec.podSecurityContext.fsGroup"),
    ({"failurePolicy": {"podStartTimeoutSeconds": 0}}, "spec.failurePolicy.podStartTimeoutSeconds"),
])
def test_invalid_specs_name_the_field(change, field):
    problems = validate_manifest(with_spec(**change))
    assert problems, change
    assert any(field in p for p in problems), problems


@pytest.mark.parametrize("name,ok", [("a" * 58, True), ("a" * 59, False), ("Bad_Name", False), ("9lives", False)])
def test_name_must_leave_room_for_the_rank(name, ok):
    m = copy.deepcopy(GOOD)
    m["metadata"]["name"] = name
    problems = validate_manifest(m)
    assert (problems == []) == ok
    if not ok:
        assert all(p.startswith("metadata.name") for p in problems)


def test_missing_image_and_wrong_kind():
    m = copy.deepcopy(GOOD)
    del m["spec"]["image"]
    m["kind"] = "PyTorchJob"
    problems = validate_manifest(m)
    assert any(p.startswith("spec.image") for p in problems)
    assert any(p.startswith("kind:") for p in problems)


def test_not_a_mapping():
    assert validate_manifest(["nope"])[0].startswith("<root>")


def test_defaults_come_from_the_crd():
    spec = apply_defaults(GOOD)["spec"]
    assert spec["nprocPerNode"] == "auto" and spec["gpusPerNode"] == 0
    assert spec["masterPort"] == 29500 and spec["metricsPort"] == 9400
    assert spec["failurePolicy"] == {"maxRestarts": 3, "restartOnHang": False, "logTailInStatus": False}
    assert spec["launcher"] is True and spec["cleanPodPolicy"] == "Running" and spec["suspend"] is False
    assert "suspend" not in GOOD["spec"]  # input untouched


def test_check_manifest_raises_with_every_problem():
    with pytest.raises(InvalidDDPJob) as err:
        check_manifest(with_spec(nodes=0, gpusPerNode=-1))
    assert "spec.nodes" in str(err.value) and "spec.gpusPerNode" in str(err.value)
    assert len(err.value.problems) == 2
