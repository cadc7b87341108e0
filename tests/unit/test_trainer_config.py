"""spec.trainer validation: every mistake is named by its key."""
from __future__ import annotations

import dataclasses
import re
import typing

import pytest
import yaml

from ddpjob_api import crdschema
from ddpjob_trainer import config
from ddpjob_trainer.config import TrainerConfig, config_from_env, parse_config
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
    ({"epochs": 0}, "spec.trainer.epochs: 0 is less than the minimum of 1"),
    ({"epochs": 2.5}, "spec.trainer.epochs: 2.5 is not of type 'integer'"),
    ({"epochs": True}, "spec.trainer.epochs: True is not of type 'integer'"),
    ({"lr": "fast"}, "spec.trainer.lr: 'fast' is not of type 'number'"),
    ({"dataset": "cifar"}, "spec.trainer.dataset: 'cifar' is not one of ['digits', 'synthetic', 'imagefolder']"),
    ({"model": "vit"}, "spec.trainer.model: 'vit' is not one of"),
    ({"compile": "yes"}, "spec.trainer.compile: 'yes' is not of type 'boolean'"),
    ({"checkpoint": {"dir": "/c", "keep": 0}}, "spec.trainer.checkpoint.keep: 0 is less than the minimum of 1"),
    ({"checkpoint": "/c"}, "spec.trainer.checkpoint: '/c' is not of type 'object'"),
    ({"synthetic": {"shape": [3, -1]}}, "spec.trainer.synthetic.shape[1]: -1 is less than the minimum of 1"),
    ({"dataPath": ""}, "spec.trainer.dataPath: ''"),   # minLength (the wording is jsonschema's version's)
    ({"mlflow": {"experiment": "x"}}, "spec.trainer.mlflow.trackingUri: required"),
    ({"dataset": "imagefolder"}, "spec.trainer.dataPath: required"),
    ({"dataset": "digits", "model": "resnet18"}, "spec.trainer.model: resnet18 needs 3-channel"),
])
def test_bad_config_names_the_key(raw, needle):
    with pytest.raises(ConfigError, match=None) as info:
        parse_config(raw)
    assert needle in str(info.value)


def test_nulls_are_unset_as_the_api_server_prunes_them():
    assert parse_config({"epochs": None, "mlflow": None, "checkpoint": {"dir": None}}) == parse_config({})


def test_env_config_must_be_json():
    with pytest.raises(ConfigError, match="DDPJOB_TRAINER_CONFIG: not valid JSON"):
        config_from_env({"DDPJOB_TRAINER_CONFIG": "{epochs: 3"})


def test_only_rank_0_tracks_and_mlflow_required_parses():
    from ddpjob_trainer.config import MlflowConfig
    from ddpjob_trainer.reporting import make_reporter

    # Other ranks never touch MLflow at all (seed 000: log from rank 0 only). A missing client is the
    # launcher's pre-flight's to report (exit 78, tests/trainer/test_preflight.py).
    assert type(make_reporter(rank=1, mlflow=MlflowConfig(tracking_uri="http://x"))).__name__ == "NullReporter"
    cfg = parse_config({"mlflow": {"trackingUri": "http://x", "required": True}})
    assert cfg.mlflow == MlflowConfig(tracking_uri="http://x", experiment="ddpjob", required=True)
    assert parse_config({"mlflow": {"trackingUri": "http://x"}}).mlflow.required is False
    with pytest.raises(ConfigError, match="spec.trainer.mlflow.required: 'yes' is not of type 'boolean'"):
        parse_config({"mlflow": {"trackingUri": "http://x", "required": "yes"}})


def test_mlflow_without_a_uri_takes_the_pods_mlflow_tracking_uri():
    # The operator's cluster-wide default reaches the trainer as MLFLOW_TRACKING_URI (envvars.mlflow_env).
    env = {"DDPJOB_TRAINER_CONFIG": '{"mlflow": {}}', "MLFLOW_TRACKING_URI": "http://platform:5000"}
    assert config_from_env(env).mlflow.tracking_uri == "http://platform:5000"
    mine = {**env, "DDPJOB_TRAINER_CONFIG": '{"mlflow": {"trackingUri": "http://team"}}'}
    assert config_from_env(mine).mlflow.tracking_uri == "http://team"
    with pytest.raises(ConfigError, match="trackingUri: required when mlflow is set and the operator has no default"):
        config_from_env({"DDPJOB_TRAINER_CONFIG": '{"mlflow": {}}'})


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
    ({"numWorkers": "many"}, 'spec.trainer.numWorkers must be "auto" or an integer >= 0'),
    ({"numWorkers": -1}, 'spec.trainer.numWorkers must be "auto" or an integer >= 0'),
    ({"channelsLast": "auto"}, "spec.trainer.channelsLast: 'auto' is not of type 'boolean'"),
    ({"ddp": {"bufferSync": "mean"}}, "spec.trainer.ddp.bufferSync: 'mean' is not one of ['average', 'broadcast']"),
    ({"ddp": {"bucketCapMb": 0}}, "spec.trainer.ddp.bucketCapMb: 0 is less than the minimum of 1"),
    ({"ddp": {"broadcastBuffers": True}}, "spec.trainer.ddp.broadcastBuffers: unknown key"),
])
def test_bad_gpu_and_data_loading_keys_name_the_key(raw, needle):
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert needle in str(info.value)




# The CRD is the one home of spec.trainer's schema (crdschema.py). What the trainer needs from it:
# each key is a field of the config dataclasses (which hold the defaults), and each field a key.
def _sections(schema: dict, cls: type, where: str = "spec.trainer"):
    """(where, schema, dataclass) of spec.trainer and of each nested object in it."""
    yield where, schema, cls
    hints = typing.get_type_hints(cls)
    for key, sub in schema["properties"].items():
        kinds = typing.get_args(hints.get(config._snake(key))) or (hints.get(config._snake(key)),)
        yield from (x for k in kinds if dataclasses.is_dataclass(k) for x in _sections(sub, k, f"{where}.{key}"))


def test_every_crd_key_is_a_config_field_and_every_field_a_key():
    for where, schema, cls in _sections(crdschema.trainer_schema(), TrainerConfig):
        keys, fields = {config._snake(k) for k in schema["properties"]}, {f.name for f in dataclasses.fields(cls)}
        assert keys == fields, (where, keys ^ fields)


def test_a_default_the_crd_states_is_the_dataclass_default():
    for where, schema, cls in _sections(crdschema.trainer_schema(), TrainerConfig):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for key, sub in schema["properties"].items():
            stated = re.search(r"\b[Dd]efault:? ([\w.]+?)\.?(?=[\s)]|$)", sub.get("description", ""))
            if stated:
                assert yaml.safe_load(stated.group(1)) == defaults[config._snake(key)], f"{where}.{key}"


def test_the_buffer_sync_modes_implemented_are_the_crds():
    from ddpjob_trainer.collectives import BUFFER_SYNCS

    assert list(BUFFER_SYNCS) == crdschema.trainer_schema()["properties"]["ddp"]["properties"]["bufferSync"]["enum"]


def test_a_rule_enum_or_key_added_to_the_crd_is_enforced_with_no_python_change(tmp_path, monkeypatch):
    crd = yaml.load(crdschema.CRD_FILE.read_text(), Loader=yaml.CSafeLoader)
    (version,) = (v for v in crd["spec"]["versions"] if v.get("storage"))
    trainer = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["trainer"]
    trainer["properties"]["optimizer"]["enum"] = ["sgd"]
    trainer["properties"]["ddp"]["properties"]["bucketCapMb"]["maximum"] = 100
    trainer["properties"]["tensorParallel"] = {"type": "integer", "minimum": 1}
    trainer["x-kubernetes-validations"] = [{"rule": "!has(self.maxSteps) || self.maxSteps <= 1000",
                                           "message": "spec.trainer.maxSteps must be at most 1000"}]
    edited = tmp_path / "ddpjobs.ddpjob.dev.yaml"
    edited.write_text(yaml.dump(crd, Dumper=yaml.CSafeDumper))
    assert parse_config({"optimizer": "adamw", "maxSteps": 5000}).max_steps == 5000   # the shipped CRD allows them
    monkeypatch.setattr(crdschema, "CRD_FILE", edited)
    for raw, needle in [
        ({"optimizer": "adamw"}, "spec.trainer.optimizer: 'adamw' is not one of ['sgd']"),
        ({"ddp": {"bucketCapMb": 200}}, "spec.trainer.ddp.bucketCapMb: 200 is greater than the maximum of 100"),
        ({"tensorParallel": 0}, "spec.trainer.tensorParallel: 0 is less than the minimum of 1"),
        ({"maxSteps": 5000}, "spec.trainer.maxSteps must be at most 1000"),
    ]:
        with pytest.raises(ConfigError) as info:
            parse_config(raw)
        assert needle in str(info.value)
    assert parse_config({"maxSteps": 1000}).max_steps == 1000
