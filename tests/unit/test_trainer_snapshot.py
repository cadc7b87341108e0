"""In-memory snapshots (checkpointing/snapshot.py): one rank's files, what is kept, what the ranks
agree to resume from, and a write that fails leaving training alone."""
from __future__ import annotations

import pytest
import torch

from ddpjob_api.contract import snapshot_root
from ddpjob_trainer.checkpointing import checkpoint
from ddpjob_trainer.checkpointing.snapshot import KEEP, Cost, Snapshots, agreed_step, read_cost


@pytest.mark.parametrize("candidates, holders, want", [
    ([10, 20], [2.0, 2.0], 20),
    ([10, 20], [2.0, 1.0], 10),    # rank 1 died writing step 20: the newest step every rank has
    ([20], [1.0], None),
    ([], [], None),
])
def test_the_ranks_resume_from_the_newest_step_they_all_have(candidates, holders, want):
    assert agreed_step(candidates, holders, world_size=2) == want


def test_a_rank_keeps_its_newest_snapshots_and_reads_them_back_exactly(tmp_path):
    snaps = Snapshots(tmp_path, rank=1, warn=pytest.fail)
    other = Snapshots(tmp_path, rank=0, warn=pytest.fail)
    other.save(5, {"w": torch.zeros(2)})
    for step in (5, 10, 15):
        snaps.save(step, {"w": torch.full((3,), float(step)), "step": step})
    snaps.wait()
    other.wait()
    assert snaps.steps() == [15 - 5 * i for i in reversed(range(KEEP))] and other.steps() == [5]
    assert torch.equal(snaps.load(15)["w"], torch.full((3,), 15.0)) and snaps.load(15)["step"] == 15
    snaps.clear()
    assert snaps.steps() == [] and other.steps() == [5]


def test_a_failed_write_is_a_warning_and_ends_snapshots_not_training(tmp_path):
    blocker = tmp_path / "shm"
    blocker.write_text("a file where the directory should be")
    said = []
    snaps = Snapshots(blocker / "job", rank=0, warn=said.append)
    snaps.save(1, {"w": torch.zeros(1)})
    snaps.wait()
    assert len(said) == 1 and "no more snapshots" in said[0]
    assert snaps.failed
    snaps.save(2, {"w": torch.zeros(1)})  # does nothing, raises nothing
    snaps.wait()
    assert len(said) == 1


def test_the_snapshots_live_in_the_pods_shm_under_the_job():
    assert str(snapshot_root({"DDPJOB_UID": "u-1/x"})) == "/dev/shm/ddpjob-u-1_x"
    assert str(snapshot_root({"DDPJOB_SNAPSHOT_DIR": "/tmp/s", "DDPJOB_UID": "u"})) == "/tmp/s"


def test_a_rank_measures_what_its_snapshots_cost_and_the_run_reports_it_readably(tmp_path):
    snaps = Snapshots(tmp_path, rank=0, warn=pytest.fail)
    for step in (10, 20):
        snaps.save(step, {"w": torch.randn(1000, 100)})
    snaps.wait()
    cost = snaps.cost
    assert cost.taken == 2 and cost.paused > 0 and cost.writer_cpu > 0
    line = cost.line(train_seconds=8.0)
    assert read_cost(f"[12:00:00] step 5\n[12:00:01] {line}\n") == Cost(
        taken=2, paused=pytest.approx(cost.paused, abs=1e-6), writer_cpu=pytest.approx(cost.writer_cpu, abs=1e-6))
    assert f"{100 * (cost.paused + cost.writer_cpu) / 8.0:.3f} % of 8.000 s of training" in line
    assert read_cost("[12:00:00] step 5\n") is None


def test_a_small_state_is_copied_on_the_callers_thread_a_large_one_split(monkeypatch):
    parts = []
    real = checkpoint.run_each
    monkeypatch.setattr(checkpoint, "run_each", lambda fn, p: parts.append(len(p)) or real(fn, p))
    stager = checkpoint._Stager()
    small = {"a": torch.randn(1000), "b": torch.randn(1000)}
    large = {"a": torch.randn(checkpoint.PARALLEL_COPY_BYTES // 8), "b": torch.randn(checkpoint.PARALLEL_COPY_BYTES // 8)}
    for state in (small, large):
        staged = stager.stage(state)
        assert all(torch.equal(staged[k], v) for k, v in state.items())
    assert parts == [1, checkpoint.COPY_THREADS]
