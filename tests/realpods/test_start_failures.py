"""Containers that really cannot start, on the real nodes (kubelet + containerd): the kubelet's own
waiting reason reaches the DDPJob as ContainersNotStarting naming the pod, and
spec.failurePolicy.podStartTimeoutSeconds fails the job. No image is ever pulled or run, so this
uses the operator from the checkout (no image build); nothing it runs is scraped."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.cluster.test_crd import install_crd, manifest
from tests.cluster.test_operator import Operator
from tests.realpods.conftest import REAL_NODE_SCHEDULING, real_nodes
from tests.support.cluster import wait_for


@pytest.fixture
def operator(cluster, namespace, tmp_path):
    if len(real_nodes(cluster)) < 1:
        pytest.fail("no Ready real node: start the cluster with DDPJOB_REAL_NODES=2 make cluster-up")
    install_crd(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log")
    yield op
    op.stop()
    print(f"--- operator log ---\n{op.log_path.read_text()[-4000:]}")


def status(cluster, ns, name):
    return json.loads(cluster.kubectl("get", "ddpj", name, "-n", ns, "-o", "json").stdout).get("status") or {}


def not_starting(cluster, ns, name):
    st = status(cluster, ns, name)
    c = next((c for c in st.get("conditions") or [] if c["type"] == "ContainersNotStarting"), None)
    return (st, c) if c and c["status"] == "True" else None


@pytest.mark.parametrize("image,policy,reason", [
    ("localhost/ddpjob/no-such-image:1", "Never", "ErrImageNeverPull"),
    ("localhost/DDPJob/Upper-Case:1", "IfNotPresent", "InvalidImageName"),
])
def test_kubelet_reason_reaches_the_job_then_the_timeout_fails_it(cluster, namespace, operator, image, policy,
                                                                   reason):
    job = manifest("nostart", nodes=1, image=image, imagePullPolicy=policy, scheduling=REAL_NODE_SCHEDULING,
                   failurePolicy={"podStartTimeoutSeconds": 15})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job))
    st, cond = wait_for(lambda: not_starting(cluster, namespace, "nostart"), timeout=90, interval=1,
                        desc=f"{reason} from the kubelet on the DDPJob")
    assert cond["reason"] == reason and cond["message"].startswith(f"pod nostart-0 container trainer: {reason}")
    assert st["phase"] == "Pending" and st["reason"] == reason and "failing after" in st["message"]
    final = wait_for(lambda: (lambda s: s if s.get("phase") == "Failed" else None)(
        status(cluster, namespace, "nostart")), timeout=60, interval=1, desc="Failed after podStartTimeoutSeconds")
    assert final["reason"] == reason and "podStartTimeoutSeconds=15" in final["message"]
