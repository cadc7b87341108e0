"""job_status: phase, conditions, node counts, events, progress merge (one pure function)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from ddpjob_operator.base.group import Group
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.decisions.status import mlflow_status, node_counts, progress_display
from tests.support.status import condition as cond
from tests.support.builders import NOW, ago, make_job, make_pod, running_status
from tests.support.passes import pass_status


def test_first_pass_status_and_event():
    status, events = pass_status(make_job(nodes=3), Group.of([]), now=NOW, prev_status=None)
    assert status["phase"] == "Pending" and status["restarts"] == 0 and status["attempt"] == 0
    assert status["masterAddr"] == "j-0.j.ns.svc"
    assert status["nodes"] == {"total": 3, "pending": 0, "running": 0, "succeeded": 0, "failed": 0,
                               "ready": "0/3"}
    assert cond(status, "Created")["status"] == "True"
    assert status["startTime"] == "2026-11-22T12:00:00Z" and "completionTime" not in status
    assert events == []  # the first come-up posts no Event: the Created condition says it (status._first_come_up)


def test_cluster_domain_in_master_addr():
    status, _ = pass_status(make_job(nodes=1), Group.of([]), now=NOW, prev_status=None,
                            config=OperatorConfig(cluster_domain="cluster.local"))
    assert status["masterAddr"] == "j-0.j.ns.svc.cluster.local"


@pytest.mark.parametrize("pods,counts", [
    ([make_pod(0), make_pod(1, phase="Pending")], (1, 1, 0, 0)),
    ([make_pod(0, phase="Succeeded"), make_pod(1)], (0, 1, 1, 0)),
    ([make_pod(0, attempt=1), make_pod(1, attempt=0)], (0, 1, 0, 0)),     # other attempts don't count
    ([make_pod(0, attempt=1, deleting=True), make_pod(1, attempt=1, phase="Failed")], (0, 0, 0, 1)),
])
def test_node_counts(pods, counts):
    attempt = 1 if any(p["metadata"]["labels"]["ddpjob.dev/attempt"] == "1" for p in pods) else 0
    c = node_counts(make_job(nodes=2), Group.of(pods).at(attempt))
    assert (c["pending"], c["running"], c["succeeded"], c["failed"]) == counts


@pytest.mark.parametrize("attempt,posted", [(0, []), (2, [("Normal", "Running", "all 2 node(s) running")])])
def test_running_transition_emits_one_event_after_a_restart_none_on_the_first_come_up(attempt, posted):
    pods = [make_pod(0, attempt=attempt), make_pod(1, attempt=attempt)]
    prev = {"phase": "Pending", "startTime": ago(5), "attempt": attempt, "launchedAttempt": attempt, "restarts": attempt}
    status, events = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=prev)
    assert status["phase"] == "Running" and status["nodes"]["ready"] == "2/2" and status["attempt"] == attempt
    assert cond(status, "Running")["status"] == "True"
    assert events == posted
    again, events2 = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=status)
    assert again == status and events2 == []  # nothing changed: no write, no event


def test_restart_status_conditions_and_event():
    pods = [make_pod(0), make_pod(1, phase="Failed", exit_code=3)]
    status, events = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=running_status())
    assert status["phase"] == "Restarting" and status["restarts"] == 1 and status["attempt"] == 1
    assert cond(status, "Restarting")["reason"] == "PodFailed"
    assert "exit code 3" in cond(status, "Restarting")["message"]
    ((kind, reason, message),) = events
    assert (kind, reason) == ("Warning", "Restarting") and "attempt 1" in message


def test_failed_status_has_completion_time_and_reason():
    pods = [make_pod(0, phase="Failed", exit_code=78, message="unknown model"), make_pod(1)]
    prev = running_status(conditions=[{"type": "Running", "status": "True", "reason": "Running",
                                       "lastTransitionTime": ago(60)}])
    status, events = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=prev)
    assert status["phase"] == "Failed" and status["reason"] == "BadConfiguration"
    assert status["completionTime"] == "2026-11-22T12:00:00Z"
    assert cond(status, "Failed")["status"] == "True"
    assert cond(status, "Running")["status"] == "False"
    assert events[0][:2] == ("Warning", "BadConfiguration")


def test_condition_transition_time_only_moves_on_flip():
    pods = [make_pod(0), make_pod(1)]
    first, _ = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status={"phase": "Pending"})
    later = NOW.replace(hour=13)
    second, _ = pass_status(make_job(nodes=2), Group.of(pods), now=later, prev_status=first)
    assert cond(second, "Running")["lastTransitionTime"] == cond(first, "Running")["lastTransitionTime"]


def test_unschedulable_condition_carries_the_scheduler_message():
    pods = [make_pod(0, phase="Pending", unschedulable_for=600), make_pod(1, phase="Pending")]
    status, events = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status={"phase": "Pending"},
                                 config=OperatorConfig(unschedulable_timeout=300))
    c = cond(status, "Unschedulable")
    assert c["status"] == "True" and "Insufficient nvidia.com/gpu" in c["message"]
    assert ("Warning", "Unschedulable", c["message"]) in events
    _, again = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=status,
                           config=OperatorConfig(unschedulable_timeout=300))
    assert again == []


def test_suspended_then_resumed_conditions():
    status, events = pass_status(make_job(nodes=2, suspend=True), Group.of([make_pod(0)]), now=NOW,
                                 prev_status=running_status())
    assert status["phase"] == "Suspended" and cond(status, "Suspended")["status"] == "True"
    assert events[0][1] == "Suspended"
    resumed, events = pass_status(make_job(nodes=2), Group.of([]), now=NOW, prev_status=status)
    assert resumed["phase"] == "Pending" and cond(resumed, "Suspended")["status"] == "False"
    assert events[0][1] == "Resumed"


@dataclass
class Report:
    progress: dict | None = None
    conditions: list = field(default_factory=list)
    events: list = field(default_factory=list)
    stalled: bool = False
    hang_overdue: bool = False
    mlflow_run: tuple | None = None
    ranks: dict = field(default_factory=dict)


def test_monitor_report_merges_progress_and_conditions_by_type():
    pods = [make_pod(0), make_pod(1)]
    prev = running_status(progress={"step": 10, "loss": 2.0},
                          conditions=[{"type": "Stalled", "status": "False", "reason": "Progressing",
                                       "lastTransitionTime": ago(50)}])
    report = Report(progress={"step": 20, "totalSteps": 100, "percent": 20.0},
                    conditions=[{"type": "Stalled", "status": "False", "reason": "Progressing", "message": "ok"},
                                {"type": "Straggler", "status": "True", "reason": "SlowRank", "message": "rank 3"}])
    status, _ = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=prev, report=report)
    assert status["progress"] == {"step": 20, "loss": 2.0, "totalSteps": 100, "percent": 20.0,
                                  "display": "20% (20/100)"}
    assert cond(status, "Stalled")["lastTransitionTime"] == ago(50)  # unchanged status keeps its time
    assert cond(status, "Straggler")["status"] == "True"
    assert [c["type"] for c in status["conditions"]].count("Stalled") == 1


def test_progress_kept_between_scrapes():
    prev = running_status(progress={"step": 5, "display": "step 5"})
    status, _ = pass_status(make_job(nodes=2), Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=prev)
    assert status["progress"]["step"] == 5


# The last periodic write of a run that then ends, and the result its rank 0 reports (issue 51).
LAST_WRITE = {"step": 183, "totalSteps": 276, "percent": 66.3, "loss": 0.21, "samplesPerSecond": 812.0,
              "eta": "3s", "etaSeconds": 3, "evalAccuracy": 0.935933, "display": "66% (183/276)"}
RESULT = {"steps": 276, "total_steps": 276, "epochs_completed": 12, "world_size": 2, "resumed_from_step": 0,
          "train_samples_per_second": 790.5, "eval_accuracy": 0.969359, "eval_loss": 0.11, "eval_samples": 359,
          "eval_dataset_size": 359, "last_checkpoint": None}


def _failed(rank, step):
    from ddpjob_api.contract import failure_head

    return make_pod(rank, phase="Failed", exit_code=1, message=failure_head(1, step) + "\nRuntimeError: boom")


@pytest.mark.parametrize("spec, pods, phase, progress", [
    # Succeeded: the last step, 100 %, the final evaluation and throughput from the result; no ETA.
    ({}, [make_pod(0, phase="Succeeded", exit_code=0, message=json.dumps(RESULT)),
          make_pod(1, phase="Succeeded", exit_code=0)], "Succeeded",
     {"step": 276, "totalSteps": 276, "percent": 100.0, "loss": 0.21, "samplesPerSecond": 790.5,
      "evalAccuracy": 0.969359, "evalLoss": 0.11, "display": "100% (276/276)"}),
    # Failed: where it stopped (a failed pod's termination message is newer than the last scrape).
    ({"failurePolicy": {"maxRestarts": 0}}, [_failed(0, 191), make_pod(1)], "Failed",
     {**{k: v for k, v in LAST_WRITE.items() if k not in ("eta", "etaSeconds")}, "step": 191, "percent": 69.2,
      "display": "69% (191/276)"}),
    # Suspended, and a group restart: as far as it came, no ETA (a new attempt measures its own).
    ({"suspend": True}, [make_pod(0), make_pod(1)], "Suspended",
     {k: v for k, v in LAST_WRITE.items() if k not in ("eta", "etaSeconds")}),
    ({"failurePolicy": {"maxRestarts": 3}}, [_failed(0, 180), make_pod(1)], "Restarting",
     {k: v for k, v in LAST_WRITE.items() if k not in ("eta", "etaSeconds")}),
])
def test_the_phase_change_writes_where_the_job_ended_and_no_eta(spec, pods, phase, progress):
    job = make_job(nodes=2, **spec)
    # The pass that sees it end still holds the running job's last scrape, ETA and all.
    last_scrape = Report(progress={k: v for k, v in LAST_WRITE.items() if k != "display"})
    status, events = pass_status(job, Group.of(pods), now=NOW, prev_status=running_status(progress=LAST_WRITE),
                                 report=last_scrape)
    assert status["phase"] == phase and status["progress"] == progress
    assert len(events) == 1  # the phase change's own write: the progress rides in it
    if phase == "Succeeded":
        assert status["progress"]["step"] == status["result"]["steps"]
    again, events = pass_status(job, Group.of(pods), now=NOW, prev_status=status)
    assert again == status and events == []  # settled: the passes after it write nothing


def test_a_running_jobs_eta_is_its_latest_scrapes():
    pods = [make_pod(0), make_pod(1)]
    prev = running_status(progress=LAST_WRITE)
    # A scrape of a (new) attempt that has no rate yet: blank, not the old attempt's forecast.
    status, _ = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=prev,
                            report=Report(progress={"step": 10, "totalSteps": 276, "percent": 3.6}))
    assert "eta" not in status["progress"] and "etaSeconds" not in status["progress"]
    assert status["progress"]["evalAccuracy"] == LAST_WRITE["evalAccuracy"]  # the last known stays
    status, _ = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=status,
                            report=Report(progress={"step": 12, "eta": "1m", "etaSeconds": 60}))
    assert (status["progress"]["eta"], status["progress"]["etaSeconds"]) == ("1m", 60)
    # A pass with no scrape keeps what the last one said.
    again, _ = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=status)
    assert again["progress"] == status["progress"]


@pytest.mark.parametrize("progress,text", [
    (None, None), ({}, None), ({"step": 7}, "step 7"), ({"step": 7, "totalSteps": 10}, "step 7/10"),
    ({"percent": 42.4, "step": 424, "totalSteps": 1000}, "42% (424/1000)"),
])
def test_progress_display(progress, text):
    assert progress_display(progress) == text


def test_status_patch_nulls_removed_keys():
    from ddpjob_operator.app.controller import status_patch

    assert status_patch({"phase": "Failed", "completionTime": "t", "restarts": 1},
                        {"phase": "Pending", "restarts": 1}) == {"phase": "Pending", "restarts": 1,
                                                                 "completionTime": None}


def test_status_patch_nulls_keys_removed_inside_objects_so_the_api_server_drops_them():
    """A merge patch merges objects: the ETA a finished job's progress leaves out is deleted only
    by a null (as the API server applies it, here by the RFC 7386 algorithm)."""
    from ddpjob_operator.app.controller import status_patch

    def apply(target, patch):  # RFC 7386 MergePatch
        if not isinstance(patch, dict):
            return patch
        out = dict(target) if isinstance(target, dict) else {}
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = apply(out.get(k), v)
        return out

    prev = {"phase": "Running", "progress": {"step": 183, "eta": "3s", "etaSeconds": 3, "slowestRank": 1},
            "conditions": [{"type": "Running"}, {"type": "Stalled"}], "nodes": {"running": 2}}
    new = {"phase": "Succeeded", "progress": {"step": 276, "percent": 100.0}, "conditions": [{"type": "Running"}],
           "nodes": {"running": 0}, "result": {"steps": 276}}
    patch = status_patch(prev, new)
    assert patch["progress"] == {"step": 276, "percent": 100.0, "eta": None, "etaSeconds": None, "slowestRank": None}
    assert apply(prev, patch) == new


@pytest.mark.parametrize("refs,owned", [([{"uid": "u1"}], True), ([{"uid": "other"}], False), (None, False)])
def test_only_pods_owned_by_this_job_uid_count(refs, owned):
    from ddpjob_operator.base.objmeta import owned_by

    assert owned_by({"metadata": {"ownerReferences": refs}}, "u1") is owned


def test_handlers_never_need_finalizers():
    import kopf

    from ddpjob_operator.base.config import OperatorConfig
    from ddpjob_operator.app.controller import Reconciler
    from ddpjob_operator.app.handlers import register
    from ddpjob_operator.app.operator_metrics import OperatorMetrics
    from prometheus_client import CollectorRegistry

    registry = kopf.OperatorRegistry()
    register(registry, Reconciler(OperatorConfig(), k8s=None, metrics=OperatorMetrics(CollectorRegistry()),
                                  monitor=None))
    handlers = [h for reg in (registry._watching, registry._changing, registry._spawning)
                for h in reg.get_all_handlers()]
    # Watch-only handlers (the DDPJob watch; pods may come through kopf or the operator's own informer).
    assert any((h.selector.group, h.selector.any_name) == ("ddpjob.dev", "ddpjobs") for h in handlers)
    assert not any(getattr(h, "requires_finalizer", None) for h in handlers)
    assert not list(registry._spawning.get_all_handlers())  # no per-object timers/daemons
    # No handler reads kopf's diffs (the operator's settings give kopf a diff base that keeps nothing).
    assert not list(registry._changing.get_all_handlers())


def test_kopf_copies_no_ddpjob_body_per_event(monkeypatch):
    """kopf hands each DDPJob event to our handler without deep-copying the body to build a diff
    (its default copies status, managedFields and all, for every event)."""
    import asyncio
    import copy

    import kopf
    from kopf._cogs.structs import ephemera, references
    from kopf._core.actions import lifecycles
    from kopf._core.engines import indexing
    from kopf._core.reactor import inventory, processing

    from ddpjob_operator.base.config import OperatorConfig
    from ddpjob_operator.app.handlers import register
    from ddpjob_operator.app.operator_main import operator_settings

    class Seen:
        def __init__(self):
            self.events = []

        def job_event(self, obj):
            self.events.append(obj)

        job_deleted = job_event

    copied, deepcopy = [], copy.deepcopy

    def spy(x, memo=None, _nil=[]):  # noqa: B006  (copy.deepcopy's own signature)
        copied.append(x)
        return deepcopy(x, memo)

    monkeypatch.setattr(copy, "deepcopy", spy)
    seen = Seen()
    registry = kopf.OperatorRegistry()
    register(registry, seen)
    obj = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob",
           "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "resourceVersion": "7",
                        "managedFields": [{"manager": "ddpjob-operator", "fieldsV1": {"f:status": {}}}]},
           "spec": {"image": "x", "nodes": 2},
           "status": {"phase": "Running", "restartHistory": [{"restart": 1}], "progress": {"step": 3}}}
    resource = references.Resource("ddpjob.dev", "v1alpha1", "ddpjobs", kind="DDPJob", namespaced=True,
                                   verbs=["list", "watch", "patch"])
    asyncio.run(processing.process_resource_event(
        lifecycle=lifecycles.all_at_once, indexers=indexing.OperatorIndexers(), registry=registry,
        settings=operator_settings(OperatorConfig()), memories=inventory.ResourceMemories(), memobase=ephemera.Memo(),
        resource=resource, raw_event={"type": "MODIFIED", "object": obj}, event_queue=asyncio.Queue(),
        no_throttling=True))
    assert [e["metadata"]["uid"] for e in seen.events] == ["u1"]

    def holds(x, part):  # `part` itself, or inside the copied container
        return x is part or (isinstance(x, (dict, list)) and any(
            holds(v, part) for v in (x.values() if isinstance(x, dict) else x)))

    assert not any(holds(x, obj["status"]) or holds(x, obj["metadata"]["managedFields"]) for x in copied)


def test_operator_settings_bound_watches_and_peering():
    from ddpjob_operator.base.config import OperatorConfig
    from ddpjob_operator.app.operator_main import operator_settings

    s = operator_settings(OperatorConfig(peering=""))
    assert s.watching.server_timeout and s.watching.client_timeout > s.watching.server_timeout
    assert s.peering.standalone is True
    s = operator_settings(OperatorConfig(peering="ddpjob", priority=7))
    assert (s.peering.standalone, s.peering.name, s.peering.priority) == (False, "ddpjob", 7)


def _node_lost(rank, node="node-b"):
    """What the node lifecycle controller leaves on a running pod whose kubelet stopped reporting."""
    pod = make_pod(rank, node_name=node)
    pod["status"]["conditions"] += [{"type": "Ready", "status": "False"},
                                    {"type": "ContainersReady", "status": "True"}]
    return pod


@pytest.mark.parametrize("ready, containers, shown", [
    ("False", "True", True),      # node NotReady: the pod was marked unready over the kubelet's head
    ("False", "False", False),    # the container itself is not ready (a probe): not a node problem
    ("True", "True", False),
])
def test_a_pod_whose_node_stopped_reporting_is_named_in_a_condition(ready, containers, shown):
    p1 = make_pod(1, node_name="node-b")
    p1["status"]["conditions"] += [{"type": "Ready", "status": ready},
                                   {"type": "ContainersReady", "status": containers}]
    status, events = pass_status(make_job(nodes=2), Group.of([make_pod(0), p1]), now=NOW, prev_status=running_status())
    c = cond(status, "NodeNotReady")
    assert (c is not None and c["status"] == "True") is shown
    if shown:
        assert "pod j-1 on node node-b" in c["message"] and status["phase"] == "Running"
        assert [e for e in events if e[1] == "NodeNotReady"]


def test_node_not_ready_clears_when_the_node_reports_again_and_warns_once():
    pods = [make_pod(0), _node_lost(1)]
    first, ev1 = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=running_status())
    again, ev2 = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=first)
    assert [e[1] for e in ev1].count("NodeNotReady") == 1 and not [e for e in ev2 if e[1] == "NodeNotReady"]
    back, _ = pass_status(make_job(nodes=2), Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=again)
    assert cond(back, "NodeNotReady")["status"] == "False" and cond(back, "NodeNotReady")["reason"] == "NodesReady"


RUN = ("0a1b2c3d4e5f60718293a4b5c6d7e8f9", "7")


@pytest.mark.parametrize("mlflow, default, prev, run, expected", [
    # First report: the run and its page (the URI's userinfo never shown).
    ({"trackingUri": "https://user:pw@mlflow.example/"}, "", None, RUN,
     {"runId": RUN[0], "experimentId": "7", "url": f"https://mlflow.example/#/experiments/7/runs/{RUN[0]}"}),
    ({}, "http://platform:5000", None, RUN,
     {"runId": RUN[0], "experimentId": "7", "url": f"http://platform:5000/#/experiments/7/runs/{RUN[0]}"}),
    # A URI that is not a web server's has no page.
    ({"trackingUri": "file:///data/mlruns"}, "", None, RUN, {"runId": RUN[0], "experimentId": "7"}),
    # Kept while nothing reports, and as it was while the same run is reported (no write per scrape).
    ({}, "http://p", {"runId": RUN[0], "experimentId": "7", "url": "kept"}, None,
     {"runId": RUN[0], "experimentId": "7", "url": "kept"}),
    ({}, "http://p", {"runId": RUN[0], "experimentId": "7", "url": "kept"}, RUN,
     {"runId": RUN[0], "experimentId": "7", "url": "kept"}),
    # Another run (a user's spec.env MLFLOW_RUN_ID, say): the one reported now.
    ({"trackingUri": "http://m"}, "", {"runId": "old", "experimentId": "1"}, RUN,
     {"runId": RUN[0], "experimentId": "7", "url": f"http://m/#/experiments/7/runs/{RUN[0]}"}),
    ({"trackingUri": "http://m"}, "", None, None, None),
])
def test_mlflow_status(mlflow, default, prev, run, expected):
    job = make_job(nodes=1, trainer={"mlflow": mlflow})
    assert mlflow_status(job, prev=prev, run=run, default_tracking_uri=default) == expected


def test_the_run_the_ranks_report_is_written_into_status_once():
    job = make_job(nodes=2, trainer={"mlflow": {"trackingUri": "http://m:5000"}})
    pods = [make_pod(0), make_pod(1)]
    first, _ = pass_status(job, Group.of(pods), now=NOW, prev_status=running_status(), report=Report(mlflow_run=RUN))
    assert first["mlflow"]["runId"] == RUN[0]
    again, _ = pass_status(job, Group.of(pods), now=NOW, prev_status=first, report=Report(mlflow_run=RUN))
    quiet, _ = pass_status(job, Group.of(pods), now=NOW, prev_status=first, report=Report())
    assert again["mlflow"] == quiet["mlflow"] == first["mlflow"]
