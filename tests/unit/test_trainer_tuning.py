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


def _gpu(*, native: bool, emulated: bool):
    """torch.cuda.is_bf16_supported of a GPU that runs bf16 natively (Ampere on) or only emulates it."""
    return lambda including_emulation=True: native or (emulated and including_emulation)


AMPERE, TURING, NO_BF16 = _gpu(native=True, emulated=True), _gpu(native=False, emulated=True), \
    _gpu(native=False, emulated=False)


@pytest.mark.parametrize("precision, gpu, expected", [
    ("auto", AMPERE, torch.bfloat16),
    ("bf16", AMPERE, torch.bfloat16),
    ("fp32", AMPERE, None),
    ("auto", TURING, None),          # emulated bf16 (torch's default counts it) is slower than fp32
    ("bf16", TURING, ConfigError),
    ("auto", NO_BF16, None),
    ("bf16", NO_BF16, ConfigError),
])
def test_bf16_only_where_the_gpu_runs_it_natively(precision, gpu, expected):
    log = Lines()
    cfg = parse_config({"precision": precision})
    if expected is ConfigError:
        with pytest.raises(ConfigError, match="spec.trainer.precision: bf16 requested but .* no native bf16"):
            tuning.autocast_dtype(cfg, GPU, log=log, bf16_supported=gpu)
        return
    assert tuning.autocast_dtype(cfg, GPU, log=log, bf16_supported=gpu) == expected
    fell_back = precision == "auto" and expected is None
    assert any("no native bf16 support; training in fp32" in w for w in log.warnings) == fell_back


def test_bf16_on_cpu_is_said_not_silent():
    log = Lines()
    assert tuning.autocast_dtype(parse_config({"precision": "bf16"}), CPU, log=log) is None
    assert log.warnings


def test_nccl_env_defaults_never_override_a_set_value():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    added = tuning.set_nccl_env_defaults(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in added
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"


def test_flight_recorder_dumps_go_to_the_debug_dir_which_outlives_the_pod(tmp_path):
    from ddpjob_api import contract
    where = contract.debug_dir(str(tmp_path), 2)
    env: dict[str, str] = {}
    tuning.set_nccl_env_defaults(env, debug_dir=where)
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/debug/attempt-2/nccl_trace_rank_"
    assert (tmp_path / "debug" / "attempt-2").is_dir()  # NCCL writes into it, never creates it
    assert tuning.set_nccl_env_defaults({})  # without one: the pod's /tmp, as before
    mine = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/data/trace_"}
    tuning.set_nccl_env_defaults(mine, debug_dir=where)
    assert mine["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/data/trace_"


def test_available_cpus_prefers_the_pods_request_when_given():
    assert tuning.available_cpus({"DDPJOB_CPUS": "48"}) == 48
    assert tuning.available_cpus({"DDPJOB_CPUS": "2.5"}) == 2
    assert tuning.available_cpus({}) >= 1
    with pytest.raises(ConfigError, match="DDPJOB_CPUS"):
        tuning.available_cpus({"DDPJOB_CPUS": "lots"})
