"""The checkpoint manager (checkpointing/manager.py): which layer a step boundary writes, and which one
a resume loads, restoring the state exactly. One process in a real single-rank gloo group."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpjob_trainer.checkpointing.manager import CheckpointManager, TrainState, saved_position
from ddpjob_trainer.checkpointing.snapshot import read_cost
from ddpjob_trainer.checkpointing.storage import item_nbytes, read_index
from ddpjob_trainer.config import parse_config
from ddpjob_trainer.dist import DistContext
from ddpjob_trainer.reporting import NullReporter
from ddpjob_trainer.telemetry import Telemetry


class Lines(NullReporter):
    def __init__(self):
        self.lines = []

    def info(self, msg):
        self.lines.append(msg)


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistContext(rank=0, local_rank=0, world_size=1, node_rank=0, device=torch.device("cpu"), backend="gloo")
    dist.destroy_process_group()


def manager(ctx, tmp_path, monkeypatch, *, every=0, snapshot_every=0, seed=0, log=None, write_bandwidth=None):
    monkeypatch.setenv("DDPJOB_SNAPSHOT_DIR", str(tmp_path / "shm"))
    cfg = parse_config({"batchSize": 8, "checkpoint": {"dir": str(tmp_path / "ck"), "everySteps": every,
                                                       "snapshotEverySteps": snapshot_every, "asyncSave": False}})
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    stages = []
    m = CheckpointManager(cfg, ctx, train_size=100, model=model, optimizer=opt, scheduler=sched, log=log or NullReporter(),
                          telemetry=Telemetry.from_env(enabled=False), stage=stages.append,
                          sync_buffers=lambda: stages.append("synced"), write_bandwidth=write_bandwidth)
    return m, stages


def train(m, steps=1):
    for _ in range(steps):
        m.model(torch.randn(4, 3)).sum().backward()
        m.optimizer.step()
        m.scheduler.step()


@pytest.mark.parametrize("every, snapshot_every, step, epoch_end, want", [
    (5, 2, 10, False, "disk"),      # both due: the disk checkpoint, no snapshot beside it
    (5, 2, 4, False, "snapshot"),
    (5, 2, 4, True, None),          # the epoch's end: its disk checkpoint follows the evaluation
    (5, 2, 3, False, None),
    (0, 2, 6, False, "snapshot"),   # everySteps 0: disk checkpoints only at epochs' ends
    (0, 0, 6, False, None),
])
def test_a_step_boundary_writes_the_layer_that_is_due(group, tmp_path, monkeypatch, every, snapshot_every, step,
                                                      epoch_end, want):
    m, stages = manager(group, tmp_path, monkeypatch, every=every, snapshot_every=snapshot_every)
    took_disk = m.maybe_save(TrainState(step=step), epoch_end=epoch_end)
    m.close(train_seconds=1.0) if want != "snapshot" else m.snapshots.wait()
    wrote_disk = (tmp_path / "ck" / f"step-{step:08d}").is_dir()
    wrote_snapshot = bool(m.snapshots and m.snapshots.steps())
    assert (wrote_disk, wrote_snapshot) == (want == "disk", want == "snapshot")
    assert took_disk == (want == "disk")
    assert stages == (["checkpoint", "synced", "training"] if want == "disk" else [])


def test_a_step_is_saved_to_disk_once(group, tmp_path, monkeypatch):
    m, stages = manager(group, tmp_path, monkeypatch, every=5)
    assert m.maybe_save(TrainState(step=5), epoch_end=True)
    assert not m.save(TrainState(step=5)) and m.saved(5) and stages == ["checkpoint", "synced", "training"]


def test_a_save_is_estimated_from_the_bytes_a_checkpoint_writes_over_the_measured_write_speed(group, tmp_path,
                                                                                             monkeypatch):
    """Before the attempt measured a save, a stop judges one by this estimate (preempt.plan): its
    bytes are the tensors' that the checkpoint's shards then hold (model, momentum), its speed
    the probe's at start, or the debug knob's stand-in."""
    m, _ = manager(group, tmp_path, monkeypatch)
    train(m)  # the optimizer's momentum exists from the first step on
    st = TrainState(step=1)
    est = m.estimate_save(st)
    assert est.bandwidth == m.write_bandwidth > 0
    m.save(st)
    m.close(train_seconds=1.0)
    items = read_index(tmp_path / "ck" / "step-00000001")["items"]
    written = sum(item_nbytes(item) for item in items)  # the tensors' (pickled values, the config: 0)
    assert est.nbytes == written == 2 * (3 * 2 + 2) * 4  # weight and bias, and their momentum, float32
    slow, _ = manager(group, tmp_path / "slow", monkeypatch, write_bandwidth=1000.0)
    train(slow)
    assert slow.estimate_save(st).seconds == est.nbytes / 1000.0


def test_resume_loads_the_newest_of_snapshot_and_disk_and_restores_it_exactly(group, tmp_path, monkeypatch):
    log = Lines()
    m, _ = manager(group, tmp_path, monkeypatch, every=3, snapshot_every=2, log=log)
    train(m)
    m.maybe_save(TrainState(step=3, epoch=0, samples_done=24), epoch_end=False)  # disk
    train(m)
    m.maybe_save(TrainState(step=4, epoch=1, samples_done=8), epoch_end=False)  # snapshot, newer
    m.snapshots.wait()
    want = {k: v.clone() for k, v in m.model.state_dict().items()}
    momentum = [m.optimizer.state[p]["momentum_buffer"].clone() for p in m.model.parameters()]
    draw = torch.rand(3)

    fresh, _ = manager(group, tmp_path, monkeypatch, every=3, snapshot_every=2, seed=1, log=log)
    assert fresh.load() == TrainState(step=4, epoch=1, samples_done=8, first_world_size=1, written_at=1)
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in want.items())
    assert all(torch.equal(fresh.optimizer.state[p]["momentum_buffer"], b)
               for p, b in zip(fresh.model.parameters(), momentum))
    assert fresh.scheduler.last_epoch == 2 and torch.equal(torch.rand(3), draw)
    assert "resumed from the in-memory snapshot" in log.lines[-1] and "newest disk checkpoint: step 3" in log.lines[-1]

    train(fresh)
    fresh.save(TrainState(step=6, epoch=1, samples_done=24))  # the disk is newer now
    again, _ = manager(group, tmp_path, monkeypatch, every=3, snapshot_every=2, seed=2, log=log)
    assert again.load() == TrainState(step=6, epoch=1, samples_done=24, first_world_size=1, written_at=1)
    assert log.lines[-1].startswith(f"resumed from {tmp_path / 'ck' / 'step-00000006'} at step 6")
    again.close(train_seconds=1.0)
    assert again.snapshots.steps() == []  # the run ended: /dev/shm room given back


def test_the_run_reports_what_its_snapshots_cost(group, tmp_path, monkeypatch):
    log = Lines()
    m, _ = manager(group, tmp_path, monkeypatch, snapshot_every=2, log=log)
    for step in (2, 4):
        train(m)
        m.maybe_save(TrainState(step=step), epoch_end=False)
    m.close(train_seconds=10.0)
    cost = read_cost(log.lines[-1])
    assert cost is not None and cost.taken == 2 and cost.paused > 0
    assert log.lines[-1].endswith("of 10.000 s of training")

    quiet = Lines()
    none, _ = manager(group, tmp_path, monkeypatch, snapshot_every=2, log=quiet)
    none.close(train_seconds=10.0)  # no snapshot was due: nothing to report
    assert quiet.lines == []


def test_nothing_to_resume_from(group, tmp_path, monkeypatch):
    m, _ = manager(group, tmp_path, monkeypatch, snapshot_every=2)
    assert m.load() is None


@pytest.mark.parametrize("saved, want", [
    # Today's checkpoints: the global offset as saved, the first world size carried on.
    ({"samples_done": 48, "first_world_size": 4, "schedule_from": [30, 0.25]}, (48, 4, (30, 0.25))),
    # Written before the offset: micro-batches per rank x batchSize x the world size that wrote it,
    # which was also the first (a resize was refused then).
    ({"micro_done": 3}, (3 * 8 * 2, 2, None)),
    ({"micro_done": 7}, (100, 2, None)),  # the epoch's end: 7 x 8 x 2 = 112 samples, the epoch has 100
])
def test_a_saved_position_is_a_global_sample_offset(saved, want):
    state = {"step": 9, "epoch": 1, "world_size": 2, "config": {"batch_size": 8}, **saved}
    st = saved_position(state, train_size=100)
    assert (st.step, st.epoch, st.written_at) == (9, 1, 2)
    assert (st.samples_done, st.first_world_size, st.schedule_from) == want


def test_a_resume_discards_the_snapshots_of_later_steps(group, tmp_path, monkeypatch):
    """Steps after the resumed one are taken again (at a new world size on other data): an old copy
    of one must never be agreed on with a new one, whichever rank's name it has."""
    m, _ = manager(group, tmp_path, monkeypatch, every=3, snapshot_every=1)
    train(m)
    m.save(TrainState(step=3))
    for step in (4, 5):
        m.maybe_save(TrainState(step=step), epoch_end=False)
        m.snapshots.wait()
    (tmp_path / "shm" / "rank-1-step-00000005.pt").write_bytes(b"another rank's, at the old world size")
    fresh, _ = manager(group, tmp_path, monkeypatch, every=3, snapshot_every=1)
    assert fresh.load().step == 5
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == ["rank-0-step-00000004.pt", "rank-0-step-00000005.pt",
                                                                 "rank-1-step-00000005.pt"]
    (tmp_path / "shm" / "rank-0-step-00000005.pt").unlink()  # as if cut short: the newest rank 0 holds is 4
    again, _ = manager(group, tmp_path, monkeypatch, every=3, snapshot_every=1)
    assert again.load().step == 4
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == ["rank-0-step-00000004.pt"]
