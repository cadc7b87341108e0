"""A node that stops reporting mid-run (its kubelet frozen with SIGSTOP: no heartbeats, no status
updates, the containers keep running) — what a user sees, and that nothing is charged for it.

Defined behaviour: within the node monitor's grace period (40 s) the node is NotReady and the
node lifecycle controller marks its pods not Ready; the job then carries a `NodeNotReady`
condition (and one Warning event) naming the pod and the node, and stays Running — the training
processes are fine, only their node's agent is gone. When the kubelet reports again the condition
clears and the job finishes without a restart. (Had Kubernetes evicted the pod after its
unreachable toleration, the group would restart without using the budget: lifecycle's rule table.)
"""
from __future__ import annotations

import os
import signal

from tests.realpods.conftest import (
    REPO_ROOT,
    apply_docs,
    example_docs,
    job_status,
    pod_nodes,
    shared_checkpoint_pv,
    wait_job,
    wait_phase,
)
from tests.support.cluster import wait_for
from tests.support.status import condition


def _kubelet_pid(node: str) -> int:
    index = node.rsplit("-", 1)[-1]
    return int((REPO_ROOT / ".cache" / "cluster" / "pids" / f"kubelet-{index}.pid").read_text())


def test_a_node_that_stops_reporting_is_named_and_the_job_still_finishes(real_cluster, namespaces, tmp_path):
    ns = namespaces["nodeloss"]
    claim = next(d["metadata"]["name"] for d in example_docs("digits.yaml") if d["kind"] == "PersistentVolumeClaim")
    shared_checkpoint_pv(real_cluster, claim=claim, namespace=ns, tmp=tmp_path)
    apply_docs(real_cluster, example_docs("digits.yaml"), ns)
    wait_job(real_cluster, ns, "digits", lambda st: (st.get("progress") or {}).get("step", 0) >= 10,
             give_up=lambda st: st.get("phase") in ("Succeeded", "Failed"), desc="training", timeout=600)

    node = pod_nodes(real_cluster, ns, "digits")["digits-1"]
    pid = _kubelet_pid(node)
    os.kill(pid, signal.SIGSTOP)
    try:
        def named():
            c = condition(job_status(real_cluster, ns, "digits"), "NodeNotReady")
            return c if c and c["status"] == "True" else None
        cond = wait_for(named, timeout=180, desc=f"NodeNotReady naming digits-1 on {node}", interval=1)
        assert f"pod digits-1 on node {node}" in cond["message"], cond
        assert job_status(real_cluster, ns, "digits")["phase"] == "Running"
    finally:
        os.kill(pid, signal.SIGCONT)

    st = wait_phase(real_cluster, ns, "digits", {"Succeeded", "Failed"}, timeout=900)
    assert st["phase"] == "Succeeded", st
    assert st.get("restarts", 0) == 0 and st.get("countedRestarts", 0) == 0, st
    assert condition(st, "NodeNotReady")["status"] == "False", st
    events = real_cluster.kubectl("get", "events", "-n", ns, "--field-selector",
                                  "involvedObject.kind=DDPJob,reason=NodeNotReady",
                                  "-o", "name").stdout.split()
    assert len(events) == 1, events
