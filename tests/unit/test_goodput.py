"""The goodput ledger's pure accounting (decisions/goodput.py): every second from a job's creation to
its end in exactly one category, whatever passes happened to run, with injected clocks and events
(no sleeps): the categories sum to the wall time, recovering is the restarts' recoverySeconds,
recomputing their stepsLost x the step time, an undisturbed job has neither, a suspension is its
own seconds. Then through job_status: the ledger in the status, and never a write of its own."""
from __future__ import annotations

import datetime as dt
import statistics
from dataclasses import dataclass, field

import pytest

from ddpjob_api.contract import GOODPUT_CATEGORIES
from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions import goodput, inplace
from ddpjob_operator.decisions.goodput import Observed, advance
from ddpjob_operator.decisions.writes import settled
from tests.support.builders import NOW, make_job, make_pod, running_status
from tests.support.passes import pass_status
from tests.unit.test_status import Report

CREATED = 1_800_000_000.0


def replay(passes: list[dict], prev: dict | None = None) -> dict:
    """The ledger after these passes (each: Observed's fields, `now` relative to CREATED)."""
    for p in passes:
        fields = {k: (CREATED + v if k in ("now", "ended", "scheduled_at", "stepped_at", "stall_since")
                      and v is not None else v) for k, v in p.items()}
        prev = advance(prev, Observed(created=CREATED, **fields))
    assert prev is not None
    return prev


def sums_to_wall(ledger: dict) -> None:
    assert set(ledger["seconds"]) == set(GOODPUT_CATEGORIES)
    assert all(v >= 0 for v in ledger["seconds"].values()), ledger["seconds"]
    assert sum(ledger["seconds"].values()) == pytest.approx(ledger["wallSeconds"], abs=0.01)


# An undisturbed job: created at 0, its pods scheduled at 12, first step at 30, done at 200; rank 0
# counted 5 s of checkpoints and 3 s of evaluation.
UNDISTURBED = [
    dict(now=10),
    dict(now=20, scheduled_at=12),
    dict(now=100, scheduled_at=12, stepped_at=30, ranks={"checkpointing": 2.0, "evaluating": 1.0}),
    dict(now=150, scheduled_at=12, stepped_at=30, ranks={"checkpointing": 5.0, "evaluating": 3.0}),
    dict(now=220, ended=200, scheduled_at=12, stepped_at=30),
]


@pytest.mark.parametrize("kept", [
    [0, 1, 2, 3, 4],       # every pass written
    [2, 4],                # the scheduling and first step learned late, from their timestamps
    [4],                   # one pass: what a pass never written leaves to the next one
    [0, 3, 4],
], ids=["every", "late", "one", "some"])
def test_an_undisturbed_job_accounts_the_same_seconds_whichever_passes_were_written(kept):
    ledger = replay([UNDISTURBED[i] for i in kept])
    sums_to_wall(ledger)
    s = ledger["seconds"]
    assert ledger["wallSeconds"] == 200
    assert (s["queued"], s["starting"]) == (12, 18)
    assert s["recovering"] == s["recomputing"] == s["stalled"] == s["suspended"] == 0
    if 3 in kept:  # the rank counters are whatever a scrape read
        assert (s["checkpointing"], s["evaluating"]) == (5, 3)
    assert s["training"] == 200 - 30 - s["checkpointing"] - s["evaluating"]
    assert ledger["ratio"] == round(s["training"] / 200, 4) and ledger["display"] == f"{100 * ledger['ratio']:.0f}%"


def test_a_finished_job_accounts_nothing_more():
    done = replay(UNDISTURBED)
    assert replay([dict(now=5000, ended=200, scheduled_at=12, stepped_at=30)], prev=done) == done


def inplace_entry(failed: float, *, recovery: float | None = None, lost: int | None = None, **more) -> dict:
    e = {"kind": "InPlace", "attempt": 0, "restart": 0, "rank": 1, "pod": "j-1", "failedAt": CREATED + failed, **more}
    if recovery is not None:
        e.update(recoverySeconds=recovery, resumedFromStep=40, stepsLost=lost)
    return e


@pytest.mark.parametrize("seen_open", [True, False], ids=["seen-open", "seen-recovered"])
def test_an_in_place_restart_is_recovering_then_its_lost_steps_recomputing(seen_open):
    """A worker dies at 100, every rank steps again 7.25 s later, 12 steps lost at 0.5 s a step
    (the median of the ranks' mean step times)."""
    step_times = [0.48, 0.5, 0.55]
    base = dict(scheduled_at=5, stepped_at=10, step_seconds=statistics.median(step_times))
    passes = [dict(now=90, **base)]
    if seen_open:
        passes.append(dict(now=103, history=[inplace_entry(100)], **base))
        during = replay(passes)
        sums_to_wall(during)
        assert during["seconds"]["recovering"] == pytest.approx(3.0)  # from the failure to now
    done = inplace_entry(100, recovery=7.25, lost=12)
    passes.append(dict(now=120, history=[done], recovered=[("InPlace", 7.25, 12)], **base))
    passes.append(dict(now=300, ended=300, history=[done], **base))
    ledger = replay(passes)
    sums_to_wall(ledger)
    s = ledger["seconds"]
    assert s["recovering"] == pytest.approx(done["recoverySeconds"], abs=1.0)
    assert s["recomputing"] == pytest.approx(12 * statistics.median(step_times), rel=0.1)
    assert s["training"] == pytest.approx(300 - 10 - 7.25 - 6.0)


def test_a_group_restart_is_recovering_from_the_failure_to_the_new_attempts_first_step():
    """Attempt 0 steps from 10; a pod fails at 95 (stepAtFailure 80, the checkpoint at 60); the pass
    at 100 restarts the group; attempt 1's pods are scheduled at 110 and step at 130."""
    group = {"kind": "Group", "attempt": 0, "failedAt": CREATED + 95, "stepAtFailure": 80}
    recovered = {**group, "resumedFromStep": 60, "stepsLost": 20, "recoverySeconds": 35.0}
    ledger = replay([
        dict(now=50, scheduled_at=5, stepped_at=10, step_seconds=1.0, ranks={"checkpointing": 4.0}),
        dict(now=100, attempt=1, restarted=True, history=[group], ranks={"checkpointing": 6.0}),
        dict(now=115, attempt=1, scheduled_at=110, history=[group]),
        dict(now=140, attempt=1, scheduled_at=110, stepped_at=130, history=[recovered],
             recovered=[("Group", 35.0, 20)], ranks={"checkpointing": 1.0}),
        dict(now=400, ended=400, attempt=1, scheduled_at=110, stepped_at=130, history=[recovered]),
    ])
    sums_to_wall(ledger)
    s = ledger["seconds"]
    assert (s["queued"], s["starting"]) == (5, 5)  # the first attempt's only: attempt 1's start is recovering
    assert s["recovering"] == pytest.approx(35.0, abs=1.0)
    assert s["recomputing"] == pytest.approx(20.0)
    assert s["checkpointing"] == 7.0  # both attempts' counters: each restarts at 0 with its pods
    assert s["training"] == pytest.approx(400 - 10 - 35 - 20 - 7)


def test_a_suspension_is_its_own_seconds_and_the_resumed_job_queues_and_starts_again():
    ledger = replay([
        dict(now=50, scheduled_at=5, stepped_at=10),
        dict(now=60, scheduled_at=5, stepped_at=10),                   # the pass that suspends (phase Running before)
        dict(now=75, suspended=True),                                  # a pass while suspended (not written: same)
        dict(now=90, suspended=True, attempt=1),                       # the pass that resumes
        dict(now=130, attempt=1, scheduled_at=95, stepped_at=110),
    ])
    sums_to_wall(ledger)
    s = ledger["seconds"]
    assert s["suspended"] == pytest.approx(30.0)
    assert (s["queued"], s["starting"], s["recovering"]) == (5 + 5, 5 + 15, 0)
    assert s["training"] == 50 + 20


def test_a_stall_restarted_in_place_is_stalled_until_the_kill_then_recovering():
    stall = inplace_entry(200, recovery=6.0, lost=1, reason="Stalled",
                          message="stalled: no progress for 31s in training after step 6 (hang timeout 30s)")
    base = dict(scheduled_at=0, stepped_at=0, step_seconds=0.5)
    ledger = replay([
        dict(now=180, **base),
        dict(now=195, stall_since=169, **base),                             # the Stalled condition holds
        dict(now=210, stall_since=169, history=[stall], recovered=[("InPlace", 6.0, 1)], stalls=[31.0], **base),
        dict(now=260, ended=260, history=[stall], **base),
    ])
    sums_to_wall(ledger)
    s = ledger["seconds"]
    assert s["stalled"] == 31.0 and s["recovering"] == 6.0 and s["recomputing"] == 0.5


def test_a_stall_that_clears_by_itself_counts_until_it_stepped_again():
    base = dict(scheduled_at=0, stepped_at=0)
    ledger = replay([dict(now=100, **base), dict(now=130, stall_since=90, **base), dict(now=150, **base)])
    sums_to_wall(ledger)
    assert ledger["seconds"]["stalled"] == 60.0


def test_an_edited_ledger_cannot_break_the_sums():
    good = replay(UNDISTURBED[:3])
    bad = {**good, "accounting": {**good["accounting"], "running": float("nan"), "queued": -50, "asOf": "x",
                                  "checkpointing": 1e9, "mode": "flying"}}
    ledger = advance(bad, Observed(now=CREATED + 150, created=CREATED, scheduled_at=CREATED + 12,
                                   stepped_at=CREATED + 30))
    sums_to_wall(ledger)


def test_summary_names_the_categories_that_hold_time():
    text = goodput.summary(replay(UNDISTURBED))
    assert text.startswith(f"{replay(UNDISTURBED)['display']} training of 3m20s: queued 12s, starting 18s, training ")
    assert "recovering" not in text and goodput.summary(None) == ""


# --- through job_status ------------------------------------------------------------------------------

@dataclass
class Sample:
    """What samples.RankSample carries for the ledger."""

    pod: str
    first_step_timestamp: float | None = None
    step_seconds_sum: float = 0.0
    step_seconds_count: float = 0.0
    goodput: dict = field(default_factory=dict)
    worker_failures: list = field(default_factory=list)
    resumed_from_step: int | None = None
    step: int | None = None
    node: str | None = None


def test_job_status_keeps_the_ledger_and_it_never_asks_for_a_write_of_its_own():
    job = make_job(nodes=2)
    pods = Group.of([make_pod(0), make_pod(1)])
    started = NOW.timestamp() - 80
    ranks = {r: Sample(f"j-{r}", first_step_timestamp=started, step_seconds_sum=20.0, step_seconds_count=40,
                       goodput={"checkpointing": 2.0, "evaluating": 1.0}) for r in (0, 1)}
    first, _ = pass_status(job, pods, now=NOW, prev_status=running_status(), report=Report(ranks=ranks))
    sums_to_wall(first["goodput"])
    later, events = pass_status(job, pods, now=NOW + dt.timedelta(seconds=30), prev_status=first,
                                report=Report(ranks=ranks))
    assert not events and later["goodput"] != first["goodput"]
    assert later["goodput"]["wallSeconds"] == first["goodput"]["wallSeconds"] + 30
    assert later["goodput"]["seconds"]["checkpointing"] == 2.0
    assert settled(first, later)  # only the ledger changed: nothing is written for it
    assert not settled(first, {**later, "phase": "Failed"})


@pytest.mark.parametrize("seen_open", [True, False], ids=["seen-open", "seen-recovered"])
def test_a_per_step_jobs_replaced_pod_is_no_recovering_for_the_groups_that_trained_through_it(seen_open):
    """Pod 1 of a per-step job (spec.faultTolerance) is lost at 100 and its replacement steps 9 s
    later: the other group never stopped, so that time is training, not recovering; the same entry
    without the perStep mark (every rank waited for the replacement) is recovering."""
    base = dict(scheduled_at=5, stepped_at=10, step_seconds=0.5)

    def ledger(mode: str | None) -> dict:
        mark = {"mode": mode} if mode else {}
        entry = {"kind": "Replace", "attempt": 0, "rank": 1, "pod": "j-1", "newPod": "j-1-r1",
                 "failedAt": CREATED + 100, **mark}
        passes = [dict(now=90, **base)]
        if seen_open:
            passes.append(dict(now=105, history=[entry], **base))
        done = {**entry, "recoverySeconds": 9.0, "resumedFromStep": 0, "stepsLost": 0}
        passes.append(dict(now=120, history=[done], recovered=inplace.recoveries(
            {"restartHistory": [entry]}, {"restartHistory": [done]}, training_stopped=True), **base))
        passes.append(dict(now=300, ended=300, history=[done], **base))
        out = replay(passes)
        sums_to_wall(out)
        return out["seconds"]

    per_step, replaced = ledger("perStep"), ledger(None)
    assert per_step["recovering"] == per_step["recomputing"] == 0
    assert per_step["training"] == pytest.approx(300 - 10)
    assert replaced["recovering"] == pytest.approx(9.0)
    assert replaced["training"] == pytest.approx(300 - 10 - 9.0)
