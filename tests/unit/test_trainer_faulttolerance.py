"""Per-step fault tolerance's pure pieces: the env it reads, the data split over groups, the state a
joining group takes from a peer, and the refusal without torchft."""
from __future__ import annotations

import io
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from ddpjob_trainer import debug, faulttolerance
from ddpjob_trainer.checkpointing.manager import TrainState
from ddpjob_trainer.data import ResumableSampler
from ddpjob_trainer.errors import ConfigError
from ddpjob_trainer.faulttolerance import FtEnv, weights_hash
from ddpjob_trainer.loop import Trainer

FT_ENV = {"DDPJOB_FT_LIGHTHOUSE": "http://lh:29510", "DDPJOB_FT_HOST": "10.0.0.7", "NODE_RANK": "2", "NNODES": "3",
          "DDPJOB_FT_MIN_REPLICAS": "2", "DDPJOB_FT_TIMEOUT_SECONDS": "4", "DDPJOB_FT_QUORUM_TIMEOUT_SECONDS": "30"}


def test_the_env_of_a_per_step_pod_and_none_without_a_lighthouse():
    assert FtEnv.from_env({"NODE_RANK": "1", "NNODES": "2"}) is None
    assert FtEnv.from_env(FT_ENV) == FtEnv(lighthouse="http://lh:29510", host="10.0.0.7", group=2, groups=3,
                                           min_replicas=2, timeout_seconds=4.0, quorum_timeout_seconds=30.0)
    with pytest.raises(ConfigError, match="DDPJOB_FT_LIGHTHOUSE"):
        FtEnv.from_env({**FT_ENV, "NNODES": "two"})


@pytest.mark.parametrize("env, reports", [
    ({"NODE_RANK": "1", "NNODES": "2"}, True),  # one torchrun world: its rank 0 is the only pod's rank 0
    ({**FT_ENV, "NODE_RANK": "0"}, True),
    (FT_ENV, False),  # group 2 of 3: its rank 0 logs to its console, and tracks nothing
])
def test_one_group_of_a_per_step_job_reports_the_result_and_the_mlflow_run(env, reports):
    assert faulttolerance.reporting_group(env) is reports


@pytest.mark.parametrize("groups, nproc", [(2, 1), (2, 2), (3, 2)])
def test_the_groups_train_on_disjoint_shards_that_cover_the_epoch(groups, nproc):
    shares = []
    for group in range(groups):
        fe = FtEnv.from_env({**FT_ENV, "NODE_RANK": str(group), "NNODES": str(groups)})
        for local in range(nproc):
            rank, world = fe.data_split(rank=local, world_size=nproc)
            assert world == groups * nproc and rank == group * nproc + local
            sampler = ResumableSampler(range(101), num_replicas=world, rank=rank, seed=5)
            sampler.set_epoch(1, start=10)
            shares.append(list(sampler))
    flat = [i for share in shares for i in share]
    assert len(flat) == len(set(flat))  # no sample twice
    assert len(flat) > 101 - 10 - groups * nproc  # and all of the epoch's rest but a remainder shorter than a round
    assert len({len(s) for s in shares}) == 1  # every rank the same number of steps


def _trainer(seed: int, state: TrainState) -> SimpleNamespace:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    return SimpleNamespace(model=model, opt=opt, sched=sched, state=state)


def test_a_joining_group_takes_model_optimizer_schedule_and_position_from_its_peer():
    peer = _trainer(0, TrainState(step=7, epoch=1, samples_done=224, first_world_size=2))
    peer.model(torch.randn(5, 4)).sum().backward()
    peer.opt.step()
    peer.sched.step()
    joiner = _trainer(1, TrainState())
    joiner_state = joiner.state
    assert weights_hash(joiner.model) != weights_hash(peer.model)
    # Through bytes, as torchft's HTTP transport sends it.
    buf = io.BytesIO()
    torch.save(Trainer.ft_state_dict(peer), buf)  # type: ignore[arg-type]
    Trainer.ft_load_state_dict(joiner, torch.load(io.BytesIO(buf.getvalue()), weights_only=False))  # type: ignore[arg-type]
    assert weights_hash(joiner.model) == weights_hash(peer.model)
    assert joiner.state is joiner_state and joiner.state == peer.state  # in place: the loop holds it
    assert joiner.sched.last_epoch == peer.sched.last_epoch and joiner.opt.param_groups[0]["lr"] == peer.opt.param_groups[0]["lr"]
    momentum = [joiner.opt.state[p]["momentum_buffer"] for p in joiner.model.parameters()]
    assert all(torch.equal(a, peer.opt.state[p]["momentum_buffer"]) for a, p in zip(momentum, peer.model.parameters()))


def test_the_weights_hash_is_short_stable_and_sees_one_changed_value():
    a, b = _trainer(0, TrainState()).model, _trainer(0, TrainState()).model
    assert weights_hash(a) == weights_hash(b) and len(weights_hash(a)) == 12
    with torch.no_grad():
        b[0].bias[0] += 1e-6
    assert weights_hash(a) != weights_hash(b)


def test_without_torchft_a_per_step_job_is_refused_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    with pytest.raises(ConfigError, match=r"spec.faultTolerance needs torchft.*pip install 'ddpjob\[trainer\]'"):
        faulttolerance.import_torchft()


def test_a_hold_knob_per_rank_holds_only_that_rank_from_its_step():
    env = {"DDPJOB_DEBUG_HOLD_RANK": "1:3:/tmp/a,0:8:/tmp/b"}
    one, zero, two = (debug.Knobs.from_env(rank=r, env=env) for r in (1, 0, 2))
    assert (one.hold_rank_at, one.hold_rank_until) == (3, "/tmp/a")
    assert (zero.hold_rank_at, zero.hold_rank_until) == (8, "/tmp/b")
    assert two.hold_rank_at is None and not two.hold(100, alive=lambda: None)
    assert not zero.hold(7, alive=lambda: None)  # before its step: no hold (the file is missing)


def test_a_per_step_ranks_telemetry_is_labelled_with_its_rank_in_the_job_not_in_its_pod(monkeypatch):
    from ddpjob_trainer.faulttolerance import job_rank
    from ddpjob_trainer.telemetry import Telemetry
    assert job_rank({"RANK": "1", "LOCAL_WORLD_SIZE": "2"}) is None
    assert job_rank({**FT_ENV, "RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == 2 * 2 + 1  # group 2, 2 ranks a group
    for k, v in {**FT_ENV, "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    labels = Telemetry.from_env(enabled=False).labels
    assert (labels["rank"], labels["local_rank"], labels["node_rank"]) == ("5", "1", "2")


def test_a_folded_quorum_id_is_the_same_for_one_lighthouse_and_another_for_its_successor():
    fold = faulttolerance.folded_quorum_id
    assert fold("a" * 32, 2) == fold("a" * 32, 2)
    # A recreated Lighthouse starts its ids again: its quorum 2 is not its predecessor's.
    assert len({fold("a" * 32, 2), fold("b" * 32, 2), fold("a" * 32, 3)}) == 3
    assert all(0 < fold(inc, q) < 2**62 for inc in ("a" * 32, "b" * 32) for q in range(1, 50))


def test_the_incarnation_client_folds_the_lighthouse_id_it_reads_after_each_quorum():
    reads, quorums = [], []

    class Client:   # what torchft's ManagerClient answers, by its attribute names
        def _quorum(self, **kwargs):
            quorums.append(kwargs)
            return SimpleNamespace(quorum_id=2, replica_rank=1, max_step=7)

        def should_commit(self, *args):
            return True

    ids = iter(["one", "two"])
    client = faulttolerance.IncarnationClient(Client(), lambda: reads.append(1) or next(ids))
    first, second = client._quorum(group_rank=0, step=7), client._quorum(group_rank=0, step=8)
    assert quorums == [{"group_rank": 0, "step": 7}, {"group_rank": 0, "step": 8}] and len(reads) == 2
    assert first.quorum_id == faulttolerance.folded_quorum_id("one", 2) != second.quorum_id
    assert (first.replica_rank, first.max_step) == (1, 7)
    assert client.should_commit(0, 7, True) is True


def _id_server(port: int, incarnation: str) -> tuple[subprocess.Popen, int]:
    """ddpjob_trainer.lighthouse's id server alone, in a process of its own (what dies with a
    Lighthouse), and the port it serves on once it does."""
    code = ("import sys; from ddpjob_trainer.lighthouse import id_server; "
            "s = id_server(sys.argv[1], sys.argv[2]); print(s.server_address[1], flush=True); s.serve_forever()")
    proc = subprocess.Popen([sys.executable, "-c", code, f"127.0.0.1:{port}", incarnation], stdout=subprocess.PIPE,
                            text=True)
    return proc, int(proc.stdout.readline())


def test_the_lighthouse_id_is_read_again_from_a_new_lighthouse_on_the_same_port():
    old, port = _id_server(0, "one")
    reader = faulttolerance.LighthouseId(f"http://127.0.0.1:{port}", timeout=5)
    new = None
    try:
        assert reader.read() == reader.read() == "one"   # one kept-alive connection
        old.kill()
        old.wait()
        with pytest.raises(RuntimeError, match=f"the Lighthouse's id at http://127.0.0.1:{port} did not answer"):
            reader.read()
        new, _ = _id_server(port, "two")
        assert reader.read() == "two"
    finally:
        reader.close()
        for proc in (old, new):
            if proc is not None:
                proc.kill()
                proc.wait()
