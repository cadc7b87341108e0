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


def test_only_rank_0_tracks_and_mlflow_required_parses():
    from ddpjob_trainer.config import MlflowConfig
    from ddpjob_trainer.reporting import make_reporter

    # Other ranks never touch MLflow at all (seed 000: log from rank 0 only). A missing client is the
    # launcher's pre-flight's to report (exit 78, tests/trainer/test_preflight.py).
    assert type(make_reporter(rank=1, mlflow=MlflowConfig(tracking_uri="http://x"))).__name__ == "NullReporter"
    cfg = parse_config({"mlflow": {"trackingUri": "http://x", "required": True}})
    assert cfg.mlflow == MlflowConfig(tracking_uri="http://x", experiment="ddpjob", required=True)
    assert parse_config({"mlflow": {"trackingUri": "http://x"}}).mlflow.required is False
    with pytest.raises(ConfigError, match="spec.trainer.mlflow.required: expected true or false"):
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


# The trainer's key tables (config.py) and the CRD's spec.trainer schema are two spellings of one
# set of keys: the API server validates with one, the trainer with the other. A key, type, bound or
# enum value changed on one side only fails here (a key the CRD lacks would be pruned or refused
# by the API server; one the trainer lacks would make every pod exit 78).
def _trainer_schema() -> dict:
    from ddpjob_operator.api.crd import version_schema

    return version_schema()["properties"]["spec"]["properties"]["trainer"]


def _sections():
    from ddpjob_trainer import config as c

    schema = _trainer_schema()
    yield "spec.trainer", c._TOP, schema
    for name, table in (("checkpoint", c._CHECKPOINT), ("synthetic", c._SYNTHETIC), ("ddp", c._DDP),
                        ("mlflow", c._MLFLOW)):
        yield f"spec.trainer.{name}", table, schema["properties"][name]


def _disagreements(path: str, key: str, kind: str, arg, prop: dict) -> list[str]:
    want = {"int": "integer", "float": "number", "bool": "boolean", "enum": "string", "str": "string",
            "shape": "array"}
    where = f"{path}.{key}"
    if kind == "int_or_auto":
        return [] if prop.get("x-kubernetes-int-or-string") else [f"{where}: CRD is not int-or-string"]
    out = []
    if prop.get("type") != want[kind]:
        out.append(f"{where}: CRD type {prop.get('type')}, trainer {kind}")
    if kind in ("int", "float") and prop.get("minimum") != arg:
        out.append(f"{where}: CRD minimum {prop.get('minimum')}, trainer {arg}")
    if kind == "enum" and list(prop.get("enum") or []) != list(arg):
        out.append(f"{where}: CRD enum {prop.get('enum')}, trainer {list(arg)}")
    if kind == "shape" and (prop.get("items") or {}).get("type") != "integer":
        out.append(f"{where}: CRD items are not integers")
    return out


@pytest.mark.parametrize("path, table, schema", list(_sections()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_crd_and_the_trainer_know_the_same_keys_with_the_same_types(path, table, schema):
    props = schema["properties"]
    nested = {"checkpoint", "synthetic", "ddp", "mlflow"} if path == "spec.trainer" else set()
    assert set(props) - nested == set(table), (set(props) - nested ^ set(table))
    problems = [p for key, (_, kind, arg) in table.items() for p in _disagreements(path, key, kind, arg, props[key])]
    assert not problems, problems
