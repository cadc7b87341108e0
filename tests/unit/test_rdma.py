"""spec.rdma: the pod builder gives the training container the RDMA devices, IPC_LOCK and the
fabric's NCCL settings; the job's own securityContext, resources, spec.nccl and env still have
their say. (The tenant policy that gates it: tests/cluster/test_tenant_policy.py.)"""
from __future__ import annotations

import pytest

from ddpjob_api.validation import validate_manifest
from ddpjob_operator.builders.envvars import env_dict, pod_env
from ddpjob_operator.builders.pods import render_pod
from tests.support.builders import make_job, make_manifest

IB = {"resource": "rdma/ib"}
EFA = {"resource": "vpc.amazonaws.com/efa", "devicesPerNode": 4}


def trainer(**spec):
    spec.setdefault("gpusPerNode", 8)
    pod = render_pod(make_job("train", namespace="ml", uid="uid-1", image="reg/trainer:1", **spec), 1)
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "trainer"]
    return c


@pytest.mark.parametrize("spec, limits, requests", [
    ({"rdma": IB}, {"nvidia.com/gpu": "8", "rdma/ib": "1"}, None),
    ({"rdma": EFA}, {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4"}, None),
    # A request the job gives for the device must equal the limit (extended resources): ours wins.
    ({"rdma": {"resource": "rdma/ib", "devicesPerNode": 2},
      "resources": {"requests": {"rdma/ib": "1", "cpu": "4"}, "limits": {"memory": "64Gi"}}},
     {"memory": "64Gi", "nvidia.com/gpu": "8", "rdma/ib": "2"}, {"rdma/ib": "2", "cpu": "4"}),
    ({}, {"nvidia.com/gpu": "8"}, None),
])
def test_the_devices_are_requested_per_pod(spec, limits, requests):
    resources = trainer(**spec)["resources"]
    assert resources["limits"] == limits
    assert resources.get("requests") == requests


@pytest.mark.parametrize("spec, capabilities", [
    ({"rdma": IB}, {"drop": ["ALL"], "add": ["IPC_LOCK"]}),
    # The job's own additions keep IPC_LOCK; so does a template container's securityContext.
    ({"rdma": IB, "securityContext": {"capabilities": {"add": ["NET_RAW"]}}},
     {"drop": ["ALL"], "add": ["NET_RAW", "IPC_LOCK"]}),
    ({"rdma": IB, "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}},
     {"drop": ["ALL"], "add": ["IPC_LOCK"]}),
    ({"rdma": EFA, "template": {"spec": {"containers": [{"name": "trainer", "securityContext": {
        "capabilities": {"drop": ["NET_RAW"]}}}]}}}, {"drop": ["NET_RAW"], "add": ["IPC_LOCK"]}),
    ({}, {"drop": ["ALL"]}),
])
def test_the_container_gets_ipc_lock(spec, capabilities):
    sc = trainer(**spec)["securityContext"]
    assert sc["capabilities"] == capabilities
    assert sc["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("spec, expected, absent", [
    ({"rdma": IB}, {"NCCL_IB_DISABLE": "0", "NCCL_NET": "IB"}, ["FI_PROVIDER"]),
    ({"rdma": {"resource": "rdma/hca_shared_devices_a"}}, {"NCCL_IB_DISABLE": "0", "NCCL_NET": "IB"}, []),
    ({"rdma": EFA}, {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}, ["NCCL_NET", "NCCL_IB_DISABLE"]),
    # spec.nccl and the job's env win over the fabric's defaults.
    ({"rdma": IB, "nccl": {"ibDisable": True, "ibGidIndex": 3}},
     {"NCCL_IB_DISABLE": "1", "NCCL_NET": "IB", "NCCL_IB_GID_INDEX": "3"}, []),
    ({"rdma": IB, "env": [{"name": "NCCL_NET", "value": "IBext_v8"}]}, {"NCCL_NET": "IBext_v8"}, []),
    ({"rdma": EFA, "template": {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "FI_EFA_USE_DEVICE_RDMA", "value": "0"}]}]}}}, {"FI_EFA_USE_DEVICE_RDMA": "0"}, []),
    ({}, {}, ["NCCL_NET", "NCCL_IB_DISABLE", "FI_PROVIDER"]),
])
def test_the_fabrics_nccl_settings_yield_to_the_job(spec, expected, absent):
    env = trainer(**spec)["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names))
    got = env_dict(env)
    assert {k: got.get(k) for k in expected} == expected
    assert not set(absent) & set(got)


def test_a_local_run_leaves_the_fabric_out():
    """`ddpjob run --local` has none of the pods' devices: NCCL_NET=IB would stop NCCL there."""
    job = make_job("train", gpusPerNode=1, rdma=IB, nccl={"debug": "INFO"})
    local = env_dict(pod_env(job, 0, master_addr="127.0.0.1", rdma_devices=False))
    assert "NCCL_NET" not in local and local["NCCL_DEBUG"] == "INFO"
    assert env_dict(pod_env(job, 0))["NCCL_NET"] == "IB"


@pytest.mark.parametrize("rdma, gpus, problem", [
    (IB, 8, None),
    (EFA, 1, None),
    (IB, 0, "spec.rdma needs spec.gpusPerNode > 0"),
    ({"resource": "ib"}, 8, "spec.rdma.resource"),                 # not an extended resource name
    ({"resource": "rdma/ib", "devicesPerNode": 0}, 8, "spec.rdma.devicesPerNode"),
    ({"devicesPerNode": 1}, 8, "resource"),
])
def test_the_schema_and_rules_name_the_field(rdma, gpus, problem):
    problems = validate_manifest(make_manifest("train", gpusPerNode=gpus, rdma=rdma))
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems
