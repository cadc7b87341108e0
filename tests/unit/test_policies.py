"""decisions/policies.py: each policy answers on its own observation and passes on the others;
POLICIES' order settles what wins when several would answer (lifecycle.decide acts on it)."""
from __future__ import annotations

import dataclasses

import pytest

from ddpjob_operator.decisions import policies
from ddpjob_operator.decisions.policies import Act, Failure, Observation

FAILED = Failure("PodFailed", "pod j-1 failed with exit code 1", counted=True)
DELETED = Failure("PodDeleted", "pod j-1 disappeared", counted=True)
EVICTED = Failure("PodEvicted", "pod j-1 was taken away by the cluster: Evicted", counted=False)
BAD = Failure("BadConfiguration", "pod j-0 exited with code 78 (bad configuration)", counted=False, fatal=True)
QUIET = Observation(finished=False, suspend=False, deadline=None, elapsed=10.0, max_restarts=3)


def seen(**facts) -> Observation:
    return dataclasses.replace(QUIET, **facts)


# policy -> (the observation it answers, the action's act and reason)
ANSWERS = {
    policies.keep_finished: (seen(finished=True), Act.KEEP, ""),
    policies.suspend: (seen(suspend=True), Act.SUSPEND, "Suspended"),
    policies.deadline: (seen(deadline=10), Act.FAIL, "DeadlineExceeded"),
    policies.bad_configuration: (seen(lost=((0, BAD),), failures=(BAD,)), Act.FAIL, "BadConfiguration"),
    policies.budget: (seen(counted_restarts=2, in_place=2), Act.FAIL, "RestartLimitExceeded"),
    policies.replace_lost: (seen(lost=((1, EVICTED),), failures=(EVICTED,)), Act.REPLACE, ""),
    policies.restart_group: (seen(lost=((1, FAILED),), failures=(FAILED,)), Act.RESTART, "PodFailed"),
}


def test_the_table_names_every_policy_in_order():
    assert tuple(ANSWERS) == policies.POLICIES


@pytest.mark.parametrize("policy", ANSWERS, ids=lambda p: p.__name__)
def test_each_policy_answers_its_observation(policy):
    obs, act, reason = ANSWERS[policy]
    action = policy(obs)
    assert action is not None and action.act is act and action.reason == reason
    assert policies.first(obs) == action   # and it is what the table answers


@pytest.mark.parametrize("policy", ANSWERS, ids=lambda p: p.__name__)
def test_each_policy_passes_on_a_quiet_pass(policy):
    assert policy(QUIET) is None
    assert policies.first(QUIET) is None   # the steady state


@pytest.mark.parametrize("obs", [
    seen(deadline=11),                                           # 1 s left
    seen(counted_restarts=3),                                    # all used, none asked for
    seen(counted_restarts=2, failures=(FAILED,)),                # the last one
    seen(counted_restarts=3, in_place=5, failures=(EVICTED,)),   # the cluster's doing is free
], ids=["deadline-ahead", "budget-spent-exactly", "last-restart", "free-restart"])
def test_the_deadline_and_budget_pass_short_of_their_limits(obs):
    assert policies.deadline(obs) is None and policies.budget(obs) is None


def test_the_budget_names_the_restart_it_refuses():
    action = policies.budget(seen(counted_restarts=2, in_place=1, failures=(FAILED,)))
    assert action is not None and action.message == (f"{FAILED.message}; failurePolicy.maxRestarts=3 restart(s) "
                                                      "already used (1 of them in place)")
    action = policies.budget(seen(counted_restarts=2, in_place=2))
    assert action is not None and action.message.startswith("2 restart(s) in place and 2 group restart(s)")


@pytest.mark.parametrize("obs", [
    seen(lost=((0, EVICTED),), failures=(EVICTED,)),             # rank 0 hosts the rendezvous store
    seen(lost=((1, FAILED),), failures=(FAILED,)),               # its launcher failed
    seen(lost=((1, EVICTED), (2, FAILED)), failures=(EVICTED, FAILED)),
    seen(lost=((1, DELETED),), failures=(DELETED,), group_only="a Kueue pod group is admitted as a whole"),
], ids=["rank-0", "failed", "one-failed", "group-only"])
def test_a_lost_pod_is_not_replaced_alone_when_the_group_must_restart(obs):
    assert policies.replace_lost(obs) is None
    assert policies.first(obs) == policies.restart_group(obs)


@pytest.mark.parametrize("obs, act", [
    (seen(finished=True, suspend=True, deadline=1), Act.KEEP),          # finished stays finished
    (seen(suspend=True, deadline=1), Act.SUSPEND),                      # a suspended job's clock does not run out
    (seen(deadline=1, failures=(BAD,), lost=((0, BAD),)), Act.FAIL),    # the deadline first
    (seen(counted_restarts=3, failures=(DELETED,), lost=((1, DELETED),)), Act.FAIL),   # no budget to replace
    (seen(lost=((1, DELETED),), failures=(DELETED, FAILED)), Act.REPLACE),   # a stall waits for the replacement
], ids=["keep", "suspend", "deadline", "budget", "replace"])
def test_the_order_settles_what_wins(obs, act):
    action = policies.first(obs)
    assert action is not None and action.act is act


def test_a_group_restart_names_the_failure_that_costs_the_budget():
    action = policies.restart_group(seen(failures=(EVICTED, FAILED)))
    assert action is not None and action.cause is FAILED
    action = policies.restart_group(seen(failures=(EVICTED,)))
    assert action is not None and action.cause is EVICTED and not action.cause.counted
