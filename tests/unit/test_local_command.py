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


def test_a_replacement_that_fails_past_the_budget_ends_the_attempt_naming_its_own_log(tmp_path, monkeypatch):
    """A per-step job's node 1 fails, is replaced alone (maxRestarts 1), and its replacement fails too:
    the attempt ends, and the log it names for the failure is the replacement's, not the first
    node 1's (which ended with its SIGKILL, not with this failure)."""
    import time
    import types

    from ddpjob_cli import local
    from ddpjob_trainer.launch import StopSignals

    job = make_job("ft", nodes=2, faultTolerance={"mode": "perStep"}, failurePolicy={"maxRestarts": 1})
    # Node 0 trains on (until stopped); every node 1 fails at once, saying which log it wrote to.
    script = "import os, sys, time\nif os.environ['NODE_RANK'] == '1': sys.exit(3)\ntime.sleep(60)"
    monkeypatch.setattr(local, "node_command", lambda job, metrics_port: [sys.executable, "-c", script])
    lighthouse = types.SimpleNamespace(url="http://127.0.0.1:1", keep_up=lambda say: None)
    display = local.Display(enabled=False, job=job)
    out = local.run_attempt(job, attempt=0, workdir=tmp_path, cwd=tmp_path, metrics_ports=[1, 2], display=display,
                            signals=StopSignals(), grace=1.0,
                            books=local.Books(job, say=display.say, created=time.time()), lighthouse=lighthouse)
    assert (out.ok, out.failed_rank, out.exit_code, out.replaced) == (False, 1, 3, 1), out
    assert out.failed_log == tmp_path / "logs" / "attempt-0" / "node-1-replacement-1.log" and out.failed_log.exists()
