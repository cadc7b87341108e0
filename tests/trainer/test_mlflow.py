"""MLflow for real (issue 29): the built-in trainer under `ddpjob run --local` (real torchrun, gloo on
CPU) against a real `mlflow server` (tests/support/mlflow_server.py, one per session).

One run per job across a group restart; training keeps stepping while the server is frozen and
when it refuses connections; the run ends FINISHED, FAILED or KILLED as the job does; a user's own
script logs into the job's run with plain `mlflow` calls (MLFLOW_RUN_ID from its node's launcher).
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import os
import signal
import subprocess
import time
import types
import uuid

import pytest

from ddpjob_api import contract
from ddpjob_trainer.debug import RELEASED_LINE
from tests.support.localrun import free_ports, local_run, wait_ranks

from .helpers import DDPJOB, REPO, run_local, run_trainer, write_job

# func_only: the session's MLflow server starts in the first test's setup (its own wait bounds it,
# START_SECONDS), which on a loaded machine took 132 s once and left that test too little of 300.
pytestmark = pytest.mark.timeout(300, func_only=True)

# The smallest job that still steps, checkpoints and logs often.
TRAINER = {"dataset": "digits", "model": "mlp", "epochs": 1, "batchSize": 32, "lr": 0.05, "logEverySteps": 2}


def experiment(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def mlflow(server_uri: str, exp: str, **more) -> dict:
    return {"mlflow": {"trackingUri": server_uri, "experiment": exp, **more}}


def test_one_run_across_a_killed_ranks_restart_with_the_loss_to_the_last_step(tmp_path, mlflow_server):
    exp = experiment("restart")
    job = write_job(tmp_path / "mlf-restart.yaml", name="mlf-restart", max_restarts=1, trainer={
        **TRAINER, "maxSteps": 16, "checkpoint": {"dir": "ckpt", "everySteps": 4, "keep": 1, "asyncSave": False},
        **mlflow(mlflow_server.uri, exp, runName="restart", registerModel=exp, systemMetrics=True)})
    # Rank 1 dies at step 10 of attempt 0; its workers restart in place and resume from step 8.
    # It first holds after step 9 until the run has step 8's loss: rank 0's steps before the crash
    # are then in the run as an event, not as a race of a loaded server against the crash (the
    # killed rank 0 has tracking.KILLED_SECONDS for what is still queued; CI lost steps 2-8 once).
    release = tmp_path / "release-rank-1"
    env = {"DDPJOB_DEBUG_CRASH_RANK": "1:10", "DDPJOB_DEBUG_HOLD_RANK": f"1:9:{release}",
           "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_local, job, tmp_path, env=env)
        ended = types.SimpleNamespace(poll=lambda: 0 if running.done() else None)
        try:
            mlflow_server.wait_run(exp, lambda r: 8 in {m.step for m in mlflow_server.metric_history(
                r.info.run_id, "train_loss")}, "step 8's loss in the run before rank 1's crash", proc=ended)
        finally:
            release.touch()  # a failed wait too: the run then ends, not at run_local's timeout
        proc, s = running.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    node_1 = (tmp_path / "work" / "logs" / "attempt-0" / "node-1.log").read_text()
    assert RELEASED_LINE.format(rank=1, step=9) in node_1, node_1[-3000:]
    assert (s["restarts"], s["resumed_from_step"], s["steps"]) == (0, 8, 16), s

    (run,) = mlflow_server.runs(exp)
    assert s["mlflow_run_id"] == run.info.run_id and f"MLflow run {run.info.run_id}" in proc.stderr
    assert run.info.status == "FINISHED" and run.info.run_name == "restart"
    tags = run.data.tags
    assert (tags["ddpjob.name"], tags["ddpjob.attempt"], tags["ddpjob.nodes_x_procs"]) == ("mlf-restart", "0", "2x1")
    assert tags["ddpjob.uid"].startswith("local-") and tags["torch.version"] and tags["ddpjob.image"] == "trainer:test"
    # The whole resolved config, nested sections flattened, logged once (a resume changes no param).
    params = run.data.params
    assert (params["world_size"], params["checkpoint.every_steps"], params["mlflow.experiment"]) == ("2", "4", exp)
    assert params["synthetic.shape"] == "3,32,32" and params["max_steps"] == "16"

    loss = mlflow_server.metric_history(run.info.run_id, "train_loss")
    steps = {m.step for m in loss}
    assert set(range(2, 17, 2)) <= steps and max(steps) == 16, sorted(steps)
    restarts = [(m.step, m.value) for m in mlflow_server.metric_history(run.info.run_id, "restarts")]
    assert restarts == [(0, 0.0), (8, 1.0)], restarts
    for key in ("lr", "samples_per_second", "step_seconds", "data_wait_seconds", "eval_loss", "eval_accuracy",
                "checkpoint_seconds"):
        assert key in run.data.metrics, (key, sorted(run.data.metrics))
    assert 16 in {m.step for m in mlflow_server.metric_history(run.info.run_id, "eval_accuracy")}
    # Where rank 0's time went, logged at the end from its pod's counters (its restarted worker's
    # included): its start, its recovery from rank 1's crash, its steps, checkpoints and evaluation.
    spent = {k: v for k, v in run.data.metrics.items() if k.startswith("goodput")}
    for key in ("starting", "recovering", "training", "checkpointing", "evaluating"):
        assert spent[f"goodput_{key}_seconds"] > 0, spent
    assert spent["goodput"] == round(spent["goodput_training_seconds"] / sum(
        v for k, v in spent.items() if k.endswith("_seconds")), 4), spent
    assert {m.step for m in mlflow_server.metric_history(run.info.run_id, "goodput")} == {16}
    # ... and the runner's ledger of the whole job: the restart in place counted and recovering.
    assert s["in_place_restarts"] == 1 and s["goodput"]["seconds"]["recovering"] > 0, s
    # systemMetrics: each node's (not each rank's) CPU and memory, from its launcher's side process.
    for node in (0, 1):
        for key in ("cpu_utilization_percentage", "system_memory_usage_megabytes"):
            assert f"system/node_{node}/{key}" in run.data.metrics, sorted(run.data.metrics)
    assert not [k for k in run.data.metrics if k.startswith("system/") and not k.startswith(("system/node_0/",
                                                                                          "system/node_1/"))]
    # At the end rank 0 logged the job's record (the job, its resolved config, its last checkpoint,
    # which is also a tag) and the trained model, in torch's format, registered as asked: it loads
    # through the registry and runs.
    import torch
    from mlflow import artifacts, pytorch as mlflow_pytorch, set_tracking_uri

    set_tracking_uri(mlflow_server.uri)
    record = artifacts.load_dict(f"runs:/{run.info.run_id}/ddpjob/job.json")
    assert record["checkpoint"] == s["last_checkpoint"] == tags["ddpjob.checkpoint"] and s["last_checkpoint"]
    assert record["job"]["name"] == "mlf-restart" and record["job"]["attempt"] == 0  # restarted in place
    assert record["trainer"]["checkpoint"]["every_steps"] == 4 and record["trainer"]["world_size"] == 2
    (version,) = mlflow_server.client().search_model_versions(f"name = '{exp}'")
    assert version.run_id == run.info.run_id
    model = mlflow_pytorch.load_model(f"models:/{exp}/{version.version}")
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


# Each step sleeps this long after it (a floor for its time): the rates before the freeze and during
# it are then mostly the trainer's own, not the loaded machine's.
FROZEN_STEP_SLEEP = 0.2
# Training steps at least this fast while the server is frozen, as a share of the rate before.
MIN_FROZEN_RATE = 0.5


def step_rate(run, *, steps: int, floor: float | None = None) -> tuple[float, int, int]:
    """Rank 0's steps per second over its next `steps` steps, on its own step timestamps (the
    rank's clock is this machine's): (rate, first step, last step). With `floor` (steps/s) the
    wait ends as soon as the window can no longer reach it, the rate then being what it came to
    by that moment (under `floor`): a step that waits for the server fails the check then, not at
    a timeout."""
    start = wait_ranks(run, lambda s: 0 in s and s[0].last_step_timestamp, "a step")[0]
    t0, target = start.last_step_timestamp, start.step + steps
    give_up = t0 + steps / floor if floor else None

    def done(samples):
        return 0 in samples and (samples[0].step >= target or (give_up is not None and time.time() >= give_up))
    end = wait_ranks(run, done, f"{steps} steps from step {start.step}",
                     timeout=(give_up - time.time() + 60) if give_up else 240)[0]
    if end.step >= target:
        return (end.step - start.step) / (end.last_step_timestamp - t0), start.step, end.step
    return (end.step - start.step) / (time.time() - t0), start.step, end.step


def test_training_keeps_stepping_while_the_server_is_frozen_and_the_run_finishes(tmp_path, mlflow_server):
    """Rank 0's steps per second while the tracking server is frozen, against its rate just before,
    in the same run: at least MIN_FROZEN_RATE of it. The frozen window lasts longer than the
    tracker's flush interval (tracking.FLUSH_SECONDS) at the rate before, so a send to the server
    certainly falls in it; then every queued metric still reaches the run, which ends FINISHED."""
    from ddpjob_trainer.tracking import FLUSH_SECONDS

    exp = experiment("frozen")
    # One node, one rank: what is tested is rank 0's tracker (a second node would only add a start).
    spec = write_job(tmp_path / "mlf-frozen.yaml", name="mlf-frozen", nodes=1, trainer={
        **TRAINER, "epochs": 3, "batchSize": 64, **mlflow(mlflow_server.uri, exp)})  # 69 steps
    with local_run(spec, tmp_path, DDPJOB_DEBUG_STEP_SLEEP=str(FROZEN_STEP_SLEEP)) as run:
        # The run is open (rank 0 exports its id): its metrics go to the server from here on.
        wait_ranks(run, lambda s: 0 in s and s[0].mlflow_run_id, "the MLflow run open")
        before, *_ = step_rate(run, steps=8)
        window = math.ceil((FLUSH_SECONDS + 1) * before)
        with mlflow_server.freeze():
            # Each send now waits for a server that never answers (until it times out on the
            # tracking thread); the steps must not.
            frozen, first, last = step_rate(run, steps=window, floor=MIN_FROZEN_RATE * before)
        print(f"rank 0 with the MLflow server frozen: {frozen:.2f} steps/s (steps {first}-{last}) against "
              f"{before:.2f} just before: {frozen / before:.2f}x (at least {MIN_FROZEN_RATE} asserted)")
        assert frozen >= MIN_FROZEN_RATE * before, (
            f"training slowed to {frozen / before:.2f}x its rate while the MLflow server was frozen "
            f"({frozen:.2f} steps/s over steps {first}-{last}, {before:.2f} just before): a step waits "
            "for the tracking server")
        assert run.proc.wait(timeout=240) == 0, run.log.read_text()[-3000:]
    done = mlflow_server.wait_run(exp, lambda r: r.info.status == "FINISHED", "the run FINISHED", timeout=60)
    assert max(m.step for m in mlflow_server.metric_history(done.info.run_id, "train_loss")) == 69


def test_a_server_refusing_connections_is_a_warning_and_training_succeeds(tmp_path):
    # One trainer process (no torchrun): what is tested is rank 0's tracker, and it costs less.
    nobody = free_ports(1)[0]  # nothing listens there: every connection is refused
    result = tmp_path / "result.json"
    proc = run_trainer({**TRAINER, "maxSteps": 6, **mlflow(f"http://127.0.0.1:{nobody}", "refused")}, result=result)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["steps"] == 6 and r["mlflow_run_id"] is None
    assert f"WARNING MLflow: no run at http://127.0.0.1:{nobody}" in proc.stderr, proc.stderr[-3000:]
    assert "Connection refused" in proc.stderr


def test_a_failed_job_ends_its_run_failed(tmp_path, mlflow_server):
    exp = experiment("failed")
    proc = run_trainer({**TRAINER, "dataset": "imagefolder", "dataPath": str(tmp_path / "no-such-data"),
                        **mlflow(mlflow_server.uri, exp)}, env={"DDPJOB_NAME": "mlf-failed"})
    assert proc.returncode == 78 and "no-such-data" in proc.stderr, proc.stderr[-3000:]
    (run,) = mlflow_server.runs(exp)
    assert run.info.status == "FAILED" and run.data.tags["ddpjob.name"] == "mlf-failed"


def stopped_local_run(job, workdir, mlflow_server, exp: str, ready, desc: str, *, timeout: float,
                      env: dict | None = None) -> str:
    """`ddpjob run --local` until its run shows `ready`, then SIGTERM: its output (exit code 143)."""
    proc = subprocess.Popen([*DDPJOB, "run", str(job), "--local", "--no-progress", "--workdir", str(workdir)],
                            cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        mlflow_server.wait_run(exp, ready, desc, proc=proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 143, out[-3000:]
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_ends_the_run_killed(tmp_path, mlflow_server):
    exp = experiment("killed")
    job = write_job(tmp_path / "mlf-killed.yaml", name="mlf-killed", nodes=1, trainer={
        **TRAINER, "epochs": 50, **mlflow(mlflow_server.uri, exp)})
    out = stopped_local_run(job, tmp_path / "w", mlflow_server, exp, lambda r: "train_loss" in r.data.metrics,
                            "the first loss in MLflow", timeout=60)
    run = mlflow_server.wait_run(exp, lambda r: r.info.status != "RUNNING", "the run's end", timeout=30)
    assert run.info.status == "KILLED", out[-3000:]


# A user's script that logs, then works until it is stopped, and never ends its run.
FOREVER = """
import time, mlflow
mlflow.log_metric("started", 1.0)
time.sleep(3600)
"""


def test_sigterm_ends_a_users_scripts_run_killed(tmp_path, mlflow_server):
    exp = experiment("script-killed")
    (tmp_path / "forever.py").write_text(FOREVER)
    job = write_job(tmp_path / "mlf-skilled.yaml", name="mlf-skilled", nodes=1, command=["python", "forever.py"],
                    trainer=mlflow(mlflow_server.uri, exp))
    # The run's end starts a process that imports MLflow (4-5 s on this machine idle): within a pod's
    # 25 s (the default 30 s less the launcher's margin), it did not end the run under make test's
    # load once (CI of a388e5e).
    # The grace only bounds the stop: the launcher exits once the run has ended, however long it is.
    stopped_local_run(job, tmp_path / "w", mlflow_server, exp, lambda r: "started" in r.data.metrics,
                      "the script's first metric", timeout=360, env={"DDPJOB_STOP_GRACE_SECONDS": "300"})
    (run,) = mlflow_server.runs(exp)   # ended before the launcher exited: no wait
    node_log = (tmp_path / "w" / "logs" / "attempt-0" / "node-0.log").read_text()
    assert run.info.status == "KILLED", node_log[-3000:]
    assert f"MLflow run {run.info.run_id} ended KILLED" in node_log, node_log[-3000:]


# A user's script, unchanged MLflow usage: the fluent API picks the run up from MLFLOW_RUN_ID.
SCRIPT = """
import os, mlflow
node, given = os.environ["NODE_RANK"], os.environ["MLFLOW_RUN_ID"]  # mlflow's start_run unsets it
mlflow.log_metric(f"node{node}_seen", 1.0, step=int(node))
mlflow.set_tag(f"node{node}.run_id", given)
"""


def test_a_users_script_logs_into_the_jobs_run_through_the_env(tmp_path, mlflow_server):
    exp = experiment("script")
    (tmp_path / "log_to_mlflow.py").write_text(SCRIPT)
    # torchrun: its c10d rendezvous finds node 0's store on loopback.
    job = write_job(tmp_path / "mlf-script.yaml", name="mlf-script", command=["torchrun", "log_to_mlflow.py"],
                    trainer=mlflow(mlflow_server.uri, exp, runName="script"))
    proc, s = run_local(job, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The user's torchrun ran as ddpjob_trainer.agent: each node's agent marked its workers' start,
    # so a restart in place of a user's script is counted and attributed like the trainer's.
    for node in (0, 1):
        log = (tmp_path / "work" / "logs" / "attempt-0" / f"node-{node}.log").read_text()
        assert log.count(contract.inplace_marker(0, 0)) == 1, log[-3000:]
    (run,) = mlflow_server.runs(exp)
    # Node 0's launcher made the run (tagged with the job), node 1's found it: both nodes logged there.
    assert run.info.run_name == "script" and run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["node0.run_id"] == tags["node1.run_id"] == run.info.run_id and tags["ddpjob.name"] == "mlf-script"
    assert {"node0_seen", "node1_seen"} <= set(run.data.metrics)
    # The local runner's summary and final line name it.
    assert s["mlflow_run_id"] == run.info.run_id and f"MLflow run {run.info.run_id}" in proc.stderr.splitlines()[-1]


def test_a_launcher_without_a_run_fails_the_attempt_only_when_mlflow_is_required(monkeypatch):
    # The real child process against a server refusing connections (the decisions without one:
    # tests/unit/test_trainer_launch.py).
    from ddpjob_trainer.launch import runs
    from ddpjob_trainer.launch.signals import StopSignals

    nobody = free_ports(1)[0]  # nothing listens there: refused at once
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://user:pw@127.0.0.1:{nobody}", "DDPJOB_UID": "u-1",
           "DDPJOB_MLFLOW": "required"}
    monkeypatch.setattr(runs, "MLFLOW_RETRY_SECONDS", 0)   # refused is refused: no second try
    run_id, failed = runs.mlflow_run(env, node_rank=0, children=[], signals=StopSignals(),
                                     on_run=lambda *ids: None)
    assert run_id is None and failed.startswith(f"spec.trainer.mlflow.required: no MLflow run at http://127.0.0.1:{nobody}: ")
    assert "Connection refused" in failed and "pw" not in failed
