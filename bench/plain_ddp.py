"""The peer: a plain hand-written DDP loop in the style of pytorch/examples' multinode.py.

Same model, same synthetic data and batch size as the built-in trainer's benchmark config;
no checkpoints, telemetry or evaluation. Run under torchrun; rank 0 prints one JSON line.
"""
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))
from ddpjob_trainer.models import build_model  # noqa: E402  (the same network, nothing else)


def main():
    cfg = json.loads(os.environ["BENCH_CONFIG"])
    syn = cfg["synthetic"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(syn["seed"])
    shape = tuple(syn["shape"])
    x = torch.randn((syn["trainSize"], *shape), generator=g)
    w = torch.randn((math.prod(shape), syn["numClasses"]), generator=g)
    y = (x.flatten(1) @ w).argmax(1)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(ds, batch_size=cfg["batchSize"], sampler=sampler)
    torch.manual_seed(cfg["seed"])
    model = DDP(build_model(cfg["model"], shape, syn["numClasses"]))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    seconds, samples = 0.0, 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                xb, yb = next(it)
            except StopIteration:
                break
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()
            seconds += time.perf_counter() - t0
            samples += yb.numel()
    t = torch.tensor([samples, seconds], dtype=torch.float64)
    dist.all_reduce(t)
    if rank == 0:
        print(json.dumps({"train_samples_per_second": float(t[0] / (t[1] / world))}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
