"""GPU defaults and `auto` rules (tuning.py): each resolved value, each override."""
from __future__ import annotations

import pytest
import torch

from ddpjob_trainer import tuning
from ddpjob_trainer.config import parse_config
from ddpjob_trainer.errors import ConfigError
from ddpjob_trainer.reporting import NullReporter

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")


class Lines(NullReporter):
    def __init__(self):
        self.warnings = []

    def warning(self, msg):
        self.warnings.append(msg)


@pytest.mark.parametrize("raw, local_world, cpus, expected", [
    ({"dataset": "digits"}, 1, 48, 0),                       # in memory: a worker only adds IPC
    ({"dataset": "synthetic"}, 8, 48, 0),
    ({"dataset": "imagefolder", "dataPath": "/d"}, 8, 48, 5),  # 48 CPUs / 8 ranks - 1
    ({"dataset": "imagefolder", "dataPath": "/d"}, 1, 48, 8),  # capped
    ({"dataset": "imagefolder", "dataPath": "/d"}, 8, 4, 1),   # never 0 for decoded images
    ({"dataset": "digits", "numWorkers": 2}, 8, 48, 2),        # explicit wins
])
def test_num_workers_auto(raw, local_world, cpus, expected):
    assert tuning.resolve_num_workers(parse_config(raw), local_world_size=local_world, cpus=cpus) == expected


def test_channels_last_and_static_graph_auto_and_overrides():
    assert tuning.use_channels_last(parse_config({"model": "convnet"}), GPU)
    assert not tuning.use_channels_last(parse_config({"model": "mlp"}), GPU)
    assert not tuning.use_channels_last(parse_config({"model": "convnet"}), CPU)
    assert not tuning.use_channels_last(parse_config({"model": "convnet", "channelsLast": False}), GPU)
    assert tuning.static_graph(parse_config({}))
    assert not tuning.static_graph(parse_config({"gradAccumSteps": 2}))
    assert not tuning.static_graph(parse_config({"compile": True}))
    assert not tuning.static_graph(parse_config({"ddp": {"staticGraph": False}}))


def test_bf16_required_on_a_gpu_without_it_is_a_config_error():
    with pytest.raises(ConfigError, match="spec.trainer.precision: bf16 requested but"):
        tuning.autocast_dtype(parse_config({"precision": "bf16"}), GPU, log=Lines(), bf16_supported=False)


def test_bf16_auto_on_a_gpu_without_it_warns_and_trains_in_fp32():
    log = Lines()
    assert tuning.autocast_dtype(parse_config({}), GPU, log=log, bf16_supported=False) is None
    assert any("no bf16 support; training in fp32" in w for w in log.warnings)
    assert tuning.autocast_dtype(parse_config({}), GPU, log=log, bf16_supported=True) == torch.bfloat16
    assert tuning.autocast_dtype(parse_config({"precision": "fp32"}), GPU, log=log, bf16_supported=True) is None


def test_bf16_on_cpu_is_said_not_silent():
    log = Lines()
    assert tuning.autocast_dtype(parse_config({"precision": "bf16"}), CPU, log=log) is None
    assert log.warnings


def test_nccl_env_defaults_never_override_a_set_value():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    added = tuning.set_nccl_env_defaults(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in added
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"


def test_available_cpus_prefers_the_pods_request_when_given():
    assert tuning.available_cpus({"DDPJOB_CPUS": "48"}) == 48
    assert tuning.available_cpus({"DDPJOB_CPUS": "2.5"}) == 2
    assert tuning.available_cpus({}) >= 1
    with pytest.raises(ConfigError, match="DDPJOB_CPUS"):
        tuning.available_cpus({"DDPJOB_CPUS": "lots"})
