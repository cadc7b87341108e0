"""HealthTracker: straggler (the rank its peers wait for) and stall detection."""
from __future__ import annotations

import pytest

from ddpjob_operator.health import STALLED, STRAGGLER, HealthTracker
from ddpjob_operator.scrape import RankSample


class Job:
    """Synthesises what synchronous DDP ranks report: equal iterations, fast ranks wait in all-reduce."""

    def __init__(self, world=4, compute=0.1, slow=None, extra=0.0, where="outside"):
        self.world, self.compute, self.slow, self.extra, self.where = world, compute, slow, extra, where
        self.step, self.t = 0, 1000.0
        self.sums = [0.0] * world
        self.waits = [0.0] * world

    def advance(self, n=10, frozen=None):
        iteration = self.compute + (self.extra if self.slow is not None else 0.0)
        for _ in range(n):
            self.t += iteration
            self.step += 1
            for r in range(self.world):
                # everyone else waits for the slow rank inside all-reduce, i.e. inside their step
                wait = self.extra if (self.slow is not None and r != self.slow) else 0.0
                self.sums[r] += self.compute + wait
                if r == self.slow and self.where == "data":
                    # the slow rank's own extra time is waiting for its input, counted in its step
                    self.sums[r] += self.extra
                    self.waits[r] += self.extra
        return self.samples(frozen)

    def samples(self, frozen=None):
        out = {}
        for r in range(self.world):
            step = self.step - 1 if r == frozen else self.step
            out[r] = RankSample(rank=r, step=step, step_started=step + 1, last_step_timestamp=self.t,
                                step_seconds_sum=self.sums[r], step_seconds_count=self.step,
                                data_wait_seconds_total=self.waits[r],
                                pod=f"j-{r // 2}", node=f"n{r // 2}")
        return out


def test_healthy_job_has_no_findings():
    job, h = Job(), HealthTracker(hang_timeout=60)
    for i in range(10):
        assert h.update(job.advance(), now=1000 + 10 * i) == []
    assert h.active == {}


def test_straggler_is_the_rank_the_others_wait_for_after_n_windows():
    job, h = Job(world=4, compute=0.1, slow=2, extra=0.2), HealthTracker(hang_timeout=600, straggler_windows=3)
    assert h.update(job.advance(), now=0) == []          # first scrape: no deltas yet
    assert h.update(job.advance(), now=10) == []
    assert h.update(job.advance(), now=20) == []
    found = h.update(job.advance(), now=30)
    assert [(f.kind, f.active, f.ranks) for f in found] == [(STRAGGLER, True, (2,))]
    assert "rank 2 (pod j-1 on node n1)" in found[0].message
    assert h.update(job.advance(), now=40) == []          # no repeated event while it lasts
    job.slow, job.extra = None, 0.0                       # it recovers
    changes = [f for i in range(5) for f in h.update(job.advance(), now=50 + 10 * i)]
    assert [(f.kind, f.active) for f in changes] == [(STRAGGLER, False)]


def test_two_ranks_straggler():
    job, h = Job(world=2, compute=0.05, slow=1, extra=0.5), HealthTracker(hang_timeout=600)
    found = [f for i in range(5) for f in h.update(job.advance(), now=10 * i)]
    assert [(f.kind, f.ranks) for f in found] == [(STRAGGLER, (1,))]


def test_straggler_with_a_slow_data_loader_counted_inside_its_step():
    # every rank's step time is equal here; only the data wait tells the slow rank apart
    job, h = Job(world=2, compute=0.05, slow=0, extra=0.3, where="data"), HealthTracker(hang_timeout=600)
    job.advance()
    assert job.sums[0] == pytest.approx(job.sums[1])
    found = [f for i in range(5) for f in h.update(job.advance(), now=10 * i)]
    assert [(f.kind, f.ranks) for f in found] == [(STRAGGLER, (0,))]


def test_small_jitter_is_not_a_straggler():
    job, h = Job(world=2, compute=0.001, slow=1, extra=0.001), HealthTracker(hang_timeout=600)
    assert [f for i in range(8) for f in h.update(job.advance(), now=10 * i)] == []


def test_stall_names_the_rank_behind_and_clears_when_training_resumes():
    job, h = Job(world=4), HealthTracker(hang_timeout=30)
    h.update(job.advance(), now=0)
    frozen = job.advance(frozen=3)
    assert h.update(frozen, now=10) == []
    assert h.update(frozen, now=35) == []                  # 25 s idle < 30 s
    found = h.update(frozen, now=41)
    assert [(f.kind, f.active, f.ranks) for f in found] == [(STALLED, True, (3,))]
    assert "rank 3" in found[0].message and "rank 0" not in found[0].message
    assert h.update(frozen, now=60) == []                  # reported once
    resumed = h.update(job.advance(), now=70)
    assert [(f.kind, f.active) for f in resumed] == [(STALLED, False)]


def test_stall_uses_step_started_when_steps_are_equal():
    job, h = Job(world=2), HealthTracker(hang_timeout=5)
    s = job.advance()
    s[1].step_started = s[1].step                          # rank 1 never got the next batch
    h.update(s, now=0)
    found = h.update(s, now=6)
    assert found[0].ranks == (1,)


def test_default_hang_timeout_from_observed_step_time():
    h = HealthTracker(min_hang_timeout=300, hang_step_multiple=20)
    assert h.effective_hang_timeout() == 300
    job = Job(world=2, compute=30.0)                        # 30 s iterations -> 20 x 30 s = 600 s
    for i in range(3):
        h.update(job.advance(n=1), now=40 * i)
    assert h.effective_hang_timeout() == 600
    assert HealthTracker(hang_timeout=42).effective_hang_timeout() == 42
