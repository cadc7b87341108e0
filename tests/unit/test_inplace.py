"""Restarts in place as status (decisions/inplace.py, through job_status and decide): the history
entry of each restart, its cause among the peers that failed with it, its recovery, the Restarting
condition and events, and the budget they share with group restarts."""
from __future__ import annotations

from tests.unit.test_status import Report  # the status tests' MonitorReport stand-in

from dataclasses import dataclass, field

import pytest

from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions import inplace
from ddpjob_operator.decisions.lifecycle import MAX_ATTEMPT, decide
from tests.support.builders import NOW, make_job, make_pod, running_status
from tests.support.status import condition as cond
from tests.support.passes import pass_status

T0 = 1_800_000_000.0  # a failure's Unix time on the pods' clock


@dataclass
class Sample:
    """What samples.RankSample carries for these decisions."""

    pod: str
    node: str | None = "n1"
    worker_failures: list = field(default_factory=list)
    first_step_timestamp: float | None = None
    resumed_from_step: int | None = None
    step: int | None = None
    last_step_timestamp: float | None = None


def failure(t: float, *, code: int = -9, signal: str = "SIGKILL", restart: int = 0, restarted: bool = True,
            error: str = "killed by SIGKILL", step: str = "") -> dict:
    return {"restart": str(restart), "exit_code": str(code), "signal": signal, "error": error,
            "restarted": "true" if restarted else "false", "time": t, "step": step}




def step(prev: dict, ranks: dict, *, job=None) -> tuple[dict, list]:
    job = job or make_job(nodes=2, failurePolicy={"maxRestarts": 3})
    return pass_status(job, Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=prev, report=Report(ranks=ranks))


STALL = "stalled: no progress for 31s in training after step 6 (hang timeout 30s)"


@pytest.mark.parametrize("error,reason,message", [
    (STALL, "Stalled", STALL),                          # the agent's own words: shown without logTailInStatus
    ("stalled: no progress for 31s in training; rm -rf (hang timeout 30s)", None, None),  # not its form
    ("killed by SIGKILL", None, None),
])
def test_a_worker_killed_for_a_stall_is_an_in_place_restart_with_reason_stalled(error, reason, message):
    ranks = {0: Sample("j-0", "n0"), 1: Sample("j-1", "n1", worker_failures=[failure(T0, error=error)])}
    st, events = step(running_status(), ranks)
    (entry,) = st["restartHistory"]
    assert (entry["rank"], entry["pod"], entry["node"]) == (1, "j-1", "n1")
    assert (entry.get("reason"), entry.get("message")) == (reason, message)
    assert st["inPlaceRestarts"] == 1  # counted against failurePolicy.maxRestarts like any failure
    if reason:
        c = cond(st, "Restarting")
        assert f"rank 1 (pod j-1 on node n1) {STALL}: its agent killed the worker" in c["message"]
        assert f"rank 1 (pod j-1 on node n1) {STALL}" in events[0][2]


@pytest.mark.parametrize("order", ["peer killed first", "frozen killed first"])
def test_of_two_ranks_killed_for_a_stall_the_one_that_stopped_first_is_named(order):
    """Rank 1 froze after step 4; rank 0 took step 5 and waited in the next collective. On a loaded
    node rank 0's agent may reach its timeout first: the cause is still rank 1, whose last step is
    older, whichever kill came first and whichever scrape saw it first."""
    frozen = failure(T0 + (1 if order == "peer killed first" else 0), step="4",
                     error="stalled: no progress for 60s in training after step 4 (hang timeout 60s)")
    peer = failure(T0 + (0 if order == "peer killed first" else 1), step="5",
                   error="stalled: no progress for 60s in training after step 5 (hang timeout 60s)")
    ranks = {0: Sample("j-0", "n0", worker_failures=[peer]), 1: Sample("j-1", "n1", worker_failures=[frozen])}
    st, _ = step(running_status(), ranks)
    (entry,) = st["restartHistory"]
    assert (entry["rank"], entry["reason"], entry["message"]) == (1, "Stalled", frozen["error"]), entry
    assert [a["rank"] for a in entry["alsoFailed"]] == [0] and entry["failedAt"] == T0
    assert st["inPlaceRestarts"] == 1
    # Seen one scrape apart (the peer's first): the same cause.
    first, _ = step(running_status(), {0: Sample("j-0", "n0", worker_failures=[peer]), 1: Sample("j-1", "n1")})
    st, _ = step(first, ranks)
    (entry,) = st["restartHistory"]
    assert (entry["rank"], st["inPlaceRestarts"]) == (1, 1), entry


def test_a_killed_worker_is_one_restart_attributed_to_its_rank_pod_and_node_then_its_recovery():
    ranks = {0: Sample("j-0", "n0"), 1: Sample("j-1", "n1", worker_failures=[failure(T0)])}
    st, events = step(running_status(), ranks)
    (entry,) = st["restartHistory"]
    assert {k: entry[k] for k in ("kind", "attempt", "restart", "rank", "pod", "node", "exitCode", "signal")} == {
        "kind": "InPlace", "attempt": 0, "restart": 0, "rank": 1, "pod": "j-1", "node": "n1", "exitCode": -9,
        "signal": "SIGKILL"}
    assert "message" not in entry  # the container's own words only with logTailInStatus
    assert st["inPlaceRestarts"] == 1 and st["phase"] == "Running"
    c = cond(st, "Restarting")
    assert (c["status"], c["reason"]) == ("True", "RestartingInPlace")
    assert "rank 1 (pod j-1 on node n1) failed with exit code -9 (SIGKILL)" in c["message"]
    assert "1/3 of failurePolicy.maxRestarts" in c["message"]
    assert [e[:2] for e in events] == [("Warning", "RestartingInPlace")]

    # The next scrape: rank 0 has stepped again, rank 1 not yet: still restarting, nothing new.
    ranks[0].first_step_timestamp, ranks[0].resumed_from_step = T0 + 3.0, 40
    st2, events2 = step(st, ranks)
    assert st2["inPlaceRestarts"] == 1 and cond(st2, "Restarting")["status"] == "True" and events2 == []
    # Every rank stepped: recovered at the later of their first steps.
    ranks[1].first_step_timestamp, ranks[1].resumed_from_step = T0 + 4.5, 40
    st3, events3 = step(st2, ranks)
    (entry,) = st3["restartHistory"]
    assert (entry["resumedFromStep"], entry["recoverySeconds"]) == (40, 4.5)
    c = cond(st3, "Restarting")
    assert (c["status"], c["reason"]) == ("False", "RestartedInPlace") and "from step 40 4.5s after" in c["message"]
    assert [e[:2] for e in events3] == [("Normal", "RestartedInPlace")]
    # The agent keeps exporting the failure: seen again, it is neither new nor counted twice.
    st4, events4 = step(st3, ranks)
    assert st4["restartHistory"] == st3["restartHistory"] and st4["inPlaceRestarts"] == 1 and events4 == []


def test_no_eta_while_a_worker_restarts_in_place_until_its_attempt_steps_again():
    job = make_job(nodes=2, failurePolicy={"maxRestarts": 3})
    pods = Group.of([make_pod(0), make_pod(1)])
    eta = {"step": 50, "totalSteps": 100, "eta": "25s", "etaSeconds": 25}
    ranks = {0: Sample("j-0", "n0"), 1: Sample("j-1", "n1", worker_failures=[failure(T0)])}
    # The survivors still report the old pace: its forecast is not shown while rank 1 restarts.
    st, _ = pass_status(job, pods, now=NOW, prev_status=running_status(progress=eta),
                        report=Report(ranks=ranks, progress=eta))
    assert cond(st, "Restarting")["status"] == "True" and "eta" not in st["progress"]
    for r in ranks.values():
        r.first_step_timestamp, r.resumed_from_step = T0 + 4.5, 40
    st, _ = pass_status(job, pods, now=NOW, prev_status=st, report=Report(ranks=ranks, progress={**eta, "step": 41}))
    assert cond(st, "Restarting")["status"] == "False" and st["progress"]["eta"] == "25s"


@pytest.mark.parametrize("first_seen", ["together", "casualty first"])
def test_peers_that_fail_with_it_are_one_restart_whose_cause_is_the_earliest(first_seen):
    cause = failure(T0, code=1, signal="", error="RuntimeError: boom")
    casualty = failure(T0 + 0.4, code=1, signal="", error="RuntimeError: Connection closed by peer")
    ranks = {0: Sample("j-0", worker_failures=[casualty]), 1: Sample("j-1", worker_failures=[cause])}
    prev = running_status()
    if first_seen == "casualty first":
        prev, _ = step(prev, {0: ranks[0]})
    st, _ = step(prev, ranks, job=make_job(nodes=2, failurePolicy={"maxRestarts": 3, "logTailInStatus": True}))
    (entry,) = st["restartHistory"]
    assert (entry["rank"], entry["message"]) == (1, "RuntimeError: boom")
    assert entry["alsoFailed"] == [{"rank": 0, "pod": "j-0", "restart": 0, "exitCode": 1, "attempt": 0}]
    assert st["inPlaceRestarts"] == 1


@pytest.mark.parametrize("first_seen", ["together", "casualty first"])
def test_a_killed_worker_is_the_cause_even_when_its_peers_exception_was_seen_first(first_seen):
    # Each time is when that pod's agent saw the failure: the peer's "connection closed" can be seen
    # before the SIGKILLed worker's death (seen on real pods). A collective never ends a worker by a
    # signal, so the killed one is the cause; the restart began at the first failure seen.
    killed = failure(T0 + 0.3)
    casualty = failure(T0, code=1, signal="", error="RuntimeError: Connection closed by peer")
    ranks = {0: Sample("j-0", "n0", worker_failures=[casualty]), 1: Sample("j-1", "n1", worker_failures=[killed])}
    prev = running_status()
    if first_seen == "casualty first":
        prev, _ = step(prev, {0: ranks[0]})
    st, _ = step(prev, ranks)
    (entry,) = st["restartHistory"]
    assert (entry["rank"], entry["pod"], entry["exitCode"], entry["signal"]) == (1, "j-1", -9, "SIGKILL")
    assert entry["failedAt"] == T0
    assert entry["alsoFailed"] == [{"rank": 0, "pod": "j-0", "restart": 0, "exitCode": 1, "attempt": 0}]
    assert st["inPlaceRestarts"] == 1


def test_a_failure_with_the_pods_budget_spent_is_no_restart_in_place():
    st, events = step(running_status(), {1: Sample("j-1", worker_failures=[failure(T0, restarted=False)])})
    assert "restartHistory" not in st and "inPlaceRestarts" not in st and events == []
    assert cond(st, "Restarting") is None


def test_a_second_failure_after_recovery_is_a_second_restart():
    done = {"kind": "InPlace", "attempt": 0, "restart": 0, "rank": 1, "pod": "j-1", "exitCode": -9, "failedAt": T0,
            "resumedFromStep": 40, "recoverySeconds": 4.0}
    ranks = {1: Sample("j-1", worker_failures=[failure(T0), failure(T0 + 60, restart=1)])}
    st, _ = step(running_status(restartHistory=[done], inPlaceRestarts=1), ranks)
    assert [e["restart"] for e in st["restartHistory"]] == [0, 1] and st["inPlaceRestarts"] == 2


def test_a_group_restart_ends_an_open_in_place_restart_and_is_recorded_as_group():
    open_entry = {"kind": "InPlace", "attempt": 0, "restart": 0, "rank": 1, "pod": "j-1", "exitCode": -9, "failedAt": T0}
    prev = running_status(restartHistory=[open_entry], inPlaceRestarts=1)
    pods = [make_pod(0), make_pod(1, phase="Failed", exit_code=1)]
    st, _ = pass_status(make_job(nodes=2, failurePolicy={"maxRestarts": 3}), Group.of(pods), now=NOW, prev_status=prev)
    assert st["phase"] == "Restarting" and st["attempt"] == 1
    first, group = st["restartHistory"]
    assert first["superseded"] is True and "recoverySeconds" not in first
    assert (group["kind"], group["attempt"], group["reason"]) == ("Group", 0, "PodFailed")
    assert cond(st, "Restarting")["reason"] == "PodFailed"
    assert "2/3 of the budget" in " ".join(e[2] for e in _ if e[1] == "Restarting")


@pytest.mark.parametrize("counted, in_place, max_restarts, phase", [
    (0, 2, 2, "Running"),  # two in place: the budget is used, not overdrawn
    (0, 3, 2, "Failed"),   # pods' agents together restarted more than the job's budget
    (2, 1, 2, "Failed"),
    (1, 0, 2, "Running"),
])
def test_in_place_restarts_share_the_budget_with_group_restarts(counted, in_place, max_restarts, phase):
    job = make_job(nodes=2, failurePolicy={"maxRestarts": max_restarts})
    prev = running_status(countedRestarts=counted, restarts=counted, inPlaceRestarts=in_place)
    d = decide(job, Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=prev)
    assert d.phase.value == phase
    if phase == "Failed":
        assert d.reason == "RestartLimitExceeded" and "maxRestarts" in d.message


def test_a_pod_failure_after_in_place_restarts_used_the_budget_fails_the_job():
    job = make_job(nodes=2, failurePolicy={"maxRestarts": 2})
    pods = [make_pod(0), make_pod(1, phase="Failed", exit_code=1)]
    d = decide(job, Group.of(pods), now=NOW, prev_status=running_status(inPlaceRestarts=2))
    assert (d.phase.value, d.reason) == ("Failed", "RestartLimitExceeded")
    assert "(2 of them in place)" in d.message


@pytest.mark.parametrize("failures, proven", [
    ({}, 0),
    ({1: [failure(T0)]}, 1),                                          # restarted after start 0: one round
    ({0: [failure(T0 + 1, restart=1)], 1: [failure(T0), failure(T0 + 60, restart=1)]}, 2),  # the newest round counts
    ({1: [failure(T0, restarted=False)]}, 0),                         # budget spent: the pod failed, no restart
    ({1: [{**failure(T0), "restart": "x"}]}, 0),                      # not a number
    ({1: [{**failure(T0), "restart": str(10**13)}]}, 0),              # beyond belief, as a step label
])
def test_the_agents_prove_the_rounds_they_restarted_in_place(failures, proven):
    ranks = {r: Sample(f"j-{r}", worker_failures=fs) for r, fs in failures.items()}
    assert inplace.proven(ranks) == proven


@pytest.mark.parametrize("edited, proven_rounds, phase", [
    (0, 2, "Running"),   # lowered from 2: still 2 of 2 used, the job runs on
    (0, 3, "Failed"),    # lowered from 3: the pods prove 3 > 2, the edit grants nothing
    (2, 3, "Failed"),
    (10**12, 0, "Failed"),  # raised: bounded (MAX_ATTEMPT), it only fails the editor's own job
    ("lots", 3, "Failed"),  # not a number: what the pods prove
])
def test_an_edit_lowering_in_place_restarts_grants_no_restart(edited, proven_rounds, phase):
    job = make_job(nodes=2, failurePolicy={"maxRestarts": 2})
    fails = [failure(T0 + 60 * r, restart=r) for r in range(proven_rounds)]
    ranks = {0: Sample("j-0"), 1: Sample("j-1", worker_failures=fails)}
    d = decide(job, Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=running_status(inPlaceRestarts=edited),
               ranks=ranks)
    assert d.phase.value == phase
    if phase == "Failed":
        assert d.reason == "RestartLimitExceeded" and "maxRestarts" in d.message
        assert str(min(max(proven_rounds, edited if isinstance(edited, int) else 0), MAX_ATTEMPT)) in d.message


def test_a_pod_failure_after_an_edit_lowered_in_place_restarts_fails_the_job():
    job = make_job(nodes=2, failurePolicy={"maxRestarts": 2})
    pods = [make_pod(0), make_pod(1, phase="Failed", exit_code=1)]
    ranks = {1: Sample("j-1", worker_failures=[failure(T0), failure(T0 + 60, restart=1)])}
    d = decide(job, Group.of(pods), now=NOW, prev_status=running_status(inPlaceRestarts=0), ranks=ranks)
    assert (d.phase.value, d.reason) == ("Failed", "RestartLimitExceeded")  # not a group restart granted
    assert "(2 of them in place)" in d.message


@pytest.mark.parametrize("prev_count, history, written", [
    (1, True, 1),    # as the operator wrote it: counted once, not again for the agents' proof
    (0, True, 1),    # edited down, the entry kept (so not counted afresh): the agents' proof stands
    (0, False, 1),   # edited down and the history dropped: the failure counts once, fresh
    (None, False, 1),
])
def test_the_written_count_is_not_below_the_agents_proof_and_counts_once(prev_count, history, written):
    done = {"kind": "InPlace", "attempt": 0, "restart": 0, "rank": 1, "pod": "j-1", "exitCode": -9, "failedAt": T0,
            "resumedFromStep": 40, "recoverySeconds": 4.0}
    ranks = {0: Sample("j-0"), 1: Sample("j-1", worker_failures=[failure(T0)])}
    prev = running_status(**({"restartHistory": [done]} if history else {}),
                          **({"inPlaceRestarts": prev_count} if prev_count is not None else {}))
    st, _ = step(prev, ranks)
    assert st["inPlaceRestarts"] == written


def test_history_keeps_the_newest_entries():
    old = [{"kind": "Group", "attempt": i, "reason": "PodFailed", "message": "", "time": "t"}
           for i in range(inplace.HISTORY_LIMIT)]
    up = inplace.update({"restartHistory": old}, attempt=20, ranks={1: Sample("j-1", worker_failures=[failure(T0)])},
                        with_log=False, group=None, now=NOW)
    assert len(up.history) == inplace.HISTORY_LIMIT and up.history[-1]["kind"] == "InPlace"
    assert up.history[0]["attempt"] == 1


@pytest.mark.parametrize("label, kept", [("SIGKILL", "SIGKILL"), ("SIGSEGV", "SIGSEGV"), ("<script>", None), ("", None)])
def test_only_signal_names_reach_the_status(label, kept):
    (entry,) = inplace.observed({1: Sample("j-1", worker_failures=[failure(T0, signal=label)])}, attempt=0,
                                with_log=False)
    assert entry.get("signal") == kept


@pytest.mark.parametrize("cause_step, casualty_step, resumed, lost", [
    ("47", "48", 40, 8),   # the newest step any failed rank had finished
    ("47", "", 40, 7),
    ("", "", 40, None),    # an agent that could not read the step: no stepsLost, never a guess
    ("40", "", 40, 0),
    ("1e99", "", 40, None),  # not a step count
])
def test_steps_lost_are_the_step_at_failure_less_the_step_resumed_from(cause_step, casualty_step, resumed, lost):
    ranks = {0: Sample("j-0", worker_failures=[failure(T0 + 0.4, code=1, step=casualty_step)]),
             1: Sample("j-1", worker_failures=[failure(T0, step=cause_step)])}
    st, _ = step(running_status(), ranks)
    for r in ranks.values():
        r.first_step_timestamp, r.resumed_from_step = T0 + 5, resumed
    st, _ = step(st, ranks)
    (entry,) = st["restartHistory"]
    assert entry.get("stepsLost") == lost and entry["resumedFromStep"] == resumed


def test_a_group_restart_recovers_when_the_next_attempts_ranks_step():
    """failedAt: the earliest failure an agent reported with its budget spent (else the pass's
    time); stepAtFailure: the newest step scraped; recovered when attempt 1's ranks all stepped."""
    job = make_job(nodes=2, failurePolicy={"maxRestarts": 3})
    t0 = NOW.timestamp() - 20  # the agent's report, before the pass that saw the pod fail
    ranks = {0: Sample("j-0", step=57), 1: Sample("j-1", step=58, worker_failures=[failure(t0, restarted=False)])}
    failed = Group.of([make_pod(0), make_pod(1, phase="Failed", exit_code=1)])
    st, _ = pass_status(job, failed, now=NOW, prev_status=running_status(), report=Report(ranks=ranks))
    (group,) = st["restartHistory"]
    assert (group["kind"], group["attempt"], group["failedAt"], group["stepAtFailure"]) == ("Group", 0, t0, 58)
    new = Group.of([make_pod(0, attempt=1), make_pod(1, attempt=1)])
    waiting = {0: Sample("j-0", first_step_timestamp=t0 + 30, resumed_from_step=50), 1: Sample("j-1")}
    st, _ = pass_status(job, new, now=NOW, prev_status={**st, "phase": "Running"}, report=Report(ranks=waiting))
    assert "recoverySeconds" not in st["restartHistory"][0]  # rank 1 has not stepped yet
    waiting[1].first_step_timestamp, waiting[1].resumed_from_step = t0 + 31.5, 50
    st2, events = pass_status(job, new, now=NOW, prev_status=st, report=Report(ranks=waiting))
    (group,) = st2["restartHistory"]
    assert (group["recoverySeconds"], group["resumedFromStep"], group["stepsLost"]) == (31.5, 50, 8)
    assert not [e for e in events if e[1] == "RestartedInPlace"] and cond(st2, "Restarting")["status"] != "True"
    assert inplace.recoveries(st, st2) == [("Group", 31.5, 8)]


def test_a_group_restart_without_a_scrape_fails_now_at_the_last_progress():
    up = inplace.update({"progress": {"step": 12}}, attempt=0, ranks=None, with_log=False,
                        group=(0, "PodDeleted", "deleted"), now=NOW)
    assert (up.history[-1]["failedAt"], up.history[-1]["stepAtFailure"]) == (NOW.timestamp(), 12)


def test_a_group_restarts_step_at_failure_comes_from_the_failed_pods_termination_message():
    """The failed pod is no longer scraped and the status' progress is older than its failure:
    the step its launcher wrote on the termination message's first line is the newest known."""
    job = make_job(nodes=2, failurePolicy={"maxRestarts": 3})
    failed = Group.of([make_pod(0, phase="Failed", exit_code=1,
                                message="training exited with code 1 at step 43\nrank 0 failed:\nRuntimeError: peer"),
                       make_pod(1, phase="Failed", exit_code=137, message="")])
    prev = {**running_status(), "progress": {"step": 1}}
    st, _ = pass_status(job, failed, now=NOW, prev_status=prev, report=Report(ranks={}))
    (group,) = st["restartHistory"]
    assert (group["kind"], group["stepAtFailure"]) == ("Group", 43), group
    # Without the step on the message: the last progress, as before.
    failed = Group.of([make_pod(0, phase="Failed", exit_code=1, message="training exited with code 1\nboom"),
                       make_pod(1, phase="Failed", exit_code=137)])
    st, _ = pass_status(job, failed, now=NOW, prev_status=prev, report=Report(ranks={}))
    assert st["restartHistory"][0]["stepAtFailure"] == 1


def test_an_attempt_that_ends_before_stepping_supersedes_the_group_restart_before_it():
    prev = {"restartHistory": [{"kind": "Group", "attempt": 0, "reason": "PodFailed", "failedAt": T0}]}
    up = inplace.update(prev, attempt=1, ranks=None, with_log=False, group=(1, "PodFailed", "again"), now=NOW)
    assert up.history[0]["superseded"] is True and "failedAt" in up.history[1]
    # One whose last scrape shows it stepped (no pass came between) recovered before it ended.
    stepped = {0: Sample("j-0", first_step_timestamp=T0 + 9, resumed_from_step=3)}
    up = inplace.update(prev, attempt=1, ranks=stepped, with_log=False, group=(1, "PodFailed", "again"), now=NOW)
    assert "superseded" not in up.history[0] and up.history[0]["recoverySeconds"] == 9
    # A Group entry from before recoveries were measured (no failedAt) is never measured.
    old = inplace.update({"restartHistory": [{"kind": "Group", "attempt": 0}]}, attempt=1,
                         ranks={0: Sample("j-0", first_step_timestamp=T0, resumed_from_step=0)},
                         with_log=False, group=None, now=NOW)
    assert old.history == [{"kind": "Group", "attempt": 0}]


IN_PLACE = {"kind": "InPlace", "attempt": 0, "restart": 0, "rank": 1, "pod": "j-1", "failedAt": T0}
RECOVERED = {**IN_PLACE, "resumedFromStep": 40, "recoverySeconds": 4.5, "stepsLost": 7}


@pytest.mark.parametrize("prev, new, observed", [
    ([IN_PLACE], [RECOVERED], [("InPlace", 4.5, 7)]),               # the pass that saw it step again
    ([RECOVERED], [RECOVERED], []),                                  # a rescrape, a repeated pass
    ([], [RECOVERED], [("InPlace", 4.5, 7)]),                        # failed and recovered between passes
    ([RECOVERED], [RECOVERED, {**RECOVERED, "restart": 1, "stepsLost": 0}], [("InPlace", 4.5, 0)]),
    ([IN_PLACE], [{**IN_PLACE, "superseded": True}], []),            # never stepped again
    ([], [{**RECOVERED, "stepsLost": None} | {"kind": "Group", "attempt": 3}], [("Group", 4.5, None)]),
])
def test_each_recovery_is_observed_once(prev, new, observed):
    """The operator metrics' observations: a status diff, so an operator restarted with the
    recovery already in its status (prev) observes nothing again."""
    assert inplace.recoveries({"restartHistory": prev}, {"restartHistory": new}) == observed
