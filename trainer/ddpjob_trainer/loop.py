"""The DDP training loop: data, model, optimizer, checkpoints, exact evaluation, telemetry."""
from __future__ import annotations

import contextlib
import datetime as dt
import inspect
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
from torch.utils.data import DataLoader

from . import contract, debug, rng, tuning
from .checkpoint import Checkpointer, check_resumable, step_dir_name
from .collectives import Collectives
from .config import TrainerConfig
from .data import PerSampleSeeded, ResumableSampler, build_data, eval_loader, loader_kwargs
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


def _no_forward_buffer_broadcast() -> dict[str, bool]:
    """DDP option that stops the per-forward buffer broadcast (renamed in newer torch)."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def wrap_ddp(model: torch.nn.Module, cfg: TrainerConfig, device: torch.device) -> DDP:
    """DDP with every option set explicitly (config.DdpConfig documents each)."""
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               gradient_as_bucket_view=True, bucket_cap_mb=cfg.ddp.bucket_cap_mb,
               static_graph=tuning.static_graph(cfg), **_no_forward_buffer_broadcast())


@dataclass(frozen=True)
class _Placement:
    """Where and in which format/precision batches meet the model."""

    device: torch.device
    amp_dtype: torch.dtype | None
    channels_last: bool

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(self.device, non_blocking=True)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def autocast(self):
        return tuning.autocast(self.device, self.amp_dtype)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, *, dataset_size: int, place: _Placement,
             comm: Collectives) -> EvalResult:
    """Every validation sample counted exactly once across ranks (no DistributedSampler padding).

    Call with BatchNorm buffers already synced (Collectives.sync_buffers), so every rank
    evaluates the same model: the one a checkpoint of this moment holds.
    """
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=place.device)  # loss, correct, count
    for x, y in loader:
        x, y = place.batch(x, y)
        with place.autocast():
            logits = model(x)
        sums[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        sums[1] += (logits.argmax(1) == y).sum()
        sums[2] += y.numel()
    loss_sum, correct, count = comm.sum(sums).tolist()  # the one host read of the evaluation
    model.train()
    count = int(count)
    return EvalResult(accuracy=correct / count, loss=loss_sum / count, samples=count,
                      dataset_size=dataset_size)


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def train(cfg: TrainerConfig, ctx: DistContext, *, log: NullReporter, telemetry: Telemetry,
          result_path: str | None = None) -> RunResult:
    """Run (or resume) training to completion; every rank calls this."""
    knobs = debug.Knobs.from_env(rank=ctx.rank)

    def enter(stage: str) -> None:
        telemetry.set_stage(stage)
        knobs.at_stage(stage)

    # Data, model and the first step's collectives: a hang here is named "first_step".
    enter("first_step")
    rng.seed_all(cfg.seed + ctx.rank)
    tuning.apply_backend_switches(cfg, ctx.device)
    comm = Collectives(ctx.device)
    place = _Placement(device=ctx.device, amp_dtype=tuning.autocast_dtype(cfg, ctx.device, log=log),
                       channels_last=tuning.use_channels_last(cfg, ctx.device))
    data = build_data(cfg)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, data.input_shape, data.num_classes).to(ctx.device)
    if place.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = wrap_ddp(model, cfg, ctx.device)
    forward = torch.compile(ddp) if cfg.compile else ddp
    has_buffers = any(b.numel() for b in model.buffers())

    workers = tuning.resolve_num_workers(cfg, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    io = {"workers": workers, "prefetch_factor": cfg.prefetch_factor, "pin_memory": ctx.device.type == "cuda"}
    sampler = ResumableSampler(data.train, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                               seed=cfg.seed, tag_epoch=data.random_train_transform)
    train_set = PerSampleSeeded(data.train, seed=cfg.seed) if data.random_train_transform else data.train
    # The loader's own generator: creating an iterator must not draw from the global RNG,
    # or a resumed run's dropout stream would differ from an uninterrupted one.
    loader_rng = torch.Generator()
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, generator=loader_rng,
                        **loader_kwargs(**io))
    val_loader = eval_loader(data.val, rank=ctx.rank, world_size=ctx.world_size,
                             batch_size=cfg.batch_size, **io)
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
                            barrier=comm.barrier, broadcast=comm.broadcast_object, log=log,
                            async_save=cfg.checkpoint.async_save)
        loaded = ckpt.load_latest(map_location=ctx.device)
        if loaded:
            c = loaded.common
            check_resumable(c, path=loaded.path, world_size=ctx.world_size, batch_size=cfg.batch_size,
                            grad_accum_steps=cfg.grad_accum_steps)
            model.load_state_dict(c["model"])
            opt.load_state_dict(c["optimizer"])
            sched.load_state_dict(c["scheduler"])
            step, epoch, micro_done = c["step"], c["epoch"], c["micro_done"]
            resumed_from = step
            if loaded.rank_state:
                rng.set_state(loaded.rank_state["rng"])
            log.info(f"resumed from {loaded.path} at step {step} (epoch {epoch}, batch {micro_done})")

    telemetry.set_total_steps(total_steps)
    telemetry.set_restart_count(int(os.environ.get(contract.ENV_ATTEMPT, "0")))
    log.params({"world_size": ctx.world_size, "backend": ctx.backend, "resolved_num_workers": workers,
                "amp_dtype": str(place.amp_dtype), "channels_last": place.channels_last,
                "static_graph": tuning.static_graph(cfg),
                **{k: v for k, v in asdict(cfg).items() if not isinstance(v, dict)}})
    log.info(f"training {cfg.model} on {cfg.dataset}: world size {ctx.world_size} ({ctx.backend}), "
             f"{len(data.train)} train / {len(data.val)} val samples, {total_steps} steps, "
             f"{workers} data workers per rank")

    synced_at: list[int | None] = [None]

    def sync_buffers() -> None:
        """BatchNorm statistics made identical on every rank (once per step at most)."""
        if has_buffers and synced_at[0] != step:
            comm.sync_buffers(model, mode=cfg.ddp.buffer_sync)
            synced_at[0] = step

    def save() -> None:
        if not ckpt or ckpt.last_saved_step == step:
            return
        enter("checkpoint")
        t0 = time.perf_counter()
        sync_buffers()
        common = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                  "scheduler": sched.state_dict(), "step": step, "epoch": epoch,
                  "micro_done": micro_done, "world_size": ctx.world_size, "config": cfg.to_dict()}
        path = ckpt.save(step=step, common=common, rank_state={"rng": rng.get_state()})
        seconds = time.perf_counter() - t0  # how long training stood still for it
        telemetry.checkpoint(seconds)
        how = "being written in the background" if cfg.checkpoint.async_save else "written"
        log.info(f"checkpoint {path}: training paused {seconds:.2f}s ({how})")
        enter("training")

    def run_eval() -> EvalResult:
        enter("eval")
        sync_buffers()
        result = evaluate(model, val_loader, dataset_size=len(data.val), place=place, comm=comm)
        telemetry.eval(accuracy=result.accuracy, loss=result.loss)
        enter("training")
        return result

    cuda = ctx.device.type == "cuda"
    train_seconds, samples_seen, last_eval, eval_step = 0.0, 0, None, -1
    timeout_shortened = not cfg.step_timeout_seconds
    ddp.train()
    while epoch < cfg.epochs and step < total_steps:
        if micro_done >= micro_per_epoch:  # a checkpoint taken exactly at an epoch's end
            epoch, micro_done = epoch + 1, 0
            continue
        sampler.set_epoch(epoch, start=micro_done * cfg.batch_size)
        loader_rng.manual_seed(cfg.seed * 100_003 + epoch * 1009 + ctx.rank)
        batches = iter(loader)
        boundary = time.perf_counter()  # step time runs from one step boundary to the next
        while micro_done < micro_per_epoch and step < total_steps:
            telemetry.step_started(step=step + 1)
            wait = 0.0
            n_micro = min(cfg.grad_accum_steps, micro_per_epoch - micro_done)
            loss_sum, n_samples = None, 0
            for i in range(n_micro):
                t_wait = time.perf_counter()
                if i == 0:
                    knobs.before_fetch()
                x, y = place.batch(*next(batches))
                wait += time.perf_counter() - t_wait
                # Only the last micro-batch all-reduces gradients (no_sync skips the others).
                sync = contextlib.nullcontext() if i == n_micro - 1 else ddp.no_sync()
                with sync:
                    with place.autocast():
                        loss = F.cross_entropy(forward(x), y)
                    (loss / n_micro).backward()
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
                n_samples += y.numel()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            knobs.after_step(step + 1)
            step += 1
            micro_done += n_micro
            epoch_end = micro_done >= micro_per_epoch
            log_step = step % cfg.log_every_steps == 0 or step == total_steps
            save_step = bool(cfg.checkpoint.every_steps) and step % cfg.checkpoint.every_steps == 0
            # The host reads the loss (a device sync) only at log steps; elsewhere the GPU runs
            # ahead. Before an eval or checkpoint the step's queued work is finished here, so
            # its time is charged to the step and not to what follows.
            mean_loss = loss_sum.item() / n_micro if log_step else None
            if cuda and not log_step and (save_step or epoch_end):
                torch.cuda.synchronize(ctx.device)
            now = time.perf_counter()
            dt_step, boundary = now - boundary, now
            train_seconds += dt_step
            samples_seen += n_samples
            telemetry.step(step=step, epoch=epoch, loss=mean_loss, samples=n_samples,
                           step_seconds=dt_step, data_wait_seconds=wait, timestamp=time.time())
            if not timeout_shortened:
                # Start-up (rendezvous, first NCCL communicator, compile) is over: from here a
                # collective that hangs this long means a dead or stuck peer.
                dist.set_timeout(dt.timedelta(seconds=cfg.step_timeout_seconds))
                timeout_shortened = True
            if log_step:
                telemetry.gpu_memory(torch, ctx.device)
                lr = sched.get_last_lr()[0]
                log.info(f"epoch {epoch} step {step}/{total_steps} loss {mean_loss:.4f} lr {lr:.4g}")
                log.metrics({"train_loss": mean_loss, "lr": lr}, step=step)
            if save_step:
                save()
                boundary = time.perf_counter()
        if micro_done >= micro_per_epoch:
            last_eval, eval_step = run_eval(), step
            log.info(f"epoch {epoch} eval accuracy {last_eval.accuracy:.4f} loss {last_eval.loss:.4f} "
                     f"({last_eval.samples}/{last_eval.dataset_size} samples)")
            log.metrics({"eval_accuracy": last_eval.accuracy, "eval_loss": last_eval.loss}, step=step)
            epoch, micro_done = epoch + 1, 0
            save()
    if last_eval is None or eval_step != step:  # stopped by maxSteps mid-epoch, or resumed at the end
        last_eval, eval_step = run_eval(), step
        save()
    if ckpt:
        ckpt.wait()
    # Global throughput: every rank processed about the same number of samples in the same time.
    total_samples, total_seconds = comm.sum([samples_seen, train_seconds]).tolist()
    throughput = total_samples / (total_seconds / ctx.world_size) if total_seconds > 0 else 0.0
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
