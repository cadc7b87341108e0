"""Whoever may patch ddpjobs/status cannot use it against the job: no pods killed, no restarts granted."""
from __future__ import annotations

import json

from tests.cluster.test_operator import crd, k8s, running, start_operator  # noqa: F401  (fixtures)
from tests.support.cluster import set_pod_exit


def edit_status(k8s, name, **fields):
    k8s.custom.patch_namespaced_custom_object_status("ddpjob.dev", "v1alpha1", k8s.ns, "ddpjobs", name,
                                                     {"status": fields})


def test_a_status_edited_to_succeeded_kills_no_pods(start_operator, k8s):
    start_operator()
    k8s.apply("edited", nodes=2)
    k8s.wait_status("edited", running(2), "Running 2/2")
    uids = {p.metadata.uid for p in k8s.pods("edited")}
    edit_status(k8s, "edited", phase="Succeeded", reason="Succeeded", message="edited",
                completionTime="2026-11-23T00:00:00Z")
    # The edit is a watch event: the operator decides again from the pods and says Running.
    status = k8s.wait_status("edited", lambda s: s.get("phase") == "Running" and s.get("message") != "edited",
                             "Running again after the edit")
    assert "completionTime" not in status
    live = [p for p in k8s.pods("edited") if p.metadata.deletion_timestamp is None]
    assert {p.metadata.uid for p in live} == uids


def test_an_edited_restart_budget_grants_no_restart(start_operator, k8s):
    start_operator()
    k8s.apply("budget2", nodes=2, failurePolicy={"maxRestarts": 1})
    k8s.wait_status("budget2", running(2), "Running")
    set_pod_exit(k8s.core.api_client, k8s.ns, "budget2-0", 1)
    k8s.wait_status("budget2", lambda s: s.get("countedRestarts") == 1 and running(2)(s), "one counted restart")
    pods = [p for p in k8s.pods("budget2") if p.metadata.labels["ddpjob.dev/attempt"] == "1"]
    assert {p.metadata.annotations.get("ddpjob.dev/counted-restarts") for p in pods} == {"1"}, \
        json.dumps([p.metadata.annotations for p in pods])
    edit_status(k8s, "budget2", countedRestarts=0, restarts=0)
    set_pod_exit(k8s.core.api_client, k8s.ns, "budget2-1-a1", 1)
    status = k8s.wait_status("budget2", lambda s: s.get("phase") in ("Failed", "Restarting"), "the budget decides",
                             timeout=60)
    assert status["phase"] == "Failed" and status["reason"] == "RestartLimitExceeded", status
