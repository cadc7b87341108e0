"""A pod the API server refuses becomes a FailedCreatePod condition and phase with the API's own
message: the real 422/403 bodies of this API server through children.refusal / status.create_refused, and the
resulting status accepted by the CRD and shown by kubectl."""
from __future__ import annotations

import datetime as dt
import json

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from ddpjob_api.spec import from_manifest
from ddpjob_operator.base.group import Group
from ddpjob_operator.builders.pods import render_pod
from ddpjob_operator.app.children import refusal
from ddpjob_operator.decisions.status import create_refused
from tests.support.passes import pass_status
from tests.cluster.conftest import wait_for
from tests.cluster.test_crd import install_crd, manifest


@pytest.fixture(scope="module")
def crd(cluster):
    install_crd(cluster)
    return cluster


def stored(cluster, ns, obj):
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))
    return json.loads(cluster.kubectl("get", "ddpj", obj["metadata"]["name"], "-n", ns, "-o", "json").stdout)


def create_error(api, pod) -> ApiException:
    with pytest.raises(ApiException) as info:
        client.CoreV1Api(api).create_namespaced_pod(pod["metadata"]["namespace"], pod)
    return info.value


def test_invalid_pod_fails_the_job_naming_the_field(crd, namespace, api):
    # The CRD cannot cross-check names (a mount of a volume that is not declared); the Pod API does.
    job = from_manifest(stored(crd, namespace, manifest("refused", volumeMounts=[{"name": "data",
                                                                                   "mountPath": "/data"}])))
    exc = create_error(api, render_pod(job, 0))
    r = refusal("refused-0", exc.status, exc.body)
    assert r.code == 422 and r.reason == "Invalid" and r.permanent
    assert "volumeMounts[1].name" in r.message and "data" in r.message

    now = dt.datetime.now(dt.timezone.utc)
    status, _ = pass_status(job, Group.of([]), now=now, prev_status=None)
    status, events = create_refused(job, status, [r], now=now)
    client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        "ddpjob.dev", "v1alpha1", namespace, "ddpjobs", "refused", {"status": status})
    got = json.loads(crd.kubectl("get", "ddpj", "refused", "-n", namespace, "-o", "json").stdout)["status"]
    assert got["phase"] == "Failed" and got["reason"] == "FailedCreatePod"
    cond = next(c for c in got["conditions"] if c["type"] == "FailedCreatePod")
    assert cond["reason"] == "Invalid" and "volumeMounts[1].name" in cond["message"]
    assert "(DDPJob spec.volumeMounts[0].name)" in cond["message"]      # the field the user wrote
    wide = crd.kubectl("get", "ddpj", "refused", "-n", namespace, "-o", "wide").stdout
    assert "Failed" in wide and "FailedCreatePod" in wide
    assert events and events[0][1] == "FailedCreatePod"


def test_quota_refusal_keeps_the_job_pending_with_the_reason(crd, namespace, api):
    client.CoreV1Api(api).create_namespaced_resource_quota(namespace, {
        "metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}})
    job = from_manifest(stored(crd, namespace, manifest("quota")))
    pod = render_pod(job, 0)

    def refused():
        try:
            client.CoreV1Api(api).create_namespaced_pod(namespace, pod)
        except ApiException as exc:
            return exc
        raise AssertionError("the quota admitted a pod")
    # Until the quota controller has filled in status, the refusal says "status unknown for quota".
    exc = wait_for(lambda: (lambda e: e if "exceeded quota" in str(e.body) else None)(refused()), timeout=30,
                   desc="the quota refusing pods")
    r = refusal("quota-0", exc.status, exc.body)
    assert r.reason == "Forbidden" and not r.permanent and "exceeded quota" in r.message
    now = dt.datetime.now(dt.timezone.utc)
    status, _ = pass_status(job, Group.of([]), now=now, prev_status=None)
    status, _ = create_refused(job, status, [r], now=now)
    assert status["phase"] == "Pending" and status["reason"] == "FailedCreatePod"
    assert "exceeded quota" in status["message"]
