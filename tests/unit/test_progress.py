"""compute_progress: status.progress from per-rank samples; and how it settles: merged per scrape,
at the end of a job that succeeded or failed."""
from __future__ import annotations

import pytest

from ddpjob_operator.base.objmeta import format_time as rfc3339
from ddpjob_operator.decisions.progress import (PROGRESS_FIELDS, UNAVAILABLE, compute_progress, human_duration,
                                                merge_scrape, stopped, succeeded, without_eta)
from ddpjob_operator.decisions.samples import RankSample


def rs(rank, step, *, total=100, loss=1.0, samples=0.0, ssum=0.0, scount=0.0, wait=0.0, ts=None,
       epoch=0, acc=None, eval_loss=None):
    return RankSample(rank=rank, step=step, total_steps=total, loss=loss, samples_total=samples,
                      step_seconds_sum=ssum, step_seconds_count=scount, data_wait_seconds_total=wait,
                      last_step_timestamp=ts, epoch=epoch, eval_accuracy=acc, eval_loss=eval_loss)


def test_empty_when_nothing_reported():
    assert compute_progress({}, now=0) == {}
    assert compute_progress({0: RankSample(rank=0)}, now=0) == {}


def test_step_is_min_loss_is_mean_percent_and_time():
    samples = {0: rs(0, 50, loss=1.0, ts=1_800_000_000.0, epoch=2, acc=0.8, eval_loss=0.5),
               1: rs(1, 48, loss=3.0, ts=1_800_000_005.0, epoch=1, acc=0.9, eval_loss=0.3)}
    p = compute_progress(samples, now=1_800_000_010.0)
    assert p["step"] == 48 and p["totalSteps"] == 100 and p["percent"] == 48.0
    assert p["epoch"] == 1
    assert p["loss"] == pytest.approx(2.0)
    assert p["evalAccuracy"] == pytest.approx(0.85) and p["evalLoss"] == pytest.approx(0.4)
    assert p["lastStepTime"] == rfc3339(1_800_000_005.0) == "2027-01-15T08:00:05Z"
    assert p["ranksReporting"] == 2
    assert p["slowestRank"] == 1
    assert set(p) <= set(PROGRESS_FIELDS)


def test_slowest_rank_is_named_only_when_a_rank_is_behind():
    level = {r: rs(r, 40) for r in range(3)}
    assert "slowestRank" not in compute_progress(level, now=0)
    behind = {**level, 2: rs(2, 37), 1: rs(1, 37)}
    assert compute_progress(behind, now=0)["slowestRank"] == 1  # the lowest of the ranks tied behind


def test_rate_and_eta_from_step_time_without_prev():
    # each rank: 40 samples in 2 s of stepping -> 20/s, x2 ranks = 40/s; 0.5 s/iteration (0.4 + 0.1 wait)
    samples = {r: rs(r, 5, samples=40, ssum=2.0, scount=5, wait=0.5) for r in (0, 1)}
    p = compute_progress(samples, now=0)
    assert p["samplesPerSecond"] == pytest.approx(40.0)
    assert p["etaSeconds"] == round(95 * 0.5) and p["eta"] == "48s"


def test_rate_and_eta_from_prev_scrape():
    prev = {r: rs(r, 10, samples=100) for r in (0, 1)}
    now = {r: rs(r, 30, samples=300, ssum=1.0, scount=30) for r in (0, 1)}
    p = compute_progress(now, now=110.0, prev=(100.0, prev))
    assert p["samplesPerSecond"] == pytest.approx(40.0)          # 400 samples / 10 s
    assert p["etaSeconds"] == 35                                  # 70 steps at 0.5 s/step


def test_counter_reset_falls_back_to_step_time():
    prev = {0: rs(0, 90, samples=9000)}
    now = {0: rs(0, 3, samples=30, ssum=1.0, scount=3)}
    p = compute_progress(now, now=10.0, prev=(5.0, prev))
    assert p["samplesPerSecond"] == pytest.approx(30.0)


def test_nan_loss_is_left_out():
    p = compute_progress({0: rs(0, 1, loss=float("nan"))}, now=0)
    assert "loss" not in p


@pytest.mark.parametrize("secs,text", [(0, "0s"), (35.4, "35s"), (250, "4m10s"), (3720, "1h02m"), (-5, "0s")])
def test_human_duration(secs, text):
    assert human_duration(secs) == text


@pytest.mark.parametrize("total, ssum, shown", [
    (10**12, 10**12, False),        # each value within the scraper's bounds; their product is ~1e24 s
    (10**9, 10**9, False),          # ~1e9 s: past ten years
    (1000, 10.0, True),             # an ordinary ETA is still shown
])
def test_eta_past_any_meaning_is_left_out_rather_than_overflowing(total, ssum, shown):
    p = compute_progress({0: rs(0, 0, total=total, ssum=ssum, scount=1)}, now=0)
    assert ("etaSeconds" in p) is shown and ("eta" in p) is shown
    if shown:
        assert 0 < p["etaSeconds"] < 2**63


# The last periodic write of a run that then finished (issue 51's digits job, as it was left).
RUNNING = {"step": 183, "totalSteps": 276, "percent": 66.3, "epoch": 7, "loss": 0.21, "samplesPerSecond": 812.0,
           "eta": "3s", "etaSeconds": 3, "evalAccuracy": 0.935933, "slowestRank": 1, "ranksReporting": 2,
           "display": "66% (183/276)"}
RESULT = {"steps": 276, "totalSteps": 276, "epochsCompleted": 12, "worldSize": 2, "resumedFromStep": 0,
          "trainSamplesPerSecond": 790.5, "evalAccuracy": 0.969359, "evalLoss": 0.11, "evalSamples": 359}
SETTLED = {k: v for k, v in RUNNING.items() if k not in ("eta", "etaSeconds", "slowestRank")}


@pytest.mark.parametrize("kept, scraped, want", [
    # The scrape's fields win; what it lacks (a restarted rank's loss, its last evaluation) stays.
    ({"step": 5, "loss": 2.0, "evalAccuracy": 0.5}, {"step": 9}, {"step": 9, "loss": 2.0, "evalAccuracy": 0.5}),
    # A new attempt's first scrape, before it has a rate: the old attempt's ETA does not stay.
    (RUNNING, {"step": 40, "totalSteps": 276, "percent": 14.5},
     {**SETTLED, "step": 40, "percent": 14.5}),
    ({"step": 5, "eta": "9s", "etaSeconds": 9}, {"step": 6, "eta": "7s", "etaSeconds": 7},
     {"step": 6, "eta": "7s", "etaSeconds": 7}),
    # Every rank at the same step again: no rank is named behind.
    ({"step": 5, "slowestRank": 3}, {"step": 6}, {"step": 6}),
])
def test_a_scrape_merges_over_the_kept_progress_but_its_eta_and_laggard_are_its_own(kept, scraped, want):
    assert merge_scrape(kept, scraped) == want


@pytest.mark.parametrize("progress, result, want", [
    # The result's numbers: the last step, 100 %, the final evaluation and throughput; no ETA, no laggard.
    (RUNNING, RESULT, {**SETTLED, "step": 276, "percent": 100.0, "evalAccuracy": 0.969359, "evalLoss": 0.11,
                       "samplesPerSecond": 790.5}),
    # Without a result (a command that writes none): where the last scrape saw it, without an ETA.
    (RUNNING, {}, SETTLED),
    # Its totalSteps is the trainer's own; progress without one gets it.
    ({"step": 10}, {"steps": 20, "totalSteps": 20}, {"step": 20, "totalSteps": 20, "percent": 100.0}),
    # Never scraped (every pod on a simulated node): the result tells the end, the note goes.
    ({UNAVAILABLE: "on kwok"}, {"steps": 20, "totalSteps": 20},
     {"step": 20, "totalSteps": 20, "percent": 100.0}),
    ({}, {}, {}),
])
def test_a_succeeded_jobs_progress_is_its_results_end(progress, result, want):
    got = succeeded(progress, result)
    assert got == want
    assert succeeded(got, result) == got  # every later pass writes nothing


@pytest.mark.parametrize("progress, steps, want", [
    # Its failed pods wrote a newer step than the last scrape saw: there it stopped.
    (RUNNING, [190, 191], {**without_eta(RUNNING), "step": 191, "percent": 69.2}),
    # The scrape saw further than any message says (a message without a step, or an older one).
    (RUNNING, [180], without_eta(RUNNING)),
    (RUNNING, [], without_eta(RUNNING)),
    ({}, [7], {"step": 7}),
    ({"step": 3, "totalSteps": 10}, [-1, 10**13], {"step": 3, "totalSteps": 10}),  # out of bounds: not believed
    ({}, [], {}),
])
def test_a_failed_jobs_progress_is_where_it_stopped_without_an_eta(progress, steps, want):
    got = stopped(progress, steps)
    assert got == want
    assert stopped(got, steps) == got
