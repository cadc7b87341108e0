"""The DDP training loop: data, model, optimizer, checkpoints, exact evaluation, telemetry."""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from . import debug, rng
from .checkpoint import Checkpointer, step_dir_name
from .config import TrainerConfig
from .data import ResumableSampler, build_data, eval_shard
from .dist import DistContext
from .models import build_model
from .reporting import NullReporter
from .telemetry import Telemetry


@dataclass
class EvalResult:
    """Exact evaluation over the whole validation set."""

    accuracy: float
    loss: float
    samples: int
    dataset_size: int


@dataclass
class RunResult:
    """What rank 0 reports when training ends (the local runner's summary reads it)."""

    steps: int
    total_steps: int
    epochs_completed: int
    world_size: int
    resumed_from_step: int
    train_samples_per_second: float
    eval_accuracy: float | None
    eval_loss: float | None
    eval_samples: int | None
    eval_dataset_size: int | None
    last_checkpoint: str | None


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _build_optimizer(cfg: TrainerConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _build_scheduler(cfg: TrainerConfig, opt, total_steps: int):
    warm = cfg.warmup_steps

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.scheduler == "constant":
            return 1.0
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _autocast(cfg: TrainerConfig, device: torch.device):
    """bf16 autocast on GPUs that support it (precision auto|bf16); full precision elsewhere."""
    if device.type == "cuda" and cfg.precision in ("auto", "bf16") and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: torch.nn.Module, val, *, cfg: TrainerConfig, ctx: DistContext) -> EvalResult:
    """Every validation sample counted exactly once across ranks (no DistributedSampler padding)."""
    model.eval()
    shard = Subset(val, eval_shard(len(val), rank=ctx.rank, world_size=ctx.world_size))
    loader = DataLoader(shard, batch_size=cfg.batch_size, shuffle=False, num_workers=cfg.num_workers,
                        pin_memory=ctx.device.type == "cuda")
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss, correct, count
    for x, y in loader:
        x = x.to(ctx.device, non_blocking=True)
        y = y.to(ctx.device, non_blocking=True)
        with _autocast(cfg, ctx.device):
            logits = model(x)
        sums[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        sums[1] += (logits.argmax(1) == y).sum()
        sums[2] += y.numel()
    dist.all_reduce(sums)
    model.train()
    count = int(sums[2].item())
    return EvalResult(accuracy=(sums[1] / count).item(), loss=(sums[0] / count).item(),
                      samples=count, dataset_size=len(val))


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def train(cfg: TrainerConfig, ctx: DistContext, *, log: NullReporter, telemetry: Telemetry,
          result_path: str | None = None) -> RunResult:
    """Run (or resume) training to completion; every rank calls this."""
    rng.seed_all(cfg.seed + ctx.rank)
    data = build_data(cfg)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, data.input_shape, data.num_classes).to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
              gradient_as_bucket_view=True)
    forward = torch.compile(ddp) if cfg.compile else ddp

    sampler = ResumableSampler(data.train, num_replicas=ctx.world_size, rank=ctx.rank,
                               shuffle=True, seed=cfg.seed)
    # The loader's own generator: creating an iterator must not draw from the global RNG,
    # or a resumed run's dropout stream would differ from an uninterrupted one.
    loader_rng = torch.Generator()
    loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler,
                        num_workers=cfg.num_workers, pin_memory=ctx.device.type == "cuda",
                        persistent_workers=False, generator=loader_rng)
    micro_per_epoch = math.ceil(sampler.num_samples / cfg.batch_size)
    steps_per_epoch = math.ceil(micro_per_epoch / cfg.grad_accum_steps)
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    opt = _build_optimizer(cfg, ddp.parameters())
    sched = _build_scheduler(cfg, opt, total_steps)

    step, epoch, micro_done, resumed_from = 0, 0, 0, 0
    ckpt = None
    if cfg.checkpoint.dir:
        ckpt = Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep, rank=ctx.rank,
                            barrier=dist.barrier, broadcast=_broadcast, log=log)
        loaded = ckpt.load_latest(map_location=ctx.device)
        if loaded:
            c = loaded.common
            model.load_state_dict(c["model"])
            opt.load_state_dict(c["optimizer"])
            sched.load_state_dict(c["scheduler"])
            step, epoch, micro_done = c["step"], c["epoch"], c["micro_done"]
            resumed_from = step
            if loaded.rank_state:
                rng.set_state(loaded.rank_state["rng"])
            log.info(f"resumed from {loaded.path} at step {step} (epoch {epoch}, batch {micro_done})")

    telemetry.set_total_steps(total_steps)
    telemetry.set_restart_count(int(os.environ.get("DDPJOB_ATTEMPT", "0")))
    log.params({"world_size": ctx.world_size, "backend": ctx.backend, **{
        k: v for k, v in asdict(cfg).items() if not isinstance(v, dict)}})
    log.info(f"training {cfg.model} on {cfg.dataset}: world size {ctx.world_size} ({ctx.backend}), "
             f"{len(data.train)} train / {len(data.val)} val samples, {total_steps} steps")

    def save() -> None:
        if not ckpt or ckpt.last_saved_step == step:
            return
        t0 = time.perf_counter()
        common = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                  "scheduler": sched.state_dict(), "step": step, "epoch": epoch,
                  "micro_done": micro_done, "world_size": ctx.world_size, "config": cfg.to_dict()}
        path = ckpt.save(step=step, common=common, rank_state={"rng": rng.get_state()})
        seconds = time.perf_counter() - t0
        telemetry.checkpoint(seconds)
        log.info(f"checkpoint {path} ({seconds:.2f}s)")

    knobs = debug.Knobs.from_env(rank=ctx.rank)
    train_seconds, samples_seen, last_eval = 0.0, 0, None
    ddp.train()
    while epoch < cfg.epochs and step < total_steps:
        if micro_done >= micro_per_epoch:  # a checkpoint taken exactly at an epoch's end
            epoch, micro_done = epoch + 1, 0
            continue
        sampler.set_epoch(epoch, start=micro_done * cfg.batch_size)
        loader_rng.manual_seed(cfg.seed * 100_003 + epoch * 1009 + ctx.rank)  # worker seeds per epoch
        batches = iter(loader)
        while micro_done < micro_per_epoch and step < total_steps:
            t_step = time.perf_counter()
            telemetry.step_started(step=step + 1)
            wait = 0.0
            n_micro = min(cfg.grad_accum_steps, micro_per_epoch - micro_done)
            loss_sum, n_samples = torch.zeros((), device=ctx.device), 0
            for i in range(n_micro):
                t_wait = time.perf_counter()
                if i == 0:
                    knobs.before_fetch()
                x, y = next(batches)
                x = x.to(ctx.device, non_blocking=True)
                y = y.to(ctx.device, non_blocking=True)
                wait += time.perf_counter() - t_wait
                # Only the last micro-batch all-reduces gradients (no_sync skips the others).
                sync = contextlib.nullcontext() if i == n_micro - 1 else ddp.no_sync()
                with sync:
                    with _autocast(cfg, ctx.device):
                        loss = F.cross_entropy(forward(x), y)
                    (loss / n_micro).backward()
                loss_sum += loss.detach()  # one device sync per step (below), not per micro-batch
                n_samples += y.numel()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            knobs.after_step(step + 1)
            step += 1
            micro_done += n_micro
            dt = time.perf_counter() - t_step
            train_seconds += dt
            samples_seen += n_samples
            mean_loss = loss_sum.item() / n_micro
            telemetry.step(step=step, epoch=epoch, loss=mean_loss, samples=n_samples,
                           step_seconds=dt, data_wait_seconds=wait, timestamp=time.time())
            if step % cfg.log_every_steps == 0 or step == total_steps:
                telemetry.gpu_memory(torch, ctx.device)
                lr = sched.get_last_lr()[0]
                log.info(f"epoch {epoch} step {step}/{total_steps} loss {mean_loss:.4f} lr {lr:.4g}")
                log.metrics({"train_loss": mean_loss, "lr": lr}, step=step)
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                save()
        if micro_done >= micro_per_epoch:
            last_eval = evaluate(model, data.val, cfg=cfg, ctx=ctx)
            telemetry.eval(accuracy=last_eval.accuracy, loss=last_eval.loss)
            log.info(f"epoch {epoch} eval accuracy {last_eval.accuracy:.4f} loss {last_eval.loss:.4f} "
                     f"({last_eval.samples}/{last_eval.dataset_size} samples)")
            log.metrics({"eval_accuracy": last_eval.accuracy, "eval_loss": last_eval.loss}, step=step)
            epoch, micro_done = epoch + 1, 0
            save()
    if last_eval is None:  # stopped by maxSteps mid-epoch, or nothing left to do after a resume
        last_eval = evaluate(model, data.val, cfg=cfg, ctx=ctx)
        telemetry.eval(accuracy=last_eval.accuracy, loss=last_eval.loss)
        save()
    # Global throughput: every rank processed about the same number of samples in the same time.
    rate = torch.tensor([samples_seen, train_seconds], dtype=torch.float64)
    dist.all_reduce(rate)
    throughput = float(rate[0] / (rate[1] / ctx.world_size)) if rate[1] > 0 else 0.0
    result = RunResult(
        steps=step, total_steps=total_steps, epochs_completed=epoch, world_size=ctx.world_size,
        resumed_from_step=resumed_from, train_samples_per_second=throughput,
        eval_accuracy=last_eval.accuracy, eval_loss=last_eval.loss, eval_samples=last_eval.samples,
        eval_dataset_size=last_eval.dataset_size,
        last_checkpoint=str(Path(cfg.checkpoint.dir) / step_dir_name(step)) if ckpt else None)
    if ctx.is_main and result_path:
        _write_json_atomic(result_path, asdict(result))
    log.info(f"done: {step} steps, eval accuracy {last_eval.accuracy:.4f}, "
             f"{throughput:.0f} samples/s")
    return result
