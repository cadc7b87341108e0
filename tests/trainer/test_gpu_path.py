"""The GPU path fails fast and loudly, in real torchrun processes on this GPU-less machine: what a
pod without the GPUs its job asked for does, a checkpoint dir that the nodes do not share."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.localrun import free_ports

from .helpers import REPO, run_local, write_job

pytestmark = pytest.mark.timeout(600)


def test_a_gpu_job_on_a_pod_without_cuda_exits_78_before_any_rank_falls_back_to_gloo(tmp_path):
    # What is faked is only the count the job expects: gpusPerNode 2, on a machine with none.
    job = write_job(tmp_path / "gpu.yaml", name="gpu", nodes=1, nproc=2, gpusPerNode=2, max_restarts=2,
                    trainer={"dataset": "digits", "model": "convnet", "epochs": 1, "maxSteps": 2})
    proc, s = run_local(job, tmp_path, timeout=240)
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert s["phase"] == "Failed" and s["restarts"] == 0 and s["exit_code"] == 78
    log = (tmp_path / "work" / "logs" / "attempt-0" / "node-0.log").read_text()
    assert "spec.gpusPerNode is 2, so each of this pod's 2 local ranks needs a GPU, but it sees no CUDA" in log, log


def _two_nodes(tmp: Path, *, checkpoint_dirs: list[Path]) -> list[tuple[int, str]]:
    """A 2-node job as `ddpjob run --local` starts it (the operator's env, the launcher, torchrun),
    except that each node gets its own checkpoint.dir: two nodes whose volume at that path is not
    the same one. Each node's exit code and log."""
    from ddpjob_cli import local

    trainer = {"dataset": "digits", "model": "convnet", "epochs": 1, "batchSize": 64, "maxSteps": 2}
    job = local.validate(local.load_job_file(write_job(tmp / "ck.yaml", name="ck", trainer=trainer)))
    master, *metrics = free_ports(3)
    nodes = []
    for rank, ck in enumerate(checkpoint_dirs):
        env = local.node_env(job, rank, master_port=master, metrics_port=metrics[rank], attempt=0,
                             workdir=tmp / "work", result_file=tmp / "result.json")
        env.update({"DDPJOB_TRAINER_CONFIG": json.dumps({**trainer, "checkpoint": {"dir": str(ck)}}),
                    "DDPJOB_TELEMETRY": "0", "OMP_NUM_THREADS": "1"})
        log = tmp / f"node-{rank}.log"
        with open(log, "wb") as out:
            nodes.append((subprocess.Popen(local.node_command(job, metrics_port=metrics[rank]), env=env, cwd=REPO,
                                           stdout=out, stderr=subprocess.STDOUT, start_new_session=True), log))
    return [(proc.wait(), log.read_text()) for proc, log in nodes]


def test_a_checkpoint_dir_not_shared_by_the_nodes_exits_78_at_start_naming_it(tmp_path):
    own = [tmp_path / "node-0-volume", tmp_path / "node-1-volume"]
    (code0, log0), (code1, log1) = _two_nodes(tmp_path, checkpoint_dirs=own)
    assert (code0, code1) == (78, 78), log0[-3000:] + log1[-3000:]
    for ck, log in zip(own, (log0, log1)):  # every rank fails alike, naming its node's path
        assert f"spec.trainer.checkpoint.dir {ck} is not shared by all nodes: rank 1 (host" in log, log[-3000:]
        assert "training convnet on digits" not in log  # refused at start, not at the first save
    # Rank 0 wrote the nonce file on its node's volume and removed it (c10d decides which node
    # holds rank 0, so which volume exists at all is not fixed).
    made = [ck for ck in own if ck.exists()]
    assert made and all(list(ck.iterdir()) == [] for ck in made), made


def test_a_shared_checkpoint_dir_passes_the_check_and_is_checkpointed_into(tmp_path):
    shared = tmp_path / "rwx-volume"
    (code0, log0), (code1, log1) = _two_nodes(tmp_path, checkpoint_dirs=[shared, shared])
    assert (code0, code1) == (0, 0), log0[-3000:] + log1[-3000:]
    assert [p.name for p in shared.iterdir()] == ["step-00000002"]


@pytest.mark.timeout(300)  # blocked, the teardown would wait for timeoutSeconds: 3600
def test_a_failed_ranks_reason_is_recorded_and_it_exits_though_its_peer_is_mid_collective(
        termination_log, monkeypatch):
    from ddpjob_trainer.launch.node import main

    from .failing_rank import REASON

    monkeypatch.setenv("DDPJOB_TRAINER_CONFIG", json.dumps({"dataset": "digits", "timeoutSeconds": 3600}))
    monkeypatch.setenv("DDPJOB_TELEMETRY", "0")
    monkeypatch.setenv("NODE_RANK", "0")
    harness = Path(__file__).with_name("failing_rank.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(harness)]
    # Returns once every process has exited: the test's timeout is the bound on "promptly".
    assert main(["--", *cmd]) == 1
    text = termination_log.read_text()
    # Rank 1's own error, not its peer's ("connection closed"), which came after it.
    assert text.startswith("training exited with code 1\nrank 1 failed:\nTraceback"), text
    assert text.endswith(f"FileNotFoundError: {REASON}"), text
