"""HealthTracker: straggler (the rank its peers wait for) and stall detection."""
from __future__ import annotations

import pytest

from ddpjob_api.specgen import DDPJobSpec
from ddpjob_api.phases import Signal
from ddpjob_operator.decisions.health import HealthTracker
from ddpjob_operator.decisions.samples import RankSample


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
    assert [(f.kind, f.active, f.ranks) for f in found] == [(Signal.STRAGGLER, True, (2,))]
    assert "rank 2 (pod j-1 on node n1)" in found[0].message
    assert h.update(job.advance(), now=40) == []          # no repeated event while it lasts
    job.slow, job.extra = None, 0.0                       # it recovers
    changes = [f for i in range(5) for f in h.update(job.advance(), now=50 + 10 * i)]
    assert [(f.kind, f.active) for f in changes] == [(Signal.STRAGGLER, False)]


def test_two_ranks_straggler():
    job, h = Job(world=2, compute=0.05, slow=1, extra=0.5), HealthTracker(hang_timeout=600)
    found = [f for i in range(5) for f in h.update(job.advance(), now=10 * i)]
    assert [(f.kind, f.ranks) for f in found] == [(Signal.STRAGGLER, (1,))]


def test_straggler_with_a_slow_data_loader_counted_inside_its_step():
    # every rank's step time is equal here; only the data wait tells the slow rank apart
    job, h = Job(world=2, compute=0.05, slow=0, extra=0.3, where="data"), HealthTracker(hang_timeout=600)
    job.advance()
    assert job.sums[0] == pytest.approx(job.sums[1])
    found = [f for i in range(5) for f in h.update(job.advance(), now=10 * i)]
    assert [(f.kind, f.ranks) for f in found] == [(Signal.STRAGGLER, (0,))]


def test_small_jitter_is_not_a_straggler():
    job, h = Job(world=2, compute=0.001, slow=1, extra=0.001), HealthTracker(hang_timeout=600)
    assert [f for i in range(8) for f in h.update(job.advance(), now=10 * i)] == []


class GpuJob(Job):
    """NCCL on GPUs: the host runs ahead and syncs at log steps, so every host reports the same
    step times whichever GPU is slow; only the device's forward time (read at log steps) differs."""

    def __init__(self, world=4, forward=0.03, slow=None, factor=1.0, log_every=10):
        super().__init__(world=world, compute=0.1)
        self.forward, self.gpu_slow, self.factor, self.log_every = forward, slow, factor, log_every
        self.csum, self.ccount = [0.0] * world, 0
        self.unread = [0.0] * world

    def advance(self, n=10, frozen=None):
        out = super().advance(n)
        for _ in range(n):
            for r in range(self.world):
                self.unread[r] += self.forward * (self.factor if r == self.gpu_slow else 1.0)
        if self.step % self.log_every == 0:   # a log step: the trainer reads its events
            self.csum = [c + u for c, u in zip(self.csum, self.unread)]
            self.ccount, self.unread = self.step, [0.0] * self.world
        for r, s in out.items():
            s.compute_seconds_sum, s.compute_seconds_count = self.csum[r], self.ccount
        return out


def test_throttled_gpu_is_a_straggler_from_device_time_alone():
    job, h = GpuJob(world=4, slow=3, factor=2.0), HealthTracker(hang_timeout=600)
    job.advance()
    assert len({round(s, 9) for s in job.sums}) == 1      # the hosts cannot tell
    found = [f for i in range(6) for f in h.update(job.advance(), now=10 * i)]
    assert [(f.kind, f.active, f.ranks) for f in found] == [(Signal.STRAGGLER, True, (3,))]
    assert "rank 3 (pod j-1 on node n1) (2.0x the median 30ms per step)" in found[0].message


def test_device_time_is_judged_only_on_scrapes_that_cover_a_log_step():
    # scraped every 5 steps, read every 10: every other scrape has no fresh device time and
    # must neither flag nor count as calm (the streak spans it)
    job, h = GpuJob(world=2, slow=0, factor=3.0, log_every=10), HealthTracker(hang_timeout=600,
                                                                             straggler_windows=2)
    found = [f for i in range(8) for f in h.update(job.advance(n=5), now=10 * i)]
    assert [(f.kind, f.ranks) for f in found] == [(Signal.STRAGGLER, (0,))]


def test_healthy_gpu_job_has_no_findings():
    job, h = GpuJob(world=4), HealthTracker(hang_timeout=600)
    assert [f for i in range(8) for f in h.update(job.advance(), now=10 * i)] == []


def test_stall_names_the_rank_behind_and_clears_when_training_resumes():
    job, h = Job(world=4), HealthTracker(hang_timeout=30)
    h.update(job.advance(), now=0)
    frozen = job.advance(frozen=3)
    assert h.update(frozen, now=10) == []
    assert h.update(frozen, now=35) == []                  # 25 s idle < 30 s
    found = h.update(frozen, now=41)
    assert [(f.kind, f.active, f.ranks) for f in found] == [(Signal.STALLED, True, (3,))]
    assert "rank 3" in found[0].message and "rank 0" not in found[0].message
    assert h.update(frozen, now=60) == []                  # reported once
    resumed = h.update(job.advance(), now=70)
    assert [(f.kind, f.active) for f in resumed] == [(Signal.STALLED, False)]


def test_a_stall_is_overdue_for_a_group_restart_after_a_second_timeout_and_not_after_progress():
    job, h = Job(world=2), HealthTracker(hang_timeout=30)
    h.update(job.advance(), now=0)
    frozen = job.advance(frozen=1)
    h.update(frozen, now=1)
    h.update(frozen, now=32)
    assert Signal.STALLED in h.active and not h.overdue           # the pods' agents restart in place now
    h.update(frozen, now=60)
    assert not h.overdue                                   # 59 s < 2 x 30 s
    h.update(frozen, now=62)
    assert h.overdue                                       # no restart in place came
    h.update(job.advance(), now=63)
    assert Signal.STALLED not in h.active and not h.overdue


def test_stall_uses_step_started_when_steps_are_equal():
    job, h = Job(world=2), HealthTracker(hang_timeout=5)
    s = job.advance()
    s[1].step_started = s[1].step                          # rank 1 never got the next batch
    h.update(s, now=0)
    found = h.update(s, now=6)
    assert found[0].ranks == (1,)


def test_default_hang_timeout_from_observed_step_time():
    h = HealthTracker()
    assert h.effective_hang_timeout() == 300
    job = Job(world=2, compute=30.0)                        # 30 s iterations -> 20 x 30 s = 600 s
    for i in range(3):
        h.update(job.advance(n=1), now=40 * i)
    assert h.effective_hang_timeout() == 600
    assert HealthTracker(hang_timeout=42).effective_hang_timeout() == 42


# ---- stages: hangs before the first step, long evals and checkpoints -----------------------------

def staged(stages: dict[int, tuple[str, float]], step: int | None = None) -> dict[int, RankSample]:
    """What ranks report per stage: {rank: (stage, stage start)}, optionally with a step."""
    return {r: RankSample(rank=r, stage=st, stage_started_at=t, step=step, last_step_timestamp=None,
                          pod=f"j-{r}", node=f"n{r}")
            for r, (st, t) in stages.items()}


@pytest.mark.parametrize("stage", ["waiting_for_master", "rendezvous", "process_group_init", "first_step"])
def test_job_frozen_before_its_first_step_is_stalled_naming_the_stage(stage):
    h = HealthTracker(hang_timeout=30)
    frozen = staged({0: (stage, 1000.0), 1: (stage, 1001.0)})
    assert h.update(frozen, now=1010) == []
    assert h.calm_condition()[0] == "Starting"
    assert h.update(frozen, now=1025) == []                  # 24 s since the stage began < 30 s
    found = h.update(frozen, now=1032)                       # 31 s: the clock ran from the stage start
    assert [(f.kind, f.active, f.reason, f.ranks) for f in found] == [(Signal.STALLED, True, "StuckInStage", (0, 1))]
    assert found[0].message.startswith(f"stuck in {stage} for 31s (hangTimeoutSeconds 30): "
                                       "rank 0 (pod j-0 on node n0), rank 1 (pod j-1 on node n1)")
    assert h.update(frozen, now=1060) == []                  # reported once


def test_stage_change_is_progress_and_the_earliest_stage_names_the_culprit():
    h = HealthTracker(hang_timeout=30)
    h.update(staged({0: ("rendezvous", 1000.0), 1: ("waiting_for_master", 1000.0)}), now=1000)
    # 25 s later rank 0 begins process-group init: progress, the clock starts again
    later = staged({0: ("process_group_init", 1025.0), 1: ("waiting_for_master", 1000.0)})
    assert h.update(later, now=1026) == []
    assert h.update(later, now=1050) == []
    found = h.update(later, now=1057)
    assert found[0].ranks == (1,)
    assert found[0].message.startswith("stuck in waiting_for_master for 31s")
    assert "other ranks: rank 0 (pod j-0 on node n0) in process_group_init" in found[0].message
    resumed = h.update(staged({0: ("process_group_init", 1025.0), 1: ("rendezvous", 1058.0)}), now=1060)
    assert [(f.kind, f.active, f.reason) for f in resumed] == [(Signal.STALLED, False, "Resumed")]


def test_no_advancing_claim_before_a_step_and_a_stable_message():
    h = HealthTracker(hang_timeout=300)
    assert h.calm_condition() == ("Starting", "no training step yet; no stage reported")
    h.update(staged({0: ("rendezvous", 1000.0)}), now=1005)
    first = h.calm_condition()
    h.update(staged({0: ("rendezvous", 1000.0)}), now=1050)
    assert h.calm_condition() == first                       # no status write per scrape
    assert first == ("Starting", "no training step yet; in rendezvous since 1970-01-01T00:16:40Z "
                                 "(Stalled after 300s without progress)")
    assert "advancing" not in first[1]
    h.update(staged({0: ("training", 1060.0)}, step=1), now=1061)
    assert h.calm_condition() == ("Progressing", "training steps are advancing")


def test_default_timeout_before_the_first_step_is_generous():
    h = HealthTracker()                                     # no spec.hangTimeoutSeconds
    assert h.effective_hang_timeout(None) == 600 and h.effective_hang_timeout() == 300
    frozen = staged({0: ("first_step", 0.0 + 1000)})
    h.update(frozen, now=1000)
    assert h.update(frozen, now=1000 + 400) == []           # past the 300 s training default
    found = h.update(frozen, now=1000 + 601)
    assert "stuck in first_step for 601s (default hang timeout 600s; set spec.hangTimeoutSeconds)" \
        in found[0].message


def test_timeout_from_spec_applies_to_every_stage():
    assert HealthTracker(hang_timeout=20).effective_hang_timeout(None) == 20
    assert HealthTracker(hang_timeout=20).effective_hang_timeout("eval") == 20
    assert HealthTracker(hang_timeout=900).effective_hang_timeout(None) == 900


def test_long_eval_is_judged_from_its_start_not_the_last_step():
    job, h = Job(world=2, compute=0.1), HealthTracker(hang_timeout=60)
    s = job.advance()
    for r in s.values():
        r.stage, r.stage_started_at = "training", 900.0
    h.update(s, now=0)
    # 50 s without a step, then the eval begins: a stage change, the clock starts again
    for r in s.values():
        r.stage, r.stage_started_at = "eval", 1050.0
    assert h.update(s, now=50) == []
    assert h.calm_condition() == ("Progressing", "in eval since 1970-01-01T00:17:30Z, after step 10")
    assert h.update(s, now=105) == []                        # 105 s since the last step, 55 s in eval
    found = h.update(s, now=111)
    assert found[0].reason == "StuckInStage"
    assert found[0].message.startswith("stuck in eval after step 10 for 61s (hangTimeoutSeconds 60)")


def test_a_rank_missing_from_one_scrape_is_no_progress():
    h = HealthTracker(hang_timeout=30)
    both = staged({0: ("rendezvous", 1000.0), 1: ("rendezvous", 1000.0)})
    h.update(both, now=1000)
    h.update({0: both[0]}, now=1015)                        # rank 1's scrape failed once
    assert h.update(both, now=1025) == []
    assert h.update(both, now=1031)[0].active


@pytest.mark.parametrize("trainer, startup", [
    (None, 600), ({}, 600), ({"timeoutSeconds": 300}, 600),        # never below the default
    ({"timeoutSeconds": 1800}, 1800), ({"timeoutSeconds": "x"}, 600),
])
def test_a_trainer_start_up_limit_past_600s_raises_the_start_up_hang_timeout(trainer, startup):
    h = HealthTracker.for_spec(DDPJobSpec.from_dict({"image": "i", "trainer": trainer}))
    assert h.effective_hang_timeout(None) == startup
    assert h.effective_hang_timeout("eval") == startup and h.effective_hang_timeout() == 300
    spec = DDPJobSpec.from_dict({"image": "i", "trainer": trainer, "hangTimeoutSeconds": 45})
    assert HealthTracker.for_spec(spec).effective_hang_timeout(None) == 45
