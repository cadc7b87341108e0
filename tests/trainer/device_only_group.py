"""Run the real trainer under a process group that, like NCCL, takes only its device's tensors.

This machine has no GPU, so the `meta` device stands in for CUDA: the trainer's device is meta
(tensors with shapes but no data, so the loop runs without any accelerator), and the default
group's backend map is `meta:<backend>` only, the shape of an NCCL group (`cuda:nccl`), and the backend refuses any
tensor off that device, as NCCL does ("No backend type associated with device type cpu" on a
GPU job). It completes every collective at once without moving data (values are meaningless;
placement is what is checked) and counts what it was asked to do.

Usage (a subprocess per run, see test_device_only_group.py):
    python device_only_group.py CONFIG_JSON RESULT_JSON
prints one JSON line with the collectives' counts; exit 0 only if the trainer finished.

What a meta device cannot do is stubbed here, in this file only, and named: reading a value
(`item`, `tolist`: answered with 1) and DDP's two start-up checks that read values (parameter
shape verification, bucket rebuilding after the first step). Rank 0 of a world of 2 runs alone:
a broadcast's receivers would unpickle meaningless bytes.
"""
from __future__ import annotations

import collections
import functools
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp_mod
from torch._C._distributed_c10d import _create_work_from_future

try:  # torch >= 2.9; before, the same store is a test utility of torch's
    from torch._C._distributed_c10d import FakeStore
except ImportError:
    from torch.testing._internal.distributed.fake_pg import FakeStore

STANDIN = "meta"
BACKEND = "devonly"
COUNTS: collections.Counter = collections.Counter()


def _done(result):
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class DeviceOnlyGroup(dist.ProcessGroup):
    """Completes each collective immediately; refuses (like NCCL) any tensor off the device."""

    def _check(self, op: str, tensors) -> None:
        flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
        for t in flat:
            if t.device.type != STANDIN:
                raise RuntimeError(f"{op}: tensor on {t.device}; this group takes only {STANDIN} tensors")
        COUNTS[op] += 1

    def allreduce(self, tensors, opts=None):
        self._check("allreduce", tensors)
        return _done(tensors)

    def broadcast(self, tensors, opts=None):
        self._check("broadcast", tensors)
        return _done(tensors)

    def allgather(self, outputs, inputs, opts=None):
        self._check("allgather", inputs)
        return _done(outputs)

    def _allgather_base(self, output, inp, opts=None):
        self._check("allgather", [inp])
        return _done(output)

    def barrier(self, opts=None):
        COUNTS["barrier"] += 1
        return _done(None)

    def getBackendName(self):  # noqa: N802  (torch's ProcessGroup API)
        return BACKEND


def _install_meta_stubs() -> None:
    item, tolist = torch.Tensor.item, torch.Tensor.tolist

    def meta_item(self):
        return (1.0 if self.is_floating_point() else 1) if self.is_meta else item(self)

    def meta_tolist(self):
        if not self.is_meta:
            return tolist(self)
        return torch.ones(self.shape, dtype=self.dtype).tolist()

    torch.Tensor.item = meta_item
    torch.Tensor.tolist = meta_tolist
    ddp_mod._verify_param_shape_across_processes = lambda *a, **k: None

    class _Reducer:
        def __init__(self, real):
            object.__setattr__(self, "_real", real)

        def __getattr__(self, name):
            return getattr(self._real, name)

        def _rebuild_buckets(self):
            return False

    init = ddp_mod.DistributedDataParallel.__init__

    @functools.wraps(init)  # the trainer inspects DDP's signature
    def ddp_init(self, *a, **k):
        init(self, *a, **k)
        self.reducer = _Reducer(self.reducer)

    ddp_mod.DistributedDataParallel.__init__ = ddp_init


def main(config_json: str, result_path: str) -> int:
    from ddpjob_trainer.config import parse_config
    from ddpjob_trainer.dist import DistContext
    from ddpjob_trainer.loop import train
    from ddpjob_trainer.reporting import ConsoleReporter
    from ddpjob_trainer.telemetry import Telemetry

    _install_meta_stubs()
    dist.Backend.register_backend(BACKEND, lambda common, _opts: DeviceOnlyGroup(common.group_rank, common.group_size),
                                  extended_api=True, devices=[STANDIN])
    dist.init_process_group(backend=f"{STANDIN}:{BACKEND}", store=FakeStore(), rank=0, world_size=2)
    ctx = DistContext(rank=0, local_rank=0, world_size=2, node_rank=0, device=torch.device(STANDIN),
                      backend=f"{STANDIN}:{BACKEND}")
    try:
        train(parse_config(json.loads(config_json)), ctx, log=ConsoleReporter(),
              telemetry=Telemetry(labels={}, enabled=False), result_path=result_path)
    finally:
        print(json.dumps(dict(COUNTS)), flush=True)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
