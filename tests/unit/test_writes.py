"""When a running job's status is written, and when a scrape is worth a pass (decisions/writes.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from ddpjob_api.phases import Phase, Reason
from ddpjob_operator.base import podinfo
from ddpjob_operator.decisions.lifecycle import Decision, StartError
from ddpjob_operator.decisions.writes import (progress_interval_now, quiet_come_up, scrape_needs_pass, urgent,
                                              write_wait, yield_factor)
from tests.support.builders import make_job, make_pod

STEPS = {"step": 10, "totalSteps": 100, "percent": 10.0, "display": "10% (10/100)"}
CALM = {"type": "Stalled", "status": "False", "reason": "Progressing", "message": "in train, after step 10",
        "lastTransitionTime": "t0"}
RUNNING = {"type": "Running", "status": "True", "reason": "Running", "message": "2/2 running",
           "lastTransitionTime": "t0"}


def status(**kw) -> dict:
    base = {"phase": "Running", "attempt": 0, "nodes": {"running": 2}, "progress": STEPS,
            "conditions": [RUNNING, CALM]}
    return {**base, **kw}


def cond(c: dict, **kw) -> dict:
    return {**c, **kw}


@pytest.mark.parametrize("new, events, expected", [
    (status(), 0, False),                                                     # nothing changed
    (status(progress={**STEPS, "step": 20}), 0, False),                       # progress: waits
    (status(nodes={"running": 1}), 0, False),                                 # node counts: coalesce
    (status(conditions=[RUNNING, cond(CALM, message="in train, after step 20")]), 0, False),  # wording
    (status(phase="Succeeded"), 0, True),                                     # a transition
    (status(conditions=[RUNNING, cond(CALM, status="True", reason="NoProgress")]), 0, True),
    (status(conditions=[cond(RUNNING, message="1/2 running"), CALM]), 0, True),  # not the monitor's
    (status(conditions=[RUNNING]), 0, True),                                  # a condition went away
    (status(attempt=1, restarts=1), 0, True),       # what the next pods carry: before they are made
    (status(progress={"unavailable": "on kwok"}), 0, True),                   # what progress *is*
    (status(progress={**STEPS, "step": 20}), 1, True),                        # with an event
])
def test_urgent(new, events, expected):
    assert urgent(status(), new, events=events) is expected


def test_the_first_status_and_the_first_progress_are_written_at_once():
    assert urgent({}, status(), events=0)
    assert urgent(status(progress=None), status(), events=0)


@pytest.mark.parametrize("new, since, expected", [
    (status(progress={**STEPS, "step": 20}), 5.0, 25.0),       # progress alone: the progress interval
    (status(progress={**STEPS, "step": 20}), 31.0, 0.0),
    (status(nodes={"running": 1}), 1.0, 4.0),                  # node counts: the coalescing window
    (status(nodes={"running": 1}, progress={**STEPS, "step": 20}), 1.0, 4.0),  # ... carrying progress along
    (status(progress={**STEPS, "step": 20}), float("inf"), 0.0),  # never written by this process
])
def test_write_wait(new, since, expected):
    assert write_wait(status(), new, since_write=since, coalesce=5.0, progress_interval=30.0) == expected


@pytest.mark.parametrize("coming_up, expected", [
    (0, 30.0),        # nothing coming up: the configured interval
    (10, 33.0),       # a few jobs starting barely move it
    (100, 60.0),      # each PROGRESS_YIELD_JOBS add one interval
    (250, 105.0),
    (1_000, 120.0),   # a burst: at most PROGRESS_YIELD_MAX times it
    (50_000, 120.0),
])
def test_progress_yields_to_jobs_coming_up(coming_up, expected):
    assert progress_interval_now(30.0, coming_up) == pytest.approx(expected)
    assert progress_interval_now(0.0, coming_up) == 0.0   # progress written at every scrape stays so


def coming_up(phase: str = "Pending", **kw) -> dict:
    base = {"phase": phase, "attempt": 0, "launchedAttempt": -1, "nodes": {"pending": 0, "running": 0},
            "conditions": [{"type": "Created", "status": "True", "reason": "Created", "message": "2 pod(s)"}]}
    return {**base, **kw}


@pytest.mark.parametrize("new, expected", [
    (coming_up(nodes={"pending": 2, "running": 0}), None),                  # pods made: not alone
    (coming_up(nodes={"pending": 1, "running": 1}, launchedAttempt=0), None),  # one started
    (coming_up("Restarting", nodes={"pending": 1, "running": 1}), None),   # a restart's new group
    (coming_up("Running", nodes={"pending": 0, "running": 2}), 0.0),       # all Running: due (urgent)
])
def test_node_counts_of_pods_coming_up_wait_for_the_next_write_that_is_due(new, expected):
    """At most two writes while an attempt's pods come up: the attempt created, then all Running."""
    prev = coming_up(new["phase"])
    assert not urgent(prev, new, events=0) or new["phase"] == "Running"
    assert write_wait(prev, new, since_write=5.0, coalesce=5.0, progress_interval=30.0) == expected


def test_what_else_changes_while_pods_come_up_keeps_its_own_interval():
    """A restarting job's progress losing its ETA (not quiet, not urgent) is written at the
    progress interval, node counts riding along."""
    prev = coming_up("Restarting", progress={"step": 5, "eta": "1m"})
    new = coming_up("Restarting", progress={"step": 5}, nodes={"pending": 2, "running": 0})
    assert not urgent(prev, new, events=0)
    assert write_wait(prev, new, since_write=5.0, coalesce=5.0, progress_interval=30.0) == 25.0


def needs(prev=None, *, progress=None, conditions=(), events=0, mlflow_run=None, due=False) -> bool:
    return scrape_needs_pass(status() if prev is None else prev, progress=progress, conditions=list(conditions),
                             events=events, mlflow_run=mlflow_run, progress_due=due)


@pytest.mark.parametrize("kw, expected", [
    ({}, False),                                                              # nothing answered
    ({"progress": {"step": 20}}, False),                                      # new step, not due yet
    ({"progress": {"step": 20}, "due": True}, True),                          # new step, due
    ({"progress": {"step": 10}, "due": True}, False),                         # due, but nothing new
    ({"conditions": [cond(CALM, message="after step 20")]}, False),           # the wording only
    ({"conditions": [cond(CALM, status="True", reason="NoProgress")]}, True),  # a hang
    ({"conditions": [{"type": "Straggler", "status": "False", "reason": "NoStraggler"}]}, True),  # first time
    ({"events": 1}, True),
    ({"mlflow_run": ("r1", "e1")}, True),                                     # a run first reported
    ({"prev": status(mlflow={"runId": "r1"}), "mlflow_run": ("r1", "e1")}, False),
    ({"prev": status(progress=None), "progress": {"step": 1}}, True),         # the first progress
    ({"prev": status(progress=None), "progress": {"unavailable": "kwok"}}, True),
    ({"prev": status(progress={"unavailable": "kwok"}), "progress": {"unavailable": "kwok"}, "due": True}, False),
])
def test_scrape_needs_pass(kw, expected):
    assert needs(**kw) is expected


@pytest.mark.parametrize("coming_up, expected", [(0, 1.0), (100, 2.0), (250, 3.5), (1_000, 4.0)])
def test_what_can_wait_waits_longer_while_jobs_come_up(coming_up, expected):
    assert yield_factor(coming_up) == pytest.approx(expected)


def pod_in(phase: str = "Pending", **status) -> dict:
    pod = make_pod(phase=phase)
    pod["status"].pop("containerStatuses", None)
    pod["status"].update(status)
    return pod


def waiting(reason: str) -> list[dict]:
    return [{"name": "trainer", "state": {"waiting": {"reason": reason}}}]


@pytest.mark.parametrize("pod, plain", [
    (pod_in(), True),                                                                       # created
    (pod_in(conditions=[{"type": "PodScheduled", "status": "True"}]), True),                # scheduled
    (pod_in(containerStatuses=waiting("ContainerCreating")), True),                        # starting
    (pod_in(initContainerStatuses=waiting("PodInitializing")), True),
    (pod_in("Running", containerStatuses=[{"name": "trainer", "state": {"running": {}}}]), True),  # started
    (pod_in(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]), False),
    (pod_in(containerStatuses=waiting("ImagePullBackOff")), False),                         # a start error
    (pod_in(containerStatuses=waiting("SomethingNew")), False),                             # unknown: shown
    (pod_in("Failed"), False),
    (pod_in("Running", containerStatuses=[{"name": "trainer", "state": {"terminated": {"exitCode": 1}}}]), False),
    (pod_in("Running", conditions=[{"type": "Ready", "status": "False"},                    # its node is lost
                                   {"type": "ContainersReady", "status": "True"}]), False),
])
def test_a_pod_moves_plainly_only_while_it_shows_nothing_but_its_start(pod, plain):
    assert podinfo.plain_progress(pod) is plain
    gated = pod_in()
    gated.setdefault("spec", {})["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    assert not podinfo.plain_progress(gated)
    deleting = pod_in()
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not podinfo.plain_progress(deleting)


WAITING = Decision(phase=Phase.PENDING, reason=Reason.CREATED, message="waiting for 2 node(s) to start", attempt=0,
                   launched_attempt=-1, restarts=0, counted_restarts=0, start_time=None, completion_time=None)


@pytest.mark.parametrize("job, d, refused, quiet", [
    (make_job(), WAITING, False, True),
    (make_job(), replace(WAITING, create_ranks=[0, 1]), False, True),           # the pass that creates them
    (make_job(), WAITING, True, False),                                          # a create refused
    (make_job(), replace(WAITING, attempt=1), False, False),                     # a restart's group
    (make_job(), replace(WAITING, phase=Phase.RUNNING, reason=Reason.RUNNING), False, False),
    (make_job(), replace(WAITING, reason=Reason.RESUMED), False, False),
    (make_job(), replace(WAITING, unschedulable="0/4 nodes are available"), False, False),
    (make_job(), replace(WAITING, start_errors=[StartError("j-0", "trainer", "ErrImagePull", "")]), False, False),
    (make_job(), replace(WAITING, delete_pods=["j-0-a1"]), False, False),
    (make_job(scheduling={"gang": {"scheduler": "coscheduling"}}), WAITING, False, False),   # GangScheduled
    (make_job(podLabels={"kueue.x-k8s.io/queue-name": "q"}), WAITING, False, False),         # Admitted
    (make_job(elastic={"minNodes": 1, "maxNodes": 2}), WAITING, False, False),
    (make_job(faultTolerance={"mode": "perStep", "minReplicas": 1, "timeoutSeconds": 3}),
     replace(WAITING, lighthouse_ready=False), False, False),                               # LighthouseReady
])
def test_only_a_plain_jobs_first_come_up_is_quiet(job, d, refused, quiet):
    assert quiet_come_up(job, d, refused=refused) is quiet
