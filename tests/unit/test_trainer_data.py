"""Sharding and sampling: exact evaluation and resumable order."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from ddpjob_trainer.data import ResumableSampler, digits, eval_shard


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
    full = ResumableSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=7)
    full.set_epoch(3)
    order = list(full)
    resumed = ResumableSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=7)
    resumed.set_epoch(3, start=start)
    assert list(resumed) == order[start:]
    assert len(resumed) == len(order) - start


def test_each_epoch_has_a_different_order():
    ds = TensorDataset(torch.arange(64))
    s = ResumableSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    assert list(s) != e0
