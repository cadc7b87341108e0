"""The peer: a plain hand-written DDP loop in the style of pytorch/examples' multinode.py.

Same model, synthetic data, batch size and DDP options as the built-in trainer's benchmark
config (the model is wrapped by the trainer's own `wrap_ddp`, so DDP cannot differ); no
checkpoints, telemetry or evaluation. Timing window as the trainer's: from one step boundary to
the next, first step and data wait included, the loss read to the host every logEverySteps.
Where torch sees a GPU (bench/gpu_check.py's peer runs), each rank trains on GPU LOCAL_RANK over
NCCL with the config's precision, channels_last, compile and data workers, as the trainer resolves
them (its `tuning` functions); else on the CPU over gloo. maxSteps caps the run as the trainer's.
Run under torchrun; rank 0 prints one JSON line: the throughput, and the Unix time each of its steps
ended (`step_times`: tests/trainer/test_trainer_overhead.py counts steps over a span of seconds).
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))
from ddpjob_trainer import tuning  # the same resolved precision, memory format and workers
from ddpjob_trainer.config import parse_config
from ddpjob_trainer.data import synthetic  # the same tensors
from ddpjob_trainer.loop import wrap_ddp  # the same DDP options
from ddpjob_trainer.models import build_model  # the same network
from ddpjob_trainer.reporting import NullReporter


def main():
    cfg = parse_config(json.loads(os.environ["BENCH_CONFIG"]))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tuning.apply_backend_switches(cfg, device)
    amp = tuning.autocast_dtype(cfg, device, log=NullReporter())
    channels_last = tuning.use_channels_last(cfg, device)
    workers = tuning.resolve_num_workers(cfg, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    data = synthetic(cfg)
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=cuda, persistent_workers=workers > 0)
    torch.manual_seed(cfg.seed)
    net = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    model = wrap_ddp(torch.compile(net) if cfg.compile else net, cfg, device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    seconds, samples, step = 0.0, 0, 0
    step_times = []
    for epoch in range(cfg.epochs):
        if cfg.max_steps and step >= cfg.max_steps:
            break
        sampler.set_epoch(epoch)
        boundary = time.perf_counter()
        for xb, yb in loader:
            if cfg.max_steps and step >= cfg.max_steps:
                break
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            if channels_last:
                xb = xb.contiguous(memory_format=torch.channels_last)
            with tuning.autocast(device, amp):
                loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % cfg.log_every_steps == 0:
                loss.item()
            now = time.perf_counter()
            seconds += now - boundary
            boundary = now
            samples += yb.numel()
            step_times.append(time.time())
    t = torch.tensor([samples, seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    if rank == 0:
        print(json.dumps({"train_samples_per_second": float(t[0] / (t[1] / world)), "step_times": step_times}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
