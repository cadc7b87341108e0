"""The pod cache keeps only what the operator reads (base/podinfo.slim): every reader of a pod
answers the same on the slim pod as on the whole one.

The table: real pods as the API server served them (managedFields included), captured from the
local control plane's real kubelet nodes and kwok nodes while the cluster tiers ran (tests/unit/data/
pods.json: pending on no node, pulling, running, succeeded, failed with a termination message,
terminating), and the builders' pods for what those did not catch (evicted, a DisruptionTarget,
unschedulable, restart-counter annotations).
"""
from __future__ import annotations

import datetime as dt
import inspect
import json
from pathlib import Path

import pytest

from ddpjob_api import labels
from ddpjob_operator.base import objmeta, podinfo
from ddpjob_operator.base.group import Group
from ddpjob_operator.builders import gang, kueue
from ddpjob_operator.cluster.cache import pod_store
from ddpjob_operator.cluster.monitor import scrape_url
from ddpjob_operator.decisions import lifecycle
from ddpjob_operator.decisions.status import failure_evidence, job_status
from tests.support.builders import EVICTION_MESSAGE, NOW, make_job, make_pod

REAL = json.loads((Path(__file__).parent / "data" / "pods.json").read_text())["items"]
BUILT = [
    make_pod(0, evicted=True), make_pod(1, disruption="DeletionByPodGC", phase="Failed"),
    make_pod(0, phase="Pending", unschedulable_for=30), make_pod(1, deleting=5.0),
    make_pod(0, exit_code=1, message="Traceback ...\nRuntimeError: NCCL error", phase="Failed"),
    make_pod(1, restarts=2, counted_restarts=1, node_name="n1", pod_ip="10.0.0.7"),
]
PODS = REAL + BUILT


def _ids(pods):
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}:{(p.get('status') or {}).get('phase')}" for p in pods]


def test_the_table_holds_the_states_the_operator_tells_apart():
    phases = {(p.get("status") or {}).get("phase") for p in REAL}
    assert {"Pending", "Running", "Succeeded", "Failed"} <= phases
    assert any(p["metadata"].get("managedFields") for p in REAL)
    assert any(podinfo.terminated_states(p) for p in REAL) and any(podinfo.terminating(p) for p in REAL)
    assert EVICTION_MESSAGE in json.dumps(BUILT)


# podinfo's readers of one pod: every public function whose only parameter is the pod (not `meta`,
# the metadata itself, whose readers are these, nor `slim`).
READERS = [f for name, f in vars(podinfo).items() if inspect.isfunction(f) and not name.startswith("_")
           and name not in ("meta", "slim") and f.__module__ == podinfo.__name__
           and list(inspect.signature(f).parameters) == ["pod"]]


@pytest.mark.parametrize("pod", PODS, ids=_ids(PODS))
def test_every_reader_of_a_pod_answers_the_same_on_the_slim_pod(pod):
    slim = podinfo.slim(pod)
    assert {f.__name__ for f in READERS} >= {"phase", "rank", "attempt", "exit_code", "unschedulable_since",
                                             "node_not_ready", "failure_message", "trainer_state", "gone_by"}
    for f in READERS:
        assert f(slim) == f(pod), f.__name__
    for kw in ({}, {"gone": True}, {"with_log": True}):
        assert lifecycle.verdict(slim, **kw) == lifecycle.verdict(pod, **kw), kw
    assert lifecycle.disruption(slim) == lifecycle.disruption(pod)
    assert lifecycle.start_errors([slim]) == lifecycle.start_errors([pod])
    for key in (labels.RESTARTS, labels.COUNTED_RESTARTS):
        assert lifecycle._annotation(slim, key) == lifecycle._annotation(pod, key)
    uid = ((pod["metadata"].get("ownerReferences") or [{}])[0]).get("uid", "")
    assert objmeta.owned_by(slim, uid) == objmeta.owned_by(pod, uid)
    assert kueue.gated(slim) == kueue.gated(pod)
    assert lifecycle._leftover_until(slim, NOW) == lifecycle._leftover_until(pod, NOW)
    for template in ("", "http://127.0.0.1:1/{namespace}/{job}/{rank}/{pod}"):
        assert (scrape_url(template, pod=slim, port=9400, job_name="j", namespace="ns")
                == scrape_url(template, pod=pod, port=9400, job_name="j", namespace="ns"))


def _jobs(pods):
    """The table's pods by their job, with a DDPJob of that job's size owning them."""
    by_job: dict[tuple[str, str], list[dict]] = {}
    for pod in pods:
        meta = pod["metadata"]
        by_job.setdefault((meta["namespace"], meta["labels"][labels.JOB_NAME]), []).append(pod)
    for (ns, name), group in sorted(by_job.items()):
        uid = next((r["uid"] for p in group for r in p["metadata"].get("ownerReferences") or []), f"uid-{name}")
        yield make_job(name, namespace=ns, uid=uid, nodes=max(podinfo.rank(p) for p in group) + 1), group


@pytest.mark.parametrize("with_log", [False, True])
def test_decisions_and_status_are_the_same_on_slim_pods(with_log):
    """What a pass decides and writes, for each job of the table, whole pods or slim ones."""
    now = NOW if not REAL else max(dt.datetime.fromisoformat(p["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
                                   for p in REAL) + dt.timedelta(minutes=1)
    jobs = list(_jobs(PODS))
    assert len(jobs) >= 4
    for job, pods in jobs:
        if with_log:
            job = make_job(job.name, namespace=job.namespace, uid=job.uid, nodes=job.spec.nodes,
                           failurePolicy={"logTailInStatus": True})
        whole, slim = Group.of(pods), Group.of([podinfo.slim(p) for p in pods])
        for prev in (None, {"phase": "Running", "attempt": 0, "launchedAttempt": 0}):
            a = lifecycle.decide(job, whole, now=now, prev_status=prev)
            b = lifecycle.decide(job, slim, now=now, prev_status=prev)
            assert a == b, job.name
            assert (job_status(job, whole, now=now, prev_status=prev, decision=a)
                    == job_status(job, slim, now=now, prev_status=prev, decision=b)), job.name
        attempt = whole.at(0)
        assert failure_evidence(attempt, with_log=True) == failure_evidence(slim.at(0), with_log=True)
        assert gang.gang_state(job, attempt, podgroup=None) == gang.gang_state(job, slim.at(0), podgroup=None)
        assert kueue.admission(job, attempt) == kueue.admission(job, slim.at(0))


def test_the_pod_cache_keeps_slim_pods_packed():
    store = pod_store()
    pods = [p for p in REAL if p["metadata"].get("managedFields")]
    for pod in pods:
        store.upsert(json.loads(json.dumps(pod)))   # each its own decoded copy, as from a watch
    kept = [store.get(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods]
    for pod, slim in zip(pods, kept):
        assert slim == podinfo.slim(pod)
        assert "managedFields" not in slim["metadata"] and "containers" not in slim["spec"]
        assert "volumes" not in slim["spec"] and "image" not in json.dumps(slim.get("status"))
        entry = store._objs[(pod["metadata"]["namespace"], pod["metadata"]["name"])]
        assert len(entry.blob) < len(json.dumps(pod)) / 3
        # Deflated against the cache's exemplar of our Running pods: a fraction of even the slim
        # JSON; other phases (their reasons and messages) less so.
        compact = len(json.dumps(slim, separators=(",", ":")))
        assert len(entry.blob) < compact / (4 if podinfo.phase(slim) == "Running" else 2), pod["metadata"]["name"]


def test_slim_leaves_the_pod_it_was_given_as_it_was():
    pod = json.loads(json.dumps(REAL[0]))
    podinfo.slim(pod)
    assert pod == REAL[0]
