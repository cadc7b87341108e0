"""`ddpjob run --local` runs what the job's pods run: the command comes from pods.container_command."""
from __future__ import annotations

import sys

import pytest

from ddpjob_cli.local import node_command
from tests.support.builders import make_job

LOCAL_LAUNCHER = [sys.executable, "-m", "ddpjob_trainer.launch", "--metrics-port", "19400", "--"]


@pytest.mark.parametrize("spec, want", [
    ({}, LOCAL_LAUNCHER),
    ({"trainer": {"epochs": 1}}, LOCAL_LAUNCHER),
    # no launcher: torchrun itself, as in the pod (it reads PET_* from the env)
    ({"launcher": False}, ["torchrun", "-m", "ddpjob_trainer"]),
    ({"command": ["torchrun", "train.py"], "args": ["--epochs", "3"]},
     LOCAL_LAUNCHER + ["torchrun", "train.py", "--epochs", "3"]),
    ({"command": ["torchrun", "train.py"], "launcher": False}, ["torchrun", "train.py"]),
    # spec.args of a built-in job reach the launcher after `--`, exactly as in the pod
    ({"args": ["torchrun", "-m", "ddpjob_trainer"]}, LOCAL_LAUNCHER + ["torchrun", "-m", "ddpjob_trainer"]),
])
def test_a_local_node_runs_the_pods_command(spec, want):
    from ddpjob_operator.builders.pods import LAUNCHER, container_command

    assert node_command(make_job(**spec), metrics_port=19400) == want
    command, args = container_command(make_job(**spec))
    pod = command + list(args or [])
    if pod[:len(LAUNCHER)] == LAUNCHER:  # the pod's `python` is the image's; locally it is this one
        pod = LOCAL_LAUNCHER + pod[len(LAUNCHER):]
    assert pod == want


def test_a_local_per_step_node_is_its_own_world_on_loopback_at_the_local_lighthouse(tmp_path):
    from ddpjob_cli.local import node_env
    job = make_job("ft", nodes=2, faultTolerance={"mode": "perStep", "minReplicas": 1})
    env = node_env(job, 1, master_port=40001, metrics_port=19401, attempt=0, workdir=tmp_path,
                   result_file=tmp_path / "r.json", lighthouse="http://127.0.0.1:40100")
    assert env["DDPJOB_FT_HOST"] == env["MASTER_ADDR"] == "127.0.0.1" and env["DDPJOB_FT_LIGHTHOUSE"] == "http://127.0.0.1:40100"
    assert env["PET_NNODES"] == "1" and env["PET_RDZV_ENDPOINT"] == "127.0.0.1:40001" and env["PET_RDZV_CONF"] == "is_host=true"
    assert env["NODE_RANK"] == "1" and env["NNODES"] == "2"
    plain = node_env(make_job("ft", nodes=2), 1, master_port=40001, metrics_port=19401, attempt=0, workdir=tmp_path,
                     result_file=tmp_path / "r.json")
    assert not [k for k in plain if k.startswith("DDPJOB_FT_")] and plain["PET_NNODES"] == "2"
