"""spec.trainer validation: every mistake is named by its key."""
from __future__ import annotations

import pytest

from ddpjob_trainer.config import config_from_env, parse_config
from ddpjob_trainer.errors import ConfigError


def test_defaults_and_camel_case_keys():
    cfg = parse_config({"dataset": "synthetic", "batchSize": 8, "gradAccumSteps": 2,
                        "checkpoint": {"dir": "/ckpt", "everySteps": 100, "keep": 3},
                        "synthetic": {"shape": [3, 8, 8], "numClasses": 4}})
    assert (cfg.batch_size, cfg.grad_accum_steps, cfg.epochs) == (8, 2, 10)
    assert cfg.checkpoint.dir == "/ckpt" and cfg.checkpoint.every_steps == 100
    assert cfg.synthetic.shape == (3, 8, 8) and cfg.synthetic.num_classes == 4
    assert cfg.mlflow is None


@pytest.mark.parametrize("raw, needle", [
    ({"epoch": 3}, "spec.trainer.epoch: unknown key"),
    ({"epochs": 0}, "spec.trainer.epochs: must be >= 1"),
    ({"epochs": 2.5}, "spec.trainer.epochs: expected an integer"),
    ({"epochs": True}, "spec.trainer.epochs: expected an integer"),
    ({"lr": "fast"}, "spec.trainer.lr: expected a number"),
    ({"dataset": "cifar"}, "spec.trainer.dataset: must be one of digits, synthetic, imagefolder"),
    ({"model": "vit"}, "spec.trainer.model: must be one of"),
    ({"compile": "yes"}, "spec.trainer.compile: expected true or false"),
    ({"checkpoint": {"dir": "/c", "keep": 0}}, "spec.trainer.checkpoint.keep: must be >= 1"),
    ({"checkpoint": "/c"}, "spec.trainer.checkpoint: expected a mapping"),
    ({"synthetic": {"shape": [3, -1]}}, "spec.trainer.synthetic.shape"),
    ({"mlflow": {"experiment": "x"}}, "spec.trainer.mlflow.trackingUri: required"),
    ({"dataset": "imagefolder"}, "spec.trainer.dataPath: required"),
    ({"dataset": "digits", "model": "resnet18"}, "spec.trainer.model: resnet18 needs 3-channel"),
])
def test_bad_config_names_the_key(raw, needle):
    with pytest.raises(ConfigError, match=None) as info:
        parse_config(raw)
    assert needle in str(info.value)


def test_env_config_must_be_json():
    with pytest.raises(ConfigError, match="DDPJOB_TRAINER_CONFIG: not valid JSON"):
        config_from_env({"DDPJOB_TRAINER_CONFIG": "{epochs: 3"})


def test_mlflow_without_the_package_is_a_config_error(monkeypatch):
    import builtins

    from ddpjob_trainer.config import MlflowConfig
    from ddpjob_trainer.reporting import make_reporter

    real_import = builtins.__import__

    def no_mlflow(name, *a, **k):
        if name == "mlflow":
            raise ImportError("no mlflow")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    with pytest.raises(ConfigError, match="spec.trainer.mlflow: mlflow is not installed"):
        make_reporter(rank=0, mlflow=MlflowConfig(tracking_uri="http://x"))
    # Other ranks never touch MLflow at all (seed 000: log from rank 0 only).
    assert type(make_reporter(rank=1, mlflow=MlflowConfig(tracking_uri="http://x"))).__name__ == "NullReporter"


def test_gpu_and_data_loading_keys_and_their_defaults():
    from ddpjob_trainer.config import AUTO

    d = parse_config({})
    assert d.num_workers == AUTO and d.prefetch_factor == 2 and d.cudnn_benchmark and d.tf32
    assert d.channels_last == AUTO and d.step_timeout_seconds == 300
    assert (d.ddp.buffer_sync, d.ddp.static_graph, d.ddp.bucket_cap_mb) == ("average", AUTO, 25)
    cfg = parse_config({"numWorkers": 3, "prefetchFactor": 4, "cudnnBenchmark": False, "tf32": False,
                        "channelsLast": True, "stepTimeoutSeconds": 0,
                        "ddp": {"bufferSync": "broadcast", "staticGraph": False, "bucketCapMb": 50}})
    assert (cfg.num_workers, cfg.prefetch_factor, cfg.cudnn_benchmark, cfg.tf32) == (3, 4, False, False)
    assert cfg.channels_last is True and cfg.step_timeout_seconds == 0
    assert (cfg.ddp.buffer_sync, cfg.ddp.static_graph, cfg.ddp.bucket_cap_mb) == ("broadcast", False, 50)


@pytest.mark.parametrize("raw, needle", [
    ({"numWorkers": "many"}, 'spec.trainer.numWorkers: expected an integer or "auto"'),
    ({"numWorkers": -1}, "spec.trainer.numWorkers: must be >= 0"),
    ({"channelsLast": "auto"}, "spec.trainer.channelsLast: expected true or false"),
    ({"ddp": {"bufferSync": "mean"}}, "spec.trainer.ddp.bufferSync: must be one of average, broadcast"),
    ({"ddp": {"bucketCapMb": 0}}, "spec.trainer.ddp.bucketCapMb: must be >= 1"),
    ({"ddp": {"broadcastBuffers": True}}, "spec.trainer.ddp.broadcastBuffers: unknown key"),
])
def test_bad_gpu_and_data_loading_keys_name_the_key(raw, needle):
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert needle in str(info.value)
