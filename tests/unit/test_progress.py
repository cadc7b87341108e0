"""compute_progress: status.progress from per-rank samples."""
from __future__ import annotations

import pytest

from ddpjob_operator.api.objmeta import format_time as rfc3339
from ddpjob_operator.decisions.progress import PROGRESS_FIELDS, compute_progress, human_duration
from ddpjob_operator.decisions.samples import RankSample


def rs(rank, step, *, total=100, loss=1.0, samples=0.0, ssum=0.0, scount=0.0, wait=0.0, ts=None,
       epoch=0, acc=None):
    return RankSample(rank=rank, step=step, total_steps=total, loss=loss, samples_total=samples,
                      step_seconds_sum=ssum, step_seconds_count=scount, data_wait_seconds_total=wait,
                      last_step_timestamp=ts, epoch=epoch, eval_accuracy=acc)


def test_empty_when_nothing_reported():
    assert compute_progress({}, now=0) == {}
    assert compute_progress({0: RankSample(rank=0)}, now=0) == {}


def test_step_is_min_loss_is_mean_percent_and_time():
    samples = {0: rs(0, 50, loss=1.0, ts=1_800_000_000.0, epoch=2, acc=0.8),
               1: rs(1, 48, loss=3.0, ts=1_800_000_005.0, epoch=1, acc=0.9)}
    p = compute_progress(samples, now=1_800_000_010.0)
    assert p["step"] == 48 and p["totalSteps"] == 100 and p["percent"] == 48.0
    assert p["epoch"] == 1
    assert p["loss"] == pytest.approx(2.0)
    assert p["evalAccuracy"] == pytest.approx(0.85)
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
