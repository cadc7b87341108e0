"""Per-step fault tolerance (spec.faultTolerance, issue 53) on the real nodes: two replica groups
(pods) train digits through torchft's Manager and the Lighthouse pod the operator runs; pod 1 is
force-deleted mid-training; pod 0 keeps stepping alone, the replacement joins and takes pod 0's
weights, and the job Succeeds, nothing restarted.

Not here: the Lighthouse pod force-deleted while the replacement asks for its first quorum. That
check (47471d8) failed once in a clean-clone rehearsal: the new Lighthouse saw only the
replacement for a minute, the replacement's first quorum gave up waiting for its peer and it
trained alone from its initial weights (issue 53's open point; the closing note of that stop)."""
from __future__ import annotations

import re

from tests.realpods.conftest import apply_docs, example_docs, shared_checkpoint_pv, stalled, wait_job
from tests.support.cluster import wait_for
from tests.support.status import condition

# Pod 1's group holds at step KILL_AT until it is deleted; pod 0 steps on alone and holds at
# HOLD_AT until the replacement's trainer is up, so that the join comes mid-training however
# long the replacement takes to start (debug.py: DDPJOB_DEBUG_HOLD_RANK). Knobs, not sleeps.
KILL_AT, HOLD_AT = 3, 8
REPLACEMENT = "digits-1-r1"  # the name the operator gives pod 1's first replacement
STEP_RE = re.compile(r"ft: step (\d+) participants (\d+) weights (\w+)")
JOINED_RE = re.compile(r"ft: joined at step (\d+) from a peer, weights (\w+)")


def _log(cluster, ns: str, pod: str) -> str:
    return cluster.kubectl("logs", "-n", ns, pod, check=False).stdout


def _uid(cluster, ns: str, pod: str) -> str:
    return cluster.kubectl("get", "pod", "-n", ns, pod, "-o", "jsonpath={.metadata.uid}").stdout


def test_a_force_deleted_pod_of_a_per_step_job_is_replaced_alone_and_heals_from_its_peer(
        real_cluster, namespaces, tmp_path):
    ns = namespaces["perstep"]
    docs = example_docs("digits.yaml")
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")["metadata"]["name"]
    shared = shared_checkpoint_pv(real_cluster, claim=claim, namespace=ns, tmp=tmp_path)
    spec = next(d for d in docs if d["kind"] == "DDPJob")["spec"]
    spec["faultTolerance"] = {"mode": "perStep"}
    # No checkpoints (a per-step job recovers from its peer); the shared volume carries the holds'
    # release files. A short run: one epoch of the MLP, a log line (and its weights hash) every step.
    spec["trainer"] = {"dataset": "digits", "model": "mlp", "epochs": 1, "batchSize": 16, "lr": 0.1,
                       "logEverySteps": 1}
    mount = spec["volumeMounts"][0]["mountPath"]
    # Rank 1's hold file is named after its pod (Kubernetes expands $(HOLD_POD), defined before it):
    # the replacement's is there before the deletion, so it never holds, while the deleted pod's
    # never appears. One file for both let the deleted pod's trainer, still running until its
    # kubelet killed it, step on with pod 0 (rehearsal 44: no step of pod 0's alone).
    spec["env"] = [*(spec.get("env") or []),
                   {"name": "HOLD_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                   {"name": "DDPJOB_DEBUG_HOLD_RANK",
                    "value": f"1:{KILL_AT}:{mount}/release-$(HOLD_POD),0:{HOLD_AT}:{mount}/release-0"}]
    apply_docs(real_cluster, docs, ns)

    wait_job(real_cluster, ns, "digits", lambda st: (condition(st, "LighthouseReady") or {}).get("status") == "True",
             give_up=stalled, desc="the Lighthouse ready", timeout=600)
    wait_for(lambda: f"rank 1 holds at step {KILL_AT}" in _log(real_cluster, ns, "digits-1"), timeout=600,
             desc=f"pod 1's group held at step {KILL_AT}", interval=2)
    first0 = _uid(real_cluster, ns, "digits-0")
    (shared / f"release-{REPLACEMENT}").touch()
    real_cluster.kubectl("delete", "pod", "-n", ns, "digits-1", "--grace-period=0", "--force")

    wait_for(lambda: f"rank 0 holds at step {HOLD_AT}" in _log(real_cluster, ns, "digits-0"), timeout=300,
             desc=f"pod 0 stepping alone to {HOLD_AT}", interval=2)
    wait_for(lambda: "training mlp on digits" in _log(real_cluster, ns, REPLACEMENT), timeout=600,
             desc="the replacement pod's trainer started", interval=2)

    (shared / "release-0").touch()
    st = wait_job(real_cluster, ns, "digits", lambda st: st.get("phase") in ("Succeeded", "Failed"),
                  desc="the job's end", timeout=600)
    assert st["phase"] == "Succeeded", st
    assert (st.get("result") or {}).get("evalAccuracy", 0) >= 0.7, st  # one epoch of the MLP

    # Pod 0 was never touched: same pod, and it stepped with one participant after the loss.
    assert _uid(real_cluster, ns, "digits-0") == first0
    log0, log1 = _log(real_cluster, ns, "digits-0"), _log(real_cluster, ns, REPLACEMENT)
    steps0 = [(int(s), int(n), h) for s, n, h in STEP_RE.findall(log0)]
    assert [s for s, n, _ in steps0 if n == 1 and s > KILL_AT], steps0
    # The replacement took pod 0's weights at the step it joined, then both stepped together.
    joined = JOINED_RE.findall(log1)
    assert len(joined) == 1, log1[-3000:]
    at, weights = int(joined[0][0]), joined[0][1]
    assert (at, 1, weights) in steps0, (joined, steps0)
    both = {s: h for s, n, h in steps0 if n == 2 and s > at}
    assert both, steps0
    steps1 = {int(s): h for s, _, h in STEP_RE.findall(log1)}
    last = max(set(both) & set(steps1))
    assert steps1[last] == both[last], (last, steps1[last], both[last])

    # The status: one Replace of pod 1, marked per-step; no group restart.
    history = st.get("restartHistory") or []
    assert [(e["kind"], e.get("mode"), e["pod"], e["newPod"]) for e in history] == [
        ("Replace", "perStep", "digits-1", REPLACEMENT)], history
    # Pod 0 trained through the replacement: none of the job's time was recovering (goodput.md).
    assert st["goodput"]["seconds"]["recovering"] == 0, st["goodput"]
