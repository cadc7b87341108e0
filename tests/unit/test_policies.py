"""lifecycle's policies: each answers on its own reading of a pass and passes on the others;
POLICIES' order settles what wins when several would answer (lifecycle.decide takes the first)."""
from __future__ import annotations

import dataclasses

import pytest

from ddpjob_api.phases import Phase
from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions import lifecycle
from ddpjob_operator.decisions.lifecycle import Decision, Failure, Seen
from tests.support.builders import NOW, make_job, make_pod, running_status

FAILED = Failure("PodFailed", "pod j-1 failed with exit code 1", counted=True)
DELETED = Failure("PodDeleted", "pod j-1 disappeared", counted=True)
EVICTED = Failure("PodEvicted", "pod j-1 was taken away by the cluster: Evicted", counted=False)
BAD = Failure("BadConfiguration", "pod j-0 exited with code 78 (bad configuration)", counted=False, fatal=True)
SPEC = {"nodes": 3, "failurePolicy": {"maxRestarts": 3}, "activeDeadlineSeconds": 110}
# Three running pods, 100 s into attempt 0: every policy passes.
QUIET = lifecycle.observe(make_job(**SPEC), Group.of([make_pod(r) for r in range(3)]), running_status(), now=NOW)


def seen(**facts) -> Seen:
    return dataclasses.replace(QUIET, **facts)


def spent(counted: int, **facts) -> Seen:
    return seen(active=dataclasses.replace(QUIET.active, counted_restarts=counted), **facts)


def lost(*ranked: tuple[int, Failure]) -> dict:
    """The facts of pods lost in this pass: (rank, what its end means) each."""
    return {"lost": [(r, QUIET.current[r], f) for r, f in ranked], "failures": [f for _, f in ranked]}


# What each policy's answer says: stay finished, suspend, fail, replace alone, restart the group.
def act(d: Decision) -> str:
    if d.phase is Phase.FAILED:
        return "fail"
    if d.replaced:
        return "replace"
    return {Phase.SUSPENDED: "suspend", Phase.RESTARTING: "restart"}.get(d.phase, "keep")


# policy -> (the reading it answers, its answer's act and reason)
ANSWERS = {
    lifecycle.keep_finished: (seen(finished=True), "keep", ""),   # the status' reason stays
    lifecycle.suspend: (seen(job=make_job(**SPEC, suspend=True)), "suspend", "Suspended"),
    lifecycle.deadline: (seen(elapsed=110), "fail", "DeadlineExceeded"),
    lifecycle.bad_configuration: (seen(**lost((0, BAD))), "fail", "BadConfiguration"),
    lifecycle.budget: (spent(2, in_place=2), "fail", "RestartLimitExceeded"),
    lifecycle.replace_lost: (seen(**lost((1, EVICTED))), "replace", "ReplacingPod"),
    lifecycle.restart_group: (seen(**lost((1, FAILED))), "restart", "PodFailed"),
}


def first(s: Seen) -> Decision | None:
    return next((d for policy in lifecycle.POLICIES if (d := policy(s)) is not None), None)


def test_the_table_names_every_policy_in_order():
    assert tuple(ANSWERS) == lifecycle.POLICIES


@pytest.mark.parametrize("policy", ANSWERS, ids=lambda p: p.__name__)
def test_each_policy_answers_its_reading(policy):
    s, answer, reason = ANSWERS[policy]
    d = policy(s)
    assert d is not None and act(d) == answer and d.reason == reason
    assert first(s) == d   # and it is what the table answers


def test_a_finished_job_only_gets_its_completion_time():
    d = lifecycle.keep_finished(seen(finished=True))
    assert d == dataclasses.replace(QUIET.base, completion_time=NOW, delete_pods=["j-0", "j-1", "j-2"])


@pytest.mark.parametrize("policy", ANSWERS, ids=lambda p: p.__name__)
def test_each_policy_passes_on_a_quiet_pass(policy):
    assert policy(QUIET) is None
    assert first(QUIET) is None   # the steady state


@pytest.mark.parametrize("s", [
    seen(elapsed=109),                                           # 1 s left
    spent(3),                                                    # all used, none asked for
    spent(2, **lost((1, FAILED))),                               # the last one
    spent(3, in_place=5, **lost((1, EVICTED))),                  # the cluster's doing is free
], ids=["deadline-ahead", "budget-spent-exactly", "last-restart", "free-restart"])
def test_the_deadline_and_budget_pass_short_of_their_limits(s):
    assert lifecycle.deadline(s) is None and lifecycle.budget(s) is None


def test_the_budget_names_the_restart_it_refuses():
    d = lifecycle.budget(spent(2, in_place=1, **lost((1, FAILED))))
    assert d is not None and d.message == (f"{FAILED.message}; failurePolicy.maxRestarts=3 restart(s) "
                                            "already used (1 of them in place)")
    d = lifecycle.budget(spent(2, in_place=2))
    assert d is not None and d.message.startswith("2 restart(s) in place and 2 group restart(s)")


@pytest.mark.parametrize("s", [
    seen(**lost((0, EVICTED))),                                  # rank 0 hosts the rendezvous store
    seen(**lost((1, FAILED))),                                   # its launcher failed
    seen(**lost((1, EVICTED), (2, FAILED))),
    seen(job=make_job(**SPEC, podLabels={"kueue.x-k8s.io/queue-name": "q"}), **lost((1, DELETED))),   # group_only
], ids=["rank-0", "failed", "one-failed", "group-only"])
def test_a_lost_pod_is_not_replaced_alone_when_the_group_must_restart(s):
    assert lifecycle.replace_lost(s) is None
    assert first(s) == lifecycle.restart_group(s)


@pytest.mark.parametrize("s, answer", [
    (seen(finished=True, job=make_job(**SPEC, suspend=True), elapsed=200), "keep"),   # finished stays finished
    (seen(job=make_job(**SPEC, suspend=True), elapsed=200), "suspend"),    # a suspended job's clock does not run out
    (seen(elapsed=200, **lost((0, BAD))), "fail"),                         # the deadline first
    (spent(3, **lost((1, DELETED))), "fail"),                              # no budget to replace
    (seen(lost=[(1, QUIET.current[1], DELETED)], failures=[DELETED, FAILED]), "replace"),   # a stall waits for it
], ids=["keep", "suspend", "deadline", "budget", "replace"])
def test_the_order_settles_what_wins(s, answer):
    d = first(s)
    assert d is not None and act(d) == answer


def test_the_deadline_answers_before_a_bad_configuration():
    d = first(seen(elapsed=200, **lost((0, BAD))))
    assert d is not None and d.reason == "DeadlineExceeded"


def test_a_group_restart_names_the_failure_that_costs_the_budget():
    d = lifecycle.restart_group(seen(failures=[EVICTED, FAILED]))
    assert d is not None and d.restarted is FAILED and d.counted_restarts == 1
    d = lifecycle.restart_group(seen(failures=[EVICTED]))
    assert d is not None and d.restarted is EVICTED and d.counted_restarts == 0
