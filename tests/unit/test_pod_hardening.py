"""Training pods are hardened by default (Pod Security "restricted"), and the job can say otherwise."""
from __future__ import annotations

import pytest

from ddpjob_api import labels
from ddpjob_operator.builders.pods import render_pod
from tests.support.builders import make_job


def pod_of(**spec):
    return render_pod(make_job("train", namespace="ml", uid="uid-1", image="reg/trainer:1", **spec), 1)


def restricted_violations(pod) -> list[str]:
    """What Pod Security "restricted" checks on a pod like ours (one container, no host fields)."""
    ps = pod["spec"].get("securityContext") or {}
    (c,) = pod["spec"]["containers"]
    cs = c.get("securityContext") or {}
    out = []
    if not cs.get("runAsNonRoot", ps.get("runAsNonRoot")):
        out.append("runAsNonRoot")
    if cs.get("allowPrivilegeEscalation") is not False:
        out.append("allowPrivilegeEscalation")
    if "ALL" not in ((cs.get("capabilities") or {}).get("drop") or []):
        out.append("capabilities.drop")
    if set((cs.get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}:
        out.append("capabilities.add")
    seccomp = (cs.get("seccompProfile") or ps.get("seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        out.append("seccompProfile")
    return out


def test_defaults_meet_restricted_and_mount_no_token():
    pod = pod_of()
    assert restricted_violations(pod) == []
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["spec"]["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_a_named_service_account_gets_its_token():
    pod = pod_of(serviceAccountName="trainer")
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert pod["spec"]["automountServiceAccountToken"] is True


@pytest.mark.parametrize("spec,pod_sc,container_sc", [
    # The job's own keys win, one key at a time; the rest of the defaults stay.
    ({"podSecurityContext": {"fsGroup": 10001}},
     {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}, "fsGroup": 10001}, None),
    ({"podSecurityContext": {"runAsNonRoot": False, "runAsUser": 0}},
     {"runAsNonRoot": False, "runAsUser": 0, "seccompProfile": {"type": "RuntimeDefault"}}, None),
    ({"podSecurityContext": {"seccompProfile": {"type": "Unconfined"}}},
     {"runAsNonRoot": True, "seccompProfile": {"type": "Unconfined"}}, None),
    ({"securityContext": {"allowPrivilegeEscalation": True}}, None,
     {"allowPrivilegeEscalation": True, "capabilities": {"drop": ["ALL"]}}),
    # Adding one capability keeps the others dropped; an explicit drop list replaces ours.
    ({"securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}}, None,
     {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]}}),
    ({"securityContext": {"capabilities": {"drop": []}}}, None,
     {"allowPrivilegeEscalation": False, "capabilities": {"drop": []}}),
    # privileged + allowPrivilegeEscalation=false is invalid in a Pod: no default then.
    ({"securityContext": {"privileged": True}}, None,
     {"privileged": True, "capabilities": {"drop": ["ALL"]}}),
    ({"securityContext": {"readOnlyRootFilesystem": True, "runAsUser": 2000}}, None,
     {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
      "readOnlyRootFilesystem": True, "runAsUser": 2000}),
])
def test_the_job_overrides_each_default(spec, pod_sc, container_sc):
    pod = pod_of(**spec)
    if pod_sc is not None:
        assert pod["spec"]["securityContext"] == pod_sc
    if container_sc is not None:
        assert pod["spec"]["containers"][0]["securityContext"] == container_sc


def test_defaults_are_not_shared_between_pods():
    a = pod_of()
    a["spec"]["securityContext"]["seccompProfile"]["type"] = "Unconfined"
    a["spec"]["containers"][0]["securityContext"]["capabilities"]["drop"].append("X")
    assert restricted_violations(pod_of()) == []
    assert pod_of()["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("key", ["ddpjob.dev/job-name", "ddpjob.dev/node-rank", "ddpjob.dev/attempt",
                                 "x.ddpjob.dev/anything"])
def test_reserved_label_keys_never_reach_the_pod(key):
    pod = pod_of(podLabels={key: "other", "team": "ml"}, podAnnotations={key: "x", "note": "y"})
    meta = pod["metadata"]
    assert meta["labels"][labels.JOB_NAME] == "train"
    assert meta["labels"][labels.NODE_RANK] == "1" and meta["labels"][labels.ATTEMPT] == "0"
    assert meta["labels"]["team"] == "ml"
    assert meta["annotations"] == {"note": "y", labels.RESTARTS: "0", labels.COUNTED_RESTARTS: "0"}
    if key.startswith("x."):
        assert key not in meta["labels"]


def test_look_alike_keys_are_the_users():
    assert not labels.reserved("notddpjob.dev/x") and not labels.reserved("ddpjob.dev")
    assert labels.reserved("ddpjob.dev/x") and labels.reserved("a.ddpjob.dev/x")


# What Prometheus' Kubernetes discovery makes of a pod label's key (__meta_kubernetes_pod_label_<this>).
def prometheus_name(key: str) -> str:
    import re

    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


OURS = {prometheus_name(k) for k in (labels.JOB_NAME, labels.NODE_RANK, labels.ATTEMPT, labels.REPLACEMENT)}


@pytest.mark.parametrize("key", ["ddpjob-dev/job-name", "ddpjob_dev_job_name", "ddpjob.dev.job-name",
                                 "ddpjob-dev/node-rank", "ddpjob_dev/attempt", "ddpjob.dev_replacement"])
def test_label_keys_prometheus_reads_as_ours_are_reserved_and_never_reach_the_pod(key):
    """A look-alike label would land on the same meta label as the operator's own (which the
    PodMonitor relabels into `ddpjob`, `node_rank`), and which one wins is arbitrary."""
    assert prometheus_name(key) in OURS and labels.reserved_label(key)
    pod = pod_of(podLabels={key: "victim", "team": "ml"}, template={"metadata": {"labels": {key: "victim"}}})
    assert key not in pod["metadata"]["labels"] and pod["metadata"]["labels"]["team"] == "ml"
    assert {prometheus_name(k) for k in pod["metadata"]["labels"]} & OURS == OURS - {prometheus_name(labels.REPLACEMENT)}


@pytest.mark.parametrize("key", ["ddpjob-devx/job-name", "ddpjobdev/job-name", "team.ddpjob-dev.io/x", "DDPJOB_DEV_x",
                                 "app.kubernetes.io/name", "ddpjob"])
def test_other_label_keys_stay_the_users(key):
    assert not labels.reserved_label(key)
    assert pod_of(podLabels={key: "v"})["metadata"]["labels"][key] == "v"


def test_the_crds_reserved_key_rules_are_the_operators_own_patterns():
    """One home: the CRD's CEL rules for podLabels/podAnnotations and the template's labels and
    annotations use exactly labels.RESERVED_LABEL_PATTERN / RESERVED_KEY_PATTERN (which
    ddpjob render and --local filter with)."""
    from ddpjob_api.crdschema import load_crd

    spec = load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    tpl = spec["template"]["properties"]["metadata"]["properties"]

    def pattern(node):
        (rule,) = node["x-kubernetes-validations"]
        return rule["rule"].split("matches('", 1)[1].rsplit("')", 1)[0]

    assert pattern(spec["podLabels"]) == pattern(tpl["labels"]) == labels.RESERVED_LABEL_PATTERN
    assert pattern(spec["podAnnotations"]) == pattern(tpl["annotations"]) == labels.RESERVED_KEY_PATTERN
