"""A plain DDP training script, written the way the seed posts write one.

It knows nothing about DDPJob: torchrun gives it LOCAL_RANK / RANK / WORLD_SIZE, it builds
its own DistributedSampler and DDP model, and only rank 0 prints and saves. The one optional
block at the bottom of the loop reports per-rank metrics when `ddpjob_trainer` is installed,
so the job gets the same dashboards as the built-in trainer.

    torchrun --nnodes 2 --nproc-per-node 1 ... train.py --epochs 3
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:  # optional: per-rank Prometheus metrics for the DDPJob dashboards
    from ddpjob_trainer.telemetry import Telemetry
except ImportError:
    Telemetry = None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--save", default="")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(digits.target)
        dataset = TensorDataset(x, y)
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
        model = DDP(model, device_ids=[local_rank] if use_cuda else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        metrics = Telemetry.from_env() if Telemetry else None

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
            batches = metrics.track(loader, epoch=epoch) if metrics else loader
            for inputs, targets in batches:
                inputs, targets = inputs.to(device), targets.to(device)
                loss = F.cross_entropy(model(inputs), targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if metrics:
                    metrics.record_loss(loss)
            if rank == 0:
                print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
        if rank == 0 and args.save:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, args.save)
        if rank == 0:
            print("training finished", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
