"""shm.shm_size: /dev/shm sized from what the built-in trainer's loaders hold, unless spec.shmSize says."""
from __future__ import annotations

import pytest

from ddpjob_operator.builders import shm
from ddpjob_operator.builders.pods import render_pod
from ddpjob_operator.builders.shm import GIB, loader_bytes, loader_workers, shm_size
from tests.support.builders import make_job

# One 224x224 RGB float32 sample and its int64 label.
IMAGE_224 = 3 * 224 * 224 * 4 + 8
IMAGENET = {"dataset": "imagefolder", "dataPath": "/data"}


@pytest.mark.parametrize("spec, expected", [
    # In-memory data sets load in the training process (no workers): the floor.
    ({}, "2Gi"),
    ({"trainer": {"dataset": "digits"}}, "2Gi"),
    ({"gpusPerNode": 8, "trainer": {"dataset": "synthetic", "batchSize": 4096}}, "2Gi"),
    # A command: job's loader is unknown: the floor.
    ({"command": ["torchrun", "train.py"], "gpusPerNode": 8}, "2Gi"),
    # The issue's case: 8 ranks of 224x224 float32 batches (64 per batch, prefetch 2); no CPU
    # request, so `auto` may pick 8 workers: 8 x 8 x 2 x 64 x 602,120 B = 4.6 GiB over the floor.
    ({"gpusPerNode": 8, "trainer": IMAGENET}, "7Gi"),
    # 48 CPUs for 8 ranks: 48 // 8 - 1 = 5 workers, prefetch 4: 8 x 5 x 4 x 64 x 602,120 B = 5.7 GiB.
    ({"gpusPerNode": 8, "resources": {"requests": {"cpu": "48"}},
      "trainer": {**IMAGENET, "prefetchFactor": 4}}, "8Gi"),
    # The CPU request of the template's trainer container counts as well (2 CPUs, 1 rank: 1 worker).
    ({"template": {"spec": {"containers": [{"name": "trainer", "resources": {"requests": {"cpu": "1500m"}}}]}},
      "trainer": {**IMAGENET, "batchSize": 32}}, "3Gi"),
    # Explicit workers on in-memory data hold batches too: 1 x 4 x 2 x 1024 x (3x32x32x4 + 8) B.
    ({"trainer": {"dataset": "synthetic", "numWorkers": 4, "batchSize": 1024}}, "3Gi"),
    ({"trainer": {**IMAGENET, "numWorkers": 0}, "gpusPerNode": 8}, "2Gi"),
    ({"trainer": {**IMAGENET, "imageSize": 64}, "gpusPerNode": 8}, "3Gi"),
    # spec.shmSize wins, whatever the trainer would need.
    ({"shmSize": "1Gi", "gpusPerNode": 8, "trainer": IMAGENET}, "1Gi"),
    ({"shmSize": "64Gi"}, "64Gi"),
    ({"shmSize": 1073741824}, "1073741824"),
])
def test_shm_size(spec, expected):
    job = make_job(**spec)
    assert shm_size(job) == expected
    (vol,) = [v for v in render_pod(job, 0)["spec"]["volumes"] if v["name"] == "dshm"]
    assert vol["emptyDir"] == {"medium": "Memory", "sizeLimit": expected}


def test_the_issues_case_no_longer_fits_the_old_fixed_size():
    held = loader_bytes(IMAGENET, ranks=8, cpus=None)
    assert held == 8 * 8 * 2 * 64 * IMAGE_224 and held > 2 * GIB


@pytest.mark.parametrize("trainer, ranks, cpus, expected", [
    (IMAGENET, 8, 48, 5),
    (IMAGENET, 8, 8, 1),       # at least one
    (IMAGENET, 1, 64, 8),      # at most eight
    (IMAGENET, 2, None, 8),    # the node's CPUs, unknown: the most auto picks
    ({"dataset": "digits"}, 1, 64, 0),
    ({"dataset": "synthetic"}, 1, 64, 0),
    ({}, 1, 64, 0),
    ({"dataset": "digits", "numWorkers": 3}, 1, 64, 3),
])
def test_loader_workers_follow_the_trainers_auto_rule(trainer, ranks, cpus, expected):
    assert loader_workers(trainer, ranks=ranks, cpus=cpus) == expected
    # The trainer's own rule, with the same CPUs, agrees (where the CPUs are known).
    from ddpjob_trainer.config import parse_config
    from ddpjob_trainer.tuning import resolve_num_workers

    if cpus is not None:
        got = resolve_num_workers(parse_config(trainer), local_world_size=ranks, cpus=cpus)
        assert got == expected


def test_the_digits_shape_is_the_trainers():
    """shm.py knows the digits' sample shape without loading them (the operator has no scikit-learn)."""
    from ddpjob_trainer.data import digits

    assert digits().input_shape == shm.DIGITS_SHAPE


SNAPSHOTTED = {"checkpoint": {"dir": "/ckpt"}}


@pytest.mark.parametrize("trainer", [
    {}, {"model": "mlp"}, {"dataset": "synthetic", "synthetic": {"shape": [3, 16, 16], "numClasses": 7}},
    {"model": "mlp", "dataset": "synthetic", "synthetic": {"shape": [1, 28, 28]}},
    {"model": "resnet18", "dataset": "synthetic"}, {"model": "resnet50", "dataset": "synthetic"},
    {"model": "resnet18", **IMAGENET},
])
def test_model_params_is_what_torch_builds(trainer):
    from ddpjob_trainer.models import build_model
    model = build_model(trainer.get("model", "convnet"), shm.sample_shape(trainer), shm.num_classes(trainer))
    assert shm.model_params(trainer) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("trainer", [{}, {"momentum": 0}, {"optimizer": "adamw"}, {"optimizer": "adamw", "momentum": 0}])
def test_snapshots_hold_the_parameters_and_the_optimizers_state(trainer):
    # The optimizer the trainer builds, after one step: its per-parameter state is what a
    # snapshot holds beside the parameters, in every copy kept and the one being written.
    import torch
    from ddpjob_api import contract
    from ddpjob_trainer.config import parse_config
    from ddpjob_trainer.loop import _build_optimizer
    from ddpjob_trainer.models import build_model
    model = build_model("convnet", shm.sample_shape({}), shm.num_classes({}))
    opt = _build_optimizer(parse_config(trainer), model.parameters())
    model(torch.ones(2, *shm.sample_shape({}))).sum().backward()
    opt.step()
    params = sum(p.numel() for p in model.parameters())
    moments = sum(t.numel() for p, st in opt.state.items() for t in st.values()
                  if torch.is_tensor(t) and t.shape == p.shape)
    copies = contract.SNAPSHOTS_KEPT + 1
    assert shm.snapshot_bytes({**SNAPSHOTTED, **trainer}, ranks=3) == 3 * copies * 4 * (params + moments)
    # No checkpoint dir, or snapshots off: nothing is written to /dev/shm.
    assert shm.snapshot_bytes(trainer, ranks=3) == 0
    assert shm.snapshot_bytes({"checkpoint": {"dir": "/c", "snapshotEverySteps": 0}, **trainer}, ranks=3) == 0


@pytest.mark.parametrize("spec, expected", [
    # 8 ranks of resnet50 (synthetic data, 10 classes: 23,528,522 parameters) with AdamW: 3 copies x
    # 8 x 4 B x 3 = 6.3 GiB over the floor; with SGD (momentum) 4.2 GiB.
    ({"gpusPerNode": 8, "trainer": {"model": "resnet50", "dataset": "synthetic", "optimizer": "adamw",
                                    **SNAPSHOTTED}}, "9Gi"),
    ({"gpusPerNode": 8, "trainer": {"model": "resnet50", "dataset": "synthetic", **SNAPSHOTTED}}, "7Gi"),
    # The digits convnet's snapshots are tiny (3.6 MB), yet a GiB more than the floor: sizes are whole GiB.
    ({"trainer": SNAPSHOTTED}, "3Gi"),
    ({"shmSize": "4Gi", "gpusPerNode": 8, "trainer": {"model": "resnet50", **SNAPSHOTTED}}, "4Gi"),
])
def test_shm_size_counts_the_snapshots(spec, expected):
    assert shm_size(make_job(**spec)) == expected
