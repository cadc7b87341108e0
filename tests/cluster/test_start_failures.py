"""The operator names a container that cannot start (image pull, config errors) in the DDPJob within
a pass, and fails the job after spec.failurePolicy.podStartTimeoutSeconds when one is set.

kwok nodes have no kubelet to fail a pull: the pods are kept off them (a node selector no node has)
and their status gets what a kubelet writes for a pull that fails."""
from __future__ import annotations

import json

import pytest
import yaml
from kubernetes import client

from tests.cluster.conftest import wait_for
from tests.cluster.test_crd import install_crd, manifest
from tests.cluster.test_operator import Operator

NOWHERE = {"nodeSelector": {"ddpjob.dev/test-no-such-node": "true"}}
PULL = 'Back-off pulling image "reg/trainer:typo"'


@pytest.fixture
def operator(cluster, namespace, tmp_path):
    install_crd(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log")
    yield op
    op.stop()
    print(f"--- operator log ---\n{op.log_path.read_text()[-4000:]}")


def kubelet_says(api, ns, pod, reason, message):
    """The container status a kubelet writes while it cannot start the container."""
    client.CoreV1Api(api).patch_namespaced_pod_status(pod, ns, {"status": {"containerStatuses": [{
        "name": "trainer", "image": "reg/trainer:typo", "imageID": "", "ready": False, "restartCount": 0,
        "started": False, "state": {"waiting": {"reason": reason, "message": message}}}]}})


def ddpj(cluster, ns, name):
    return json.loads(cluster.kubectl("get", "ddpj", name, "-n", ns, "-o", "json").stdout).get("status") or {}


def pod_exists(api, ns, name):
    return client.CoreV1Api(api).list_namespaced_pod(ns, field_selector=f"metadata.name={name}").items


def test_image_pull_error_named_in_status_and_event(cluster, namespace, api, operator):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(
        manifest("pull", nodes=2, scheduling=NOWHERE)))
    wait_for(lambda: pod_exists(api, namespace, "pull-1"), timeout=30, desc="pods created")
    kubelet_says(api, namespace, "pull-1", "ImagePullBackOff", PULL)

    def named():
        st = ddpj(cluster, namespace, "pull")
        c = next((c for c in st.get("conditions") or [] if c["type"] == "ContainersNotStarting"), None)
        return (st, c) if c and c["status"] == "True" else None
    status, cond = wait_for(named, timeout=30, desc="ContainersNotStarting on the DDPJob")
    assert cond["reason"] == "ImagePullBackOff" and f"pod pull-1 container trainer: ImagePullBackOff: {PULL}" \
        in cond["message"]
    assert status["phase"] == "Pending" and status["reason"] == "ImagePullBackOff"
    assert "set spec.failurePolicy.podStartTimeoutSeconds to fail instead" in status["message"]
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                             "involvedObject.kind=DDPJob,reason=ImagePullBackOff", "-o", "json").stdout
    assert json.loads(events)["items"], "no ImagePullBackOff event on the DDPJob"
    wide = cluster.kubectl("get", "ddpj", "pull", "-n", namespace, "-o", "wide").stdout
    assert "ImagePullBackOff" in wide


def test_pod_start_timeout_fails_the_job(cluster, namespace, api, operator):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(
        manifest("never", nodes=1, scheduling=NOWHERE, failurePolicy={"podStartTimeoutSeconds": 3})))
    wait_for(lambda: pod_exists(api, namespace, "never-0"), timeout=30, desc="pod created")
    kubelet_says(api, namespace, "never-0", "ErrImageNeverPull",
                 'Container image "reg/trainer:typo" is not present with pull policy of Never')
    status = wait_for(lambda: (lambda st: st if st.get("phase") == "Failed" else None)(ddpj(cluster, namespace,
                                                                                          "never")),
                      timeout=40, desc="the job Failed after podStartTimeoutSeconds")
    assert status["reason"] == "ErrImageNeverPull"
    assert "pod never-0 container trainer" in status["message"] and "podStartTimeoutSeconds=3" in status["message"]
