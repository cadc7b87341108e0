"""Sharding and sampling: exact evaluation and resumable order."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from ddpjob_trainer.data import (ResumableSampler, advance, digits, epoch_order, eval_shard, rank_share,
                                 steps_left)


@pytest.mark.parametrize("n, world", [(359, 1), (359, 2), (359, 3), (10, 4), (3, 5)])
def test_eval_shards_cover_every_sample_exactly_once(n, world):
    seen = [i for r in range(world) for i in eval_shard(n, rank=r, world_size=world)]
    assert sorted(seen) == list(range(n))


def test_distributed_sampler_would_have_double_counted():
    """Why eval_shard exists (seed 003): DistributedSampler pads 359 samples to 360 on 3 ranks."""
    from torch.utils.data import DistributedSampler

    ds = TensorDataset(torch.arange(359))
    total = sum(len(DistributedSampler(ds, num_replicas=3, rank=r, shuffle=False)) for r in range(3))
    assert total == 360


def test_digits_split_is_deterministic_and_disjoint():
    a, b = digits(), digits()
    assert a.train.indices == b.train.indices and a.val.indices == b.val.indices
    assert not set(a.train.indices) & set(a.val.indices)
    assert (len(a.train), len(a.val)) == (1438, 359)


@pytest.mark.parametrize("start", [0, 1, 17, 50])
@pytest.mark.parametrize("rank", [0, 1])
def test_resumed_sampler_yields_exactly_the_rest_of_the_epoch(start, rank):
    ds = TensorDataset(torch.arange(101))
    full = ResumableSampler(ds, num_replicas=2, rank=rank, seed=7)
    full.set_epoch(3)
    order = list(full)
    resumed = ResumableSampler(ds, num_replicas=2, rank=rank, seed=7)
    resumed.set_epoch(3, start=start * 2)  # each of the 2 ranks took `start` samples
    assert list(resumed) == order[start:]
    assert len(resumed) == len(order) - start


@pytest.mark.parametrize("n, world", [(101, 1), (101, 2), (101, 3), (96, 4), (5, 8)])
@pytest.mark.parametrize("epoch", [0, 3])
def test_an_unresized_epoch_is_split_as_distributed_sampler_splits_it(n, world, epoch):
    from torch.utils.data import DistributedSampler

    order = epoch_order(n, seed=7, epoch=epoch)
    for rank in range(world):
        theirs = DistributedSampler(TensorDataset(torch.arange(n)), num_replicas=world, rank=rank, shuffle=True, seed=7)
        theirs.set_epoch(epoch)
        assert rank_share(order, start=0, rank=rank, world_size=world) == list(theirs)


@pytest.mark.parametrize("n, before, taken, after", [
    (101, 2, 17, 1),   # shrink
    (101, 2, 17, 3),   # grow, the rest (67) padded to 69
    (96, 4, 5, 3),
    (96, 3, 0, 2),     # nothing taken yet
    (10, 2, 4, 3),     # 2 left over 3 ranks: one padded
])
def test_a_resize_mid_epoch_trains_every_sample_of_the_epoch_exactly_once(n, before, taken, after):
    """`before` ranks each take `taken` samples; the group is checkpointed at that global offset and
    resumed at `after` ranks, which take the rest: together every sample once, apart from the
    padding that evens out the last step (DistributedSampler's, taken from the epoch's start)."""
    order = epoch_order(n, seed=5, epoch=2)
    first = [i for r in range(before) for i in rank_share(order, start=0, rank=r, world_size=before)[:taken]]
    offset = advance(0, taken=taken, world_size=before, n=n)
    assert sorted(first) == sorted(order[:offset])
    rest = [i for r in range(after) for i in rank_share(order, start=offset, rank=r, world_size=after)]
    pad = -(n - offset) % after
    assert sorted(first + rest) == sorted(list(range(n)) + order[:pad])
    assert advance(offset, taken=len(rank_share(order, start=offset, rank=0, world_size=after)), world_size=after,
                   n=n) == n  # the epoch's end


@pytest.mark.parametrize("n, epoch, done, epochs, world, batch, accum, want", [
    (1438, 0, 0, 2, 2, 32, 1, 2 * 23),       # 719 per rank: 23 micro-batches, one step each
    (1438, 0, 0, 2, 1, 32, 2, 2 * 23),       # 1438 on one rank: 45 micro-batches, 2 per step
    (1438, 0, 64 * 5, 1, 2, 32, 1, 23 - 5),  # 5 steps of 2 x 32 taken
    (1438, 0, 64 * 5, 1, 1, 32, 1, 35),      # the same rest on one rank: 1118 samples, 35 batches
    (1438, 0, 64 * 5, 1, 3, 32, 1, 12),      # on three: 373 each
    (1438, 1, 1438, 2, 2, 32, 1, 0),         # the last epoch's end
    (1438, 2, 0, 2, 2, 32, 1, 0),            # done
])
def test_steps_left_counts_the_rest_at_the_new_world_size(n, epoch, done, epochs, world, batch, accum, want):
    assert steps_left(n, epoch=epoch, samples_done=done, epochs=epochs, world_size=world, batch_size=batch,
                      grad_accum_steps=accum) == want


def test_each_epoch_has_a_different_order():
    ds = TensorDataset(torch.arange(64))
    s = ResumableSampler(ds, num_replicas=1, rank=0, seed=0)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    assert list(s) != e0


def test_digits_are_load_digits_own_arrays_read_without_importing_scikit_learn():
    """The worker reads the digits CSV that scikit-learn ships, without its import (as long as
    torch's, on every restart's path): the same arrays as `load_digits`, and no sklearn module."""
    import subprocess
    import sys

    code = """
import sys
from ddpjob_trainer.data import digits
b = digits()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("sklearn", "scipy")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
    import numpy as np
    from sklearn.datasets import load_digits

    from ddpjob_trainer.data import _digits_arrays
    want, (images, target) = load_digits(), _digits_arrays()
    assert images.dtype == want.images.dtype and target.dtype == want.target.dtype
    assert np.array_equal(images, want.images) and np.array_equal(target, want.target)
