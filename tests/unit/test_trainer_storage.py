"""The raw-bytes DCP storage layer: what it writes reads back exactly, whatever the dtype or layout;
stock DCP refuses it by name; shards in DCP's default format still load; a failed write raises."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ddpjob_trainer.checkpointing.dcp_storage import RawReader, RawWriter
from ddpjob_trainer.checkpointing.storage import INDEX, RAW, load_indexed, read_index
from ddpjob_trainer.torchapi import load_dcp_state


def _save(state, path, writer_cls=RawWriter, threads=2):
    return dcp.save(state, storage_writer=writer_cls(path, thread_count=threads), no_dist=True)


def _load_all(path):
    return load_dcp_state(path, RawReader(path))


def _state():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 8, generator=g)
    return {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),  # no numpy dtype: bytes only
        "f16": torch.randn(9, generator=g).half(),
        "i64": torch.tensor(12345678901),  # 0-d
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(256, dtype=torch.uint8),
        "empty": torch.empty(0, 4),
        "strided": wide.t(),  # not contiguous: written in logical order
        "sliced": wide[::2, 1:5],
        "nested": {"list": [torch.ones(2, 2), 7, "text"], "step": 11},
    }


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_dtype_and_layout_reads_back_exactly(tmp_path, threads):
    state = _state()
    _save(state, tmp_path, threads=threads)
    back = _load_all(tmp_path)
    for key in ("f32", "bf16", "f16", "i64", "bool", "u8", "empty", "strided", "sliced"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key]), key
    assert torch.equal(back["nested"]["list"][0], torch.ones(2, 2))
    assert back["nested"]["list"][1:] == [7, "text"] and back["nested"]["step"] == 11


def _assert_same_tree(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("threads", [1, 3])
def test_our_index_reads_back_the_same_tree_as_dcp_without_dcp(tmp_path, threads):
    _save(_state(), tmp_path, threads=threads)
    assert (tmp_path / INDEX).is_file()
    _assert_same_tree(load_indexed(tmp_path, read_index(tmp_path)), _load_all(tmp_path))


def test_an_optimizer_state_reads_back_through_the_index_with_integer_keys_as_dcp_gives_them(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    _save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, tmp_path)
    _assert_same_tree(load_indexed(tmp_path, read_index(tmp_path)), _load_all(tmp_path))


def test_a_truncated_shard_is_named_by_the_index_reader(tmp_path):
    _save(_state(), tmp_path, threads=1)
    shard = next(tmp_path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(ValueError, match=f"{shard.name} ends before"):
        load_indexed(tmp_path, read_index(tmp_path))


def test_loading_into_given_tensors_fills_them_in_place(tmp_path):
    state = _state()
    _save(state, tmp_path)
    target = {"f32": torch.zeros(5, 7), "bf16": torch.zeros(4, 3, dtype=torch.bfloat16)}
    dcp.load(target, storage_reader=RawReader(tmp_path), no_dist=True)
    assert torch.equal(target["f32"], state["f32"]) and torch.equal(target["bf16"], state["bf16"])


def test_shards_hold_only_the_tensor_bytes(tmp_path):
    """No archive per tensor: the shard files together are exactly the tensors' bytes."""
    state = {"a": torch.randn(1000), "b": torch.randn(300, 3).double()}
    _save(state, tmp_path)
    shards = sum(p.stat().st_size for p in tmp_path.glob("*.distcp"))
    assert shards == 1000 * 4 + 900 * 8


def test_stock_dcp_refuses_a_raw_checkpoint_by_name(tmp_path):
    _save({"w": torch.randn(3)}, tmp_path)
    with pytest.raises(CheckpointException, match="Unknown extension name='raw-tensor-bytes@ddpjob.dev'"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    assert RAW.startswith("raw-tensor-bytes@ddpjob.dev/")


def test_shards_in_dcps_default_format_still_load(tmp_path):
    """Checkpoints written before this storage layer (torch.save archives per tensor)."""
    state = {"w": torch.randn(4, 4), "bf16": torch.randn(3).to(torch.bfloat16), "step": 5}
    _save(state, tmp_path, writer_cls=dcp.FileSystemWriter)
    back = _load_all(tmp_path)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["bf16"], state["bf16"]) and back["step"] == 5


def test_a_value_that_cannot_be_written_raises_from_any_writer_thread(tmp_path):
    """DCP's own extra threads only print such errors and the checkpoint silently lacks the item."""
    state = {f"t{i}": torch.randn(100 * (i + 1)) for i in range(6)} | {"bad": lambda: None}
    with pytest.raises(CheckpointException, match="Can't pickle local object"):
        _save(state, tmp_path, threads=4)
    assert not (tmp_path / ".metadata").exists()  # no metadata: DCP never calls it a checkpoint
