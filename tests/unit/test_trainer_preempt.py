"""preempt.py's pure parts: the save-or-skip rule (measured or estimated), the ballot's encoding, the stop budget, and the
SIGTERM note. The whole path (real torchrun ranks, a save on SIGTERM, the resume) is in
tests/trainer/test_launcher_signals.py and tests/realpods/test_pod_stop.py."""
from __future__ import annotations

import math
import os
import signal

import pytest

from ddpjob_trainer import preempt, torchapi


FAST = preempt.SaveEstimate(nbytes=1_000_000, bandwidth=100e6)  # 0.01 s
SLOW = preempt.SaveEstimate(nbytes=4_000_000_000, bandwidth=200e6)  # 20 s


@pytest.mark.parametrize("left, last_save, estimate, step, saved, save, why", [
    (20.0, 2.0, FAST, 0.5, False, True, "the last save took 2.00s (measured), 19.5s of the stop grace left"),
    (20.0, 2.0, FAST, 0.5, True, False, "already saved"),
    (4.0, 2.0, FAST, 1.5, False, False,
     "the last save took 2.00s (measured) and 2.5s of the stop grace is left"),                   # 3.0 > 2.5
    (4.5, 2.0, FAST, 1.5, False, True, "3.0s of the stop grace left"),                            # 3.0 fits 3.0
    (1.0, 2.0, FAST, 5.0, False, False, "0.0s of the stop grace is left"),                        # past SIGKILL
    (20.0, 2.0, SLOW, 0.5, False, True, "the last save took 2.00s (measured)"),  # a measured save wins
    # Before the attempt's first measured save: the estimate, bytes over the directory's write speed.
    (20.0, None, FAST, 0.5, False, True, "a save estimated at 0.01s (1 MB at 100 MB/s, the checkpoint "
     "directory's write speed; no save measured yet in this attempt), 19.5s of the stop grace left"),
    (30.5, None, SLOW, 0.5, False, True, "a save estimated at 20.00s"),                           # 30.0 fits 30.0
    (30.0, None, SLOW, 0.5, False, False, "a save estimated at 20.00s (4 GB at 200 MB/s, the checkpoint "
     "directory's write speed; no save measured yet in this attempt) and 29.5s of the stop grace is left"),
    (20.0, None, FAST, 0.5, True, False, "already saved"),
])
def test_a_stop_saves_when_the_measured_or_else_the_estimated_save_fits_in_what_is_left(
        left, last_save, estimate, step, saved, save, why):
    got, reason = preempt.plan(left=left, last_save=last_save, estimate=estimate, step_seconds=step, saved=saved)
    assert got is save and why in reason, reason


@pytest.mark.parametrize("left, last_save, step", [(math.inf, None, 0.25), (3.5, 1.25, 0.5), (math.inf, 0.0, 0.0)])
def test_a_ballot_decodes_to_what_was_cast(left, last_save, step):
    assert preempt.agree(preempt.ballot(left=left, last_save=last_save, step_seconds=step)) == preempt.Agreed(
        left=left, last_save=last_save, step_seconds=step)


def test_the_min_of_ballots_is_the_least_time_left_the_longest_save_and_step():
    import torch
    ballots = [preempt.ballot(left=math.inf, last_save=1.0, step_seconds=0.2),
               preempt.ballot(left=12.0, last_save=3.0, step_seconds=0.1),
               preempt.ballot(left=math.inf, last_save=2.0, step_seconds=0.4)]
    assert preempt.agree(torch.stack(ballots).min(dim=0).values) == preempt.Agreed(
        left=12.0, last_save=3.0, step_seconds=0.4)
    ballots.append(preempt.ballot(left=math.inf, last_save=None, step_seconds=0.1))  # a rank that has not saved
    assert preempt.agree(torch.stack(ballots).min(dim=0).values).last_save is None


def test_one_process_votes_alone():
    vote = preempt.StopVote(None)
    assert vote.cast(left=5.0, last_save=1.0, step_seconds=0.1) == preempt.Agreed(5.0, 1.0, 0.1)
    assert vote.finish() is None


@pytest.mark.parametrize("env, launcher", [
    ({}, 5.0),                                                       # no launcher grace given: its default
    ({"DDPJOB_STOP_GRACE_SECONDS": "23"}, 23.0),
    ({"DDPJOB_STOP_GRACE_SECONDS": "113", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "113"}, 113.0),
    ({"DDPJOB_STOP_GRACE_SECONDS": "113", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "10"}, 113.0),
])
def test_the_stop_budget_is_the_launchers_grace_unless_torchrun_kills_sooner(env, launcher):
    torchrun = torchapi.torchrun_shutdown_seconds(env)
    assert preempt.stop_budget(env) == min(launcher, torchrun)


def test_torchrun_reads_its_shutdown_timeout_where_this_torch_has_the_setting():
    from torch.distributed.launcher.api import LaunchConfig
    has = "shutdown_timeout" in LaunchConfig.__dataclass_fields__
    assert torchapi.torchrun_shutdown_seconds({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "113"}) == (113.0 if has else 30.0)
    assert torchapi.torchrun_shutdown_seconds({}) == 30.0


def test_sigterm_is_noted_once_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    req = preempt.StopRequest(budget=10.0).install()
    try:
        assert req.left() == math.inf
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the time kill returns (main thread)
        first = req.at
        assert first is not None and req.left(now=first + 4.0) == 6.0
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's agent sends another: the first counts
        assert req.at == first
    finally:
        req.restore()
    assert signal.getsignal(signal.SIGTERM) is before
