"""The learning-rate rule of the built-in trainer (loop.py): the schedule and the rule on a resize."""
from __future__ import annotations

import math

import pytest

from ddpjob_trainer.config import parse_config
from ddpjob_trainer.loop import Schedule, lr_scale


def _plain(step: int, *, warmup: int, total: int) -> float:
    """The schedule as it was before resizes existed: an unresized run must keep it bit for bit."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@pytest.mark.parametrize("warmup, total", [(0, 46), (5, 46), (0, 1), (3, 200)])
def test_an_unanchored_schedule_is_the_plain_cosine_exactly(warmup, total):
    s = Schedule(kind="cosine", warmup=warmup, total=total)
    assert [s.factor(step) for step in range(total + 2)] == [_plain(step, warmup=warmup, total=total)
                                                             for step in range(total + 2)]


@pytest.mark.parametrize("old_total, new_total", [(46, 80), (46, 30), (100, 101)])
def test_a_resize_keeps_the_decay_continuous_and_ends_it_at_the_new_last_step(old_total, new_total):
    before = Schedule(kind="cosine", warmup=4, total=old_total)
    at = 20
    after = Schedule(kind="cosine", warmup=4, total=new_total, anchor=(at, before.progress(at)))
    assert after.factor(at) == before.factor(at)
    assert after.factor(new_total) == 0.0 and after.factor(new_total - 1) > 0.0
    assert all(after.factor(s) >= after.factor(s + 1) for s in range(at, new_total))
    # A second resize anchors on the first one's progress.
    again = Schedule(kind="cosine", warmup=4, total=new_total + 7, anchor=(at + 5, after.progress(at + 5)))
    assert again.factor(at + 5) == after.factor(at + 5) and again.factor(new_total + 7) == 0.0


def test_a_constant_schedule_stays_constant_after_warmup():
    s = Schedule(kind="constant", warmup=2, total=10, anchor=(5, 0.4))
    assert [s.factor(step) for step in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("scaling, world, first, want", [
    ("linear", 2, 2, 1.0),   # never resized
    ("linear", 1, 2, 0.5),   # shrank: half the global batch, half the learning rate
    ("linear", 3, 2, 1.5),
    ("none", 1, 2, 1.0),
])
def test_the_learning_rate_follows_the_global_batch_by_lr_scaling(scaling, world, first, want):
    cfg = parse_config({"lrScaling": scaling})
    assert lr_scale(cfg, world_size=world, first_world_size=first) == want


def test_linear_scaling_is_the_default():
    assert parse_config({}).lr_scaling == "linear"
