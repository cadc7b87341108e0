"""Checkpoint cost per node: each rank stages and writes only its share of the replicated state, and a
restore reads about 1/N of it per rank and broadcasts the rest; every rank still gets the whole state."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

from ddpjob_trainer.checkpointing.checkpoint import flatten, share_of
from ddpjob_trainer.checkpointing.storage import build_state


def _state():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7, "config": {"lr": 0.1}}


def _nbytes(flat):
    return sum(v.numel() * v.element_size() for v in flat.values() if isinstance(v, torch.Tensor))


def test_the_shares_cover_every_leaf_once_balanced_with_the_small_values_on_rank_0():
    state, world = _state(), 3
    flat = flatten(state)
    shares = [share_of(state, rank=r, world_size=world) for r in range(world)]
    keys = [k for s in shares for k in s]
    assert sorted(keys) == sorted(flat) and len(keys) == len(set(keys))
    assert {k for k, v in flat.items() if not isinstance(v, torch.Tensor)} <= set(shares[0])
    biggest = max(_nbytes({k: v}) for k, v in flat.items() if isinstance(v, torch.Tensor))
    assert max(_nbytes(s) for s in shares) <= _nbytes(flat) / world + biggest


def test_a_flattened_state_rebuilds_as_dcp_gave_it_back():
    state = _state()
    flat = flatten(state)
    back = build_state([{"path": json.loads(k)} for k in flat], list(flat.values()))
    assert back["step"] == 7 and back["config"] == {"lr": 0.1}
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # no tensor: one leaf
    assert set(back["optimizer"]["state"]) == {str(k) for k in state["optimizer"]["state"]}  # keys as strings
    for k, v in state["model"].items():
        assert torch.equal(back["model"][k], v)


# Two ranks over a FileStore, each with the same replicated state: an async save, then a load. Each
# rank reports the tensor bytes it staged (copied for the background write), the bytes of the shard
# files it wrote, the tensor bytes it read from disk, and whether what it loaded equals what was saved.
_RANK = textwrap.dedent("""
    import datetime as dt, json, os, sys
    import torch, torch.distributed as dist
    from ddpjob_trainer.checkpointing import checkpoint, storage
    rank, store, ckdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=120))
    torch.manual_seed(0)
    state = {"w": [torch.randn(64, 64) for _ in range(6)], "b": torch.randn(100).to(torch.bfloat16),
             "step": 5, "empty": torch.empty(0, 3), "flag": torch.tensor(True)}
    read = []
    real = storage.read_items
    def counting(step_dir, items):
        read.extend(storage.item_nbytes(i) for i in items)
        return real(step_dir, items)
    checkpoint.read_items = counting
    def bcast(v):
        box = [v]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    ck = checkpoint.Checkpointer(ckdir, keep=2, rank=rank, group=dist.group.WORLD, barrier=dist.barrier,
                                 broadcast=bcast, log=checkpoint.NullReporter(), async_save=True)
    staged = []
    stage = ck._stager.stage
    def counting_stage(obj):
        staged.extend(v.numel() * v.element_size() for v in checkpoint.flatten(obj["common"]).values()
                      if isinstance(v, torch.Tensor))
        return stage(obj)
    ck._stager.stage = counting_stage
    path = ck.save(step=5, common=state, rank_state={"r": torch.tensor(rank)})
    ck.wait()
    dist.barrier()
    written = sum(p.stat().st_size for p in path.glob(f"__{rank}_*.distcp"))
    loaded = ck.load_latest().common
    same = (all(torch.equal(a, b) for a, b in zip(loaded["w"], state["w"])) and torch.equal(loaded["b"], state["b"])
            and loaded["step"] == 5 and loaded["empty"].shape == (0, 3) and bool(loaded["flag"]))
    print(json.dumps({"staged": sum(staged), "written": written, "read": sum(read), "same": same}), flush=True)
    dist.destroy_process_group()
    # Ends as a built-in trainer rank does (ddpjob_trainer.__main__.exit_now), without interpreter
    # and C++ teardown: there gloo now and then aborts a rank after its work is done ("terminate
    # called without an active exception": 3 in 15 runs on a loaded 2-core machine; with the
    # launcher's exit guard, 1 in 46), which would fail this test for no fault of the checkpoint's.
    os._exit(0)
""")


def test_two_ranks_each_write_and_read_about_half_and_both_get_the_whole_state(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    args = [str(tmp_path / "store"), str(tmp_path / "ck")]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    reports = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    total = 6 * 64 * 64 * 4 + 100 * 2 + 1
    for r in reports:
        assert r["same"], reports
        assert 0.3 * total < r["staged"] < 0.7 * total, reports   # copies its share, not the whole state
        assert 0.3 * total < r["written"] < 0.7 * total, reports
        assert 0.3 * total < r["read"] < 0.7 * total, reports     # its 1/N; the rest came by broadcast
