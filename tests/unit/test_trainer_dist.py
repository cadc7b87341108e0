"""Which device a rank trains on (dist.rank_device): a GPU for every local rank, or the CPU for all."""
from __future__ import annotations

import pytest
import torch

from ddpjob_trainer.dist import rank_device
from ddpjob_trainer.errors import ConfigError


@pytest.mark.parametrize("gpus_per_node, visible, local_rank, local_world, expected", [
    ("8", 8, 7, 8, "cuda:7"),
    ("2", 1, 0, 2, ConfigError),      # rank 0 would take NCCL, rank 1 gloo on the CPU: a hang
    ("2", 1, 1, 2, ConfigError),
    ("1", 0, 0, 1, ConfigError),      # no CUDA in the pod at all
    ("0", 4, 0, 1, "cpu"),            # a CPU job stays on the CPU
    (None, 2, 1, 2, "cuda:1"),        # outside the operator: CUDA when every local rank has one
    (None, 1, 0, 2, "cpu"),           # ... else the CPU for all of them, never a mix
    (None, 0, 0, 1, "cpu"),
])
def test_a_rank_gets_its_own_gpu_or_every_local_rank_is_on_the_cpu(
        monkeypatch, gpus_per_node, visible, local_rank, local_world, expected):
    # The device count is all that is faked: this machine has no GPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    env = {} if gpus_per_node is None else {"DDPJOB_GPUS_PER_NODE": gpus_per_node}
    if expected is ConfigError:
        with pytest.raises(ConfigError, match=f"spec.gpusPerNode is {gpus_per_node}, so each of this pod's "
                                              f"{local_world} local ranks needs a GPU"):
            rank_device(local_rank, local_world, env)
    else:
        assert rank_device(local_rank, local_world, env) == torch.device(expected)
