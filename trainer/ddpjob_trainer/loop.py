"""The DDP training loop: data, model, optimizer, checkpoints, exact evaluation, telemetry."""
from __future__ import annotations

import contextlib
import datetime as dt
import inspect
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from . import debug, preempt, rng, torchapi, tuning
from ddpjob_api import contract
from .checkpointing.manager import CheckpointManager, TrainState
from .collectives import Collectives
from ddpjob_api.contract import RunResult
from .config import TrainerConfig
from .data import PerSampleSeeded, ResumableSampler, advance, build_data, eval_loader, loader_kwargs, steps_left
from .dist import DistContext
from .errors import PeerStopped
from .faulttolerance import LINE, FaultTolerance, FtEnv, reporting_group, weights_hash
from .models import build_model
from .reporting import NullReporter, Terminated
from .telemetry import DeviceTimer, Telemetry, rank_goodput
from .tracking import goodput_metrics


@dataclass
class EvalResult:
    """Exact evaluation over the whole validation set."""

    accuracy: float
    loss: float
    samples: int
    dataset_size: int


def _build_optimizer(cfg: TrainerConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


@dataclass
class Schedule:
    """The learning-rate factor of each optimizer step: linear warmup to lr, then cosine to 0 at the
    last step (or constant).

    A run resumed at another world size has another number of steps left (data.steps_left): the
    decay is re-anchored at the resumed step, `anchor` = (step, progress reached there), and goes
    on from that progress to 1 at the new last step, with no jump. Unanchored it is the plain
    (step - warmup) / (total - warmup).
    """

    kind: str
    warmup: int
    total: int
    anchor: tuple[int, float] | None = None

    def progress(self, step: int) -> float:
        s0, p0 = self.anchor or (self.warmup, 0.0)
        return p0 + (1.0 - p0) * (step - s0) / max(1, self.total - s0)

    def factor(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, self.progress(step))))


def lr_scale(cfg: TrainerConfig, *, world_size: int, first_world_size: int) -> float:
    """spec.trainer.lrScaling: lr is the learning rate at the world size the run started at; at
    another one the global batch (batchSize x gradAccumSteps x world size) changed with it, and
    `linear` scales the learning rate by the same ratio (the linear scaling rule), `none` keeps it."""
    return world_size / first_world_size if cfg.lr_scaling == "linear" else 1.0


def _no_forward_buffer_broadcast() -> dict[str, Any]:
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


@dataclass
class StepOutput:
    """One optimizer step. The loss stays on the device: reading it is a host sync."""

    loss_sum: torch.Tensor  # summed over the step's micro-batches
    micro_batches: int
    samples: int
    data_wait_seconds: float
    # False: a per-step job's quorum did not agree (a group was lost mid-step); nothing was applied.
    committed: bool = True


class Trainer:
    """One rank's run of the built-in trainer.

    The constructor builds everything (data, model, optimizer, schedule, loaders, checkpoints);
    `restore` resumes from the newest complete checkpoint; `train_step` runs one optimizer step;
    `evaluate` measures the whole validation set; `save` writes a checkpoint; `fit` runs to the
    end. A variant (another loss, another model) overrides `loss` or `build_model` instead of
    copying the loop.
    """

    def __init__(self, cfg: TrainerConfig, ctx: DistContext, *, log: NullReporter, telemetry: Telemetry) -> None:
        self.cfg, self.ctx, self.log, self.telemetry = cfg, ctx, log, telemetry
        # Per-step fault tolerance (spec.faultTolerance): set when the pod's env names a Lighthouse.
        self.ft: Any = None
        fe = FtEnv.from_env()
        # The training data's split: over the job's ranks; in a per-step job over every group's.
        self.data_rank, self.data_world = fe.data_split(rank=ctx.rank, world_size=ctx.world_size) if fe else (
            ctx.rank, ctx.world_size)
        # Rank 0 of the job (of group 0 in a per-step job) writes the result and the run's record.
        self.reports = ctx.is_main and reporting_group()
        self.knobs = debug.Knobs.from_env(rank=self.data_rank)  # a per-step job's knobs name its ranks across groups
        # Data, model and the first step's collectives: a hang here is named "first_step".
        self.enter("first_step")
        rng.seed_all(cfg.seed + ctx.rank)
        tuning.apply_backend_switches(cfg, ctx.device)
        self.comm = Collectives(ctx.device)
        self.place = _Placement(device=ctx.device, amp_dtype=tuning.autocast_dtype(cfg, ctx.device, log=log),
                                channels_last=tuning.use_channels_last(cfg, ctx.device))
        self.data = data = build_data(cfg)
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.model = self.build_model()
        # DDP around the compiled module, not torch.compile around DDP: compiling the wrapper breaks
        # the graph in DDP's own forward (its C++ logger; `_inside_ddp_forward` is skipped) and, on
        # torch 2.8 and 2.15 alike, nothing gets compiled at all (tests/trainer: test_compile).
        # self.model stays the plain module, so checkpoints carry no `_orig_mod.` prefix.
        inner = cast(torch.nn.Module, torch.compile(self.model)) if cfg.compile else self.model
        self.ddp = wrap_ddp(inner, cfg, ctx.device)
        self.forward = self.ddp
        self.has_buffers = any(b.numel() for b in self.model.buffers())
        self.device_timer = DeviceTimer.for_device(ctx.device)

        self.workers = tuning.resolve_num_workers(
            cfg, local_world_size=int(os.environ.get(contract.TORCHRUN_LOCAL_WORLD_SIZE, "1")))
        io: dict[str, Any] = {"workers": self.workers, "prefetch_factor": cfg.prefetch_factor,
              "pin_memory": ctx.device.type == "cuda"}
        self.train_size = len(data.train)  # type: ignore[arg-type]  # torch's Dataset is not Sized; ours are
        self.sampler = ResumableSampler(data.train, num_replicas=self.data_world, rank=self.data_rank, seed=cfg.seed,
                                        tag_epoch=data.random_train_transform)
        train_set = PerSampleSeeded(data.train, seed=cfg.seed) if data.random_train_transform else data.train
        # The loader's own generator: creating an iterator must not draw from the global RNG,
        # or a resumed run's dropout stream would differ from an uninterrupted one.
        self.loader_rng = torch.Generator()
        self.loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=self.sampler,
                                 generator=self.loader_rng, **loader_kwargs(**io))
        self.val_loader = eval_loader(data.val, rank=ctx.rank, world_size=ctx.world_size,
                                      batch_size=cfg.batch_size, **io)
        self.micro_left = math.ceil(len(self.sampler) / cfg.batch_size)  # this rank's, left in the current epoch
        self.state = TrainState()
        self.total_steps = self.steps_to_end(self.state, self.data_world)
        self.schedule = Schedule(kind=cfg.scheduler, warmup=cfg.warmup_steps, total=self.total_steps)
        self.opt = _build_optimizer(cfg, self.ddp.parameters())
        schedule = self.schedule  # a plain function: LambdaLR would save any other callable's attributes
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda step: schedule.factor(step))
        self.ckpt = CheckpointManager(
            cfg, ctx, train_size=self.train_size, model=self.model, optimizer=self.opt, scheduler=self.sched, log=log,
            telemetry=telemetry, stage=self.enter, sync_buffers=self.sync_buffers,
            write_bandwidth=self.knobs.write_bandwidth) if cfg.checkpoint.dir else None
        self._synced_at: int | None = None
        # A stop (SIGTERM) is acted on at step boundaries only in a run that checkpoints: there
        # is nothing to save otherwise, and SIGTERM keeps its plain meaning.
        self.stop_request = preempt.StopRequest(preempt.stop_budget()) if self.ckpt else None
        self.stop_vote = preempt.StopVote(ctx.vote_group) if self.ckpt else None
        if fe is not None:
            self.ft = FaultTolerance(fe, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device,
                                     optimizer=self.opt, state_dict=self.ft_state_dict,
                                     load_state_dict=self.ft_load_state_dict, log=self.log.info)

    def ft_state_dict(self) -> dict[str, Any]:
        """Everything a group that joins a per-step job takes from a live peer."""
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "train": asdict(self.state)}

    def ft_load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])
        self.sched.load_state_dict(sd["scheduler"])
        for k, v in sd["train"].items():  # in place: the loop holds self.state
            setattr(self.state, k, v)

    def enter(self, stage: str) -> None:
        self.telemetry.set_stage(stage)
        self.knobs.at_stage(stage)

    def build_model(self) -> torch.nn.Module:
        """The bare model on this rank's device (DDP wraps it afterwards)."""
        model = build_model(self.cfg.model, self.data.input_shape, self.data.num_classes).to(self.ctx.device)
        if self.place.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets)

    def steps_to_end(self, st: TrainState, world_size: int) -> int:
        """The run's last step, from `st` on at this world size (maxSteps caps it)."""
        cfg = self.cfg
        total = st.step + steps_left(self.train_size, epoch=st.epoch, samples_done=st.samples_done, epochs=cfg.epochs,
                                     world_size=world_size, batch_size=cfg.batch_size,
                                     grad_accum_steps=cfg.grad_accum_steps)
        return min(total, cfg.max_steps) if cfg.max_steps else total

    def restore(self) -> int:
        """Resume from the newest complete checkpoint or snapshot; the step resumed from (0: none).

        At another world size than the one that wrote it (an elastic job that shrank or grew), the
        rest of the epoch is re-split over the new ranks (the position is a global sample offset),
        the steps left are recounted, and the learning rate follows lrScaling (lr_scale)."""
        loaded = self.ckpt.load() if self.ckpt else None
        if loaded is None:
            return 0
        self.state, world = loaded, self.ctx.world_size
        resized = loaded.written_at != world
        if resized:
            loaded.schedule_from = self._progress_kept(loaded)
        self.total_steps = self.schedule.total = self.steps_to_end(loaded, self.data_world)
        self.schedule.anchor = loaded.schedule_from
        if resized:
            self._follow_world_size(loaded)
        return loaded.step

    def _progress_kept(self, st: TrainState) -> tuple[int, float] | None:
        """The schedule's anchor after a resize: the decay's progress at the resumed step as the run
        had it, counted at the world size that wrote `st` (none while still warming up)."""
        cfg = self.cfg
        if st.step <= cfg.warmup_steps:
            return st.schedule_from
        before = Schedule(kind=cfg.scheduler, warmup=cfg.warmup_steps, total=self.steps_to_end(st, st.written_at),
                          anchor=st.schedule_from)
        return st.step, min(1.0, before.progress(st.step))

    def _follow_world_size(self, st: TrainState) -> None:
        """The learning rate for this world size (lrScaling), from the resumed step on."""
        cfg, old, new = self.cfg, st.written_at, self.ctx.world_size
        base = cfg.lr * lr_scale(cfg, world_size=new, first_world_size=st.first_world_size)
        self.sched.base_lrs = [base for _ in self.opt.param_groups]
        for group in self.opt.param_groups:
            group["initial_lr"], group["lr"] = base, base * self.schedule.factor(st.step)
        batch = cfg.batch_size * cfg.grad_accum_steps
        self.log.info(f"resized from world size {old} to {new}: the {self.train_size - st.samples_done} samples left "
                      f"of epoch {st.epoch} re-split over the new ranks, global batch {batch * old} -> {batch * new}, "
                      f"lr {base:.4g} (lrScaling {cfg.lr_scaling}, first world size {st.first_world_size}), "
                      f"{self.total_steps - st.step} steps left")

    def sync_buffers(self) -> None:
        """BatchNorm statistics made identical on every rank (once per step at most)."""
        if self.has_buffers and self._synced_at != self.state.step:
            self.comm.sync_buffers(self.model, mode=self.cfg.ddp.buffer_sync)
            self._synced_at = self.state.step

    def writes_here(self) -> bool:
        """Whether this rank's group writes the run's checkpoints at this step: always, but in a
        per-step job, where one group a step does (FaultTolerance.writes_checkpoints)."""
        return self.ft is None or self.ft.writes_checkpoints()

    def save(self) -> None:
        """A checkpoint of this step (once: a second call for the same step does nothing)."""
        if self.ckpt and self.writes_here():
            self.ckpt.save(self.state)

    def check_stop(self, step_seconds: float) -> None:
        """At a step boundary: when a rank was sent SIGTERM, save if the save fits in its grace
        (preempt.plan), then end this rank (preempt's docstring)."""
        ckpt, request = self.ckpt, self.stop_request
        if request is None or self.stop_vote is None or ckpt is None:
            return
        self.knobs.before_stop_vote(self.state.step, sigterm_noted=lambda: request.at is not None)
        agreed = self.stop_vote.cast(left=request.left(), last_save=ckpt.last_seconds,
                                     step_seconds=step_seconds)
        if agreed is None or math.isinf(agreed.left):
            return
        self.stop_vote.finish()
        save, why = preempt.plan(left=agreed.left, last_save=agreed.last_save, estimate=ckpt.estimate_save(self.state),
                                 step_seconds=agreed.step_seconds, saved=ckpt.saved(self.state.step))
        if save and not self.writes_here():
            save, why = False, "another replica group writes this per-step job's checkpoints"
        where = f"step {self.state.step} (epoch {self.state.epoch}, sample {self.state.samples_done})"
        if save:
            self.log.info(f"stop requested (SIGTERM): saving a checkpoint at {where}: {why}")
            self.save()
        ckpt.wait()  # a write in flight, this one's or an earlier one's, is published before the end
        if save:
            self.log.info(f"stop: checkpoint {ckpt.path(self.state.step)} saved in "
                          f"{ckpt.last_seconds:.2f}s; the next attempt resumes from it")
        else:
            self.log.info(f"stop requested (SIGTERM) at {where}: no checkpoint saved: {why}")
        if request.at is not None:
            raise Terminated(signal.SIGTERM)
        raise PeerStopped(f"rank {self.ctx.rank} stops with its group: a rank on another node was sent SIGTERM "
                          f"at {where}" + (" (checkpoint saved)" if save else ""))

    def evaluate(self) -> EvalResult:
        self.enter("eval")
        self.sync_buffers()
        result = evaluate(self.model, self.val_loader, dataset_size=len(self.data.val), place=self.place,  # type: ignore[arg-type]
                          comm=self.comm)
        self.telemetry.eval(accuracy=result.accuracy, loss=result.loss)
        self.enter("training")
        return result

    def train_step(self, batches) -> StepOutput:
        """One optimizer step over up to grad_accum_steps micro-batches drawn from `batches`."""
        cfg, ddp = self.cfg, self.ddp
        wait = 0.0
        n_micro = min(cfg.grad_accum_steps, self.micro_left)
        loss_sum, n_samples = None, 0
        for i in range(n_micro):
            t_wait = time.perf_counter()
            if i == 0:
                self.knobs.before_fetch(self.state.step + 1)
            x, y = self.place.batch(*next(batches))
            wait += time.perf_counter() - t_wait
            # Only the last micro-batch all-reduces gradients (no_sync skips the others).
            sync = contextlib.nullcontext() if i == n_micro - 1 else ddp.no_sync()
            with sync:
                self.device_timer.start()
                with self.place.autocast():
                    loss = self.loss(self.forward(x), y)
                self.device_timer.stop()
                (loss / n_micro).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            n_samples += y.numel()
        out = StepOutput(loss_sum=loss_sum, micro_batches=n_micro, samples=n_samples, data_wait_seconds=wait)
        if self.ft is None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:  # a per-step job: averaged over the groups, committed if the quorum agrees
            self.ft.average(self.model.parameters())
            out.committed = self.ft.commit()
        self.device_timer.end_step()
        if not out.committed:
            return out
        self.sched.step()
        self.knobs.after_step(self.state.step + 1)
        self.state.step = self.state.step + 1 if self.ft is None else self.ft.step()  # the quorum's (a healed group's jumps)
        self.micro_left -= n_micro
        self.state.samples_done = advance(self.state.samples_done, taken=n_samples, world_size=self.data_world,
                                          n=self.train_size)
        return out

    def _position(self):
        """The training data from where the state says (epoch, samples done): a new iterator."""
        cfg, st = self.cfg, self.state
        self.sampler.set_epoch(st.epoch, start=st.samples_done)
        self.micro_left = math.ceil(len(self.sampler) / cfg.batch_size)
        self.loader_rng.manual_seed(cfg.seed * 100_003 + st.epoch * 1009 + self.data_rank)
        return iter(self.loader)

    def _ft_line(self, what: str, after: str = "") -> None:
        """A per-step job's greppable line (faulttolerance.LINE): what happened, then the weights' hash."""
        self.log.info(f"{LINE} {what} weights {weights_hash(self.model)}{after}")

    def _eval_and_log(self) -> EvalResult:
        result = self.evaluate()
        self.log.info(f"epoch {self.state.epoch} eval accuracy {result.accuracy:.4f} loss {result.loss:.4f} "
                      f"({result.samples}/{result.dataset_size} samples)")
        self.log.metrics({"eval_accuracy": result.accuracy, "eval_loss": result.loss}, step=self.state.step)
        return result

    def fit(self) -> RunResult:
        """Run (or resume) training to completion; every rank calls this."""
        if self.stop_request is None:
            return self._fit()
        self.stop_request.install()
        try:
            result = self._fit()
            if self.stop_vote is not None:
                self.stop_vote.finish()  # the last boundary's ballot, cast by every rank
            return result
        finally:
            self.stop_request.restore()

    def resolved_config(self) -> dict[str, Any]:
        """The whole trainer config as this run resolved it (defaults applied, `auto`s decided): the
        run's params, and its record at the end."""
        cfg, ctx = self.cfg, self.ctx
        return {"world_size": ctx.world_size, "backend": ctx.backend, "resolved_num_workers": self.workers,
                "amp_dtype": str(self.place.amp_dtype), "channels_last": self.place.channels_last,
                "static_graph": tuning.static_graph(cfg), "total_steps": self.total_steps, **asdict(cfg)}

    def _fit(self) -> RunResult:
        cfg, ctx, log, telemetry = self.cfg, self.ctx, self.log, self.telemetry
        ft = self.ft
        resumed_from = self.restore()
        st = self.state
        if ft is not None and resumed_from:
            ft.resumed_at(resumed_from)
        telemetry.set_total_steps(self.total_steps)
        attempt = int(os.environ.get(contract.ENV_ATTEMPT, "0"))
        telemetry.set_restart_count(attempt)
        telemetry.resumed_from(resumed_from)
        telemetry.gpu_info(torch, ctx.device)
        log.params(self.resolved_config())  # nested sections flattened by the reporter, logged once per run
        # Restarts before this start: the group's, and this pod's in place within the attempt.
        log.metrics({"restarts": attempt + int(os.environ.get(contract.ENV_RESTART, "0") or 0)}, step=st.step)
        log.info(f"training {cfg.model} on {cfg.dataset}: world size {ctx.world_size} ({ctx.backend}), "
                 f"{len(self.data.train)} train / {len(self.data.val)} val samples, {self.total_steps} steps, "  # type: ignore[arg-type]
                 f"{self.workers} data workers per rank")

        cuda = ctx.device.type == "cuda"
        train_seconds, samples_seen, last_eval, eval_step = 0.0, 0, None, -1
        interval = [0, 0.0, 0.0, 0]  # since the last log step: steps, seconds, data wait, samples
        timeout_shortened = not cfg.step_timeout_seconds
        self.ddp.train()
        while st.epoch < cfg.epochs and st.step < self.total_steps:
            if st.samples_done >= self.train_size:  # a checkpoint taken exactly at an epoch's end
                st.epoch, st.samples_done = st.epoch + 1, 0
                continue
            batches = self._position()
            taken = 0  # of this rank's share
            boundary = time.perf_counter()  # step time runs from one step boundary to the next
            while self.micro_left and st.step < self.total_steps:
                telemetry.step_started(step=st.step + 1)
                if ft is not None and ft.start_step():  # this group took a live peer's state: go on from there
                    self._ft_line(f"joined at step {st.step} from a peer,")
                    batches, taken = self._position(), 0
                    if not self.micro_left or st.step >= self.total_steps:
                        break
                out = self.train_step(batches)
                if not out.committed:  # the step is taken again, on the same data, by the new quorum
                    batches, taken = self._position(), 0
                    continue
                self.knobs.record_samples(st.step, st.epoch, self.sampler.share[taken:taken + out.samples])
                taken += out.samples
                epoch_end = not self.micro_left
                log_step = st.step % cfg.log_every_steps == 0 or st.step == self.total_steps
                save_step = self.ckpt is not None and self.ckpt.due(st.step)
                # The host reads the loss (a device sync) only at log steps; elsewhere the GPU runs
                # ahead. Before an eval or checkpoint the step's queued work is finished here, so
                # its time is charged to the step and not to what follows.
                mean_loss = out.loss_sum.item() / out.micro_batches if log_step else None
                if cuda and not log_step and (save_step or epoch_end):
                    torch.cuda.synchronize(ctx.device)
                now = time.perf_counter()
                dt_step, boundary = now - boundary, now
                train_seconds += dt_step
                samples_seen += out.samples
                interval = [a + b for a, b in zip(interval, (1, dt_step, out.data_wait_seconds, out.samples))]
                telemetry.step(step=st.step, epoch=st.epoch, loss=mean_loss, samples=out.samples,
                               step_seconds=dt_step, data_wait_seconds=out.data_wait_seconds,
                               timestamp=time.time())
                if not timeout_shortened:
                    # Start-up (rendezvous, first NCCL communicator, compile) is over: from here a
                    # collective that hangs this long means a dead or stuck peer.
                    if not torchapi.set_timeout(dt.timedelta(seconds=cfg.step_timeout_seconds)):
                        log.warning(f"torch {torch.__version__} cannot shorten a gloo group's timeout: a dead "
                                    f"peer is noticed after timeoutSeconds ({cfg.timeout_seconds} s), not "
                                    f"stepTimeoutSeconds ({cfg.step_timeout_seconds} s)")
                    timeout_shortened = True
                if log_step:
                    telemetry.gpu_memory(torch, ctx.device)
                    telemetry.compute(self.device_timer.read())
                    lr = float(self.sched.get_last_lr()[0])
                    log.info(f"epoch {st.epoch} step {st.step}/{self.total_steps} loss {mean_loss:.4f} lr {lr:.4g}")
                    n, secs, wait, samples = interval
                    interval = [0, 0.0, 0.0, 0]
                    # Global samples/s: every rank takes the same number of samples per step.
                    tracked = {"train_loss": mean_loss, "lr": lr, "step_seconds": secs / n,
                               "data_wait_seconds": wait / n,
                               "samples_per_second": samples * ctx.world_size / secs if secs > 0 else 0.0}
                    if cuda:
                        tracked["gpu_memory_max_allocated_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
                    log.metrics(tracked, step=st.step)
                    if ft is not None:
                        self._ft_line(f"step {st.step} participants {ft.participants()}", f" quorum {ft.quorum_id()}")
                if self.ckpt and self.writes_here() and self.ckpt.maybe_save(st, epoch_end=epoch_end):
                    boundary = time.perf_counter()
                if self.knobs.hold(st.step, alive=telemetry.renew_stage):
                    boundary = time.perf_counter()
                self.check_stop(dt_step)
            if not self.micro_left:
                last_eval, eval_step = self._eval_and_log(), st.step
                st.epoch, st.samples_done = st.epoch + 1, 0
                self.save()
        if last_eval is None or eval_step != st.step:  # stopped by maxSteps mid-epoch, or resumed at the end
            last_eval, eval_step = self.evaluate(), st.step
            log.metrics({"eval_accuracy": last_eval.accuracy, "eval_loss": last_eval.loss}, step=st.step)
            self.save()
        if self.ckpt:
            self.ckpt.close(train_seconds=train_seconds)
        if ft is not None:
            ft.shutdown()
        # Global throughput: every rank processed about the same number of samples in the same time.
        total_samples, total_seconds = self.comm.sum([samples_seen, train_seconds]).tolist()
        throughput = total_samples / (total_seconds / ctx.world_size) if total_seconds > 0 else 0.0
        return RunResult(
            steps=st.step, total_steps=self.total_steps, epochs_completed=st.epoch, world_size=ctx.world_size,
            resumed_from_step=resumed_from, train_samples_per_second=throughput,
            eval_accuracy=last_eval.accuracy, eval_loss=last_eval.loss, eval_samples=last_eval.samples,
            eval_dataset_size=last_eval.dataset_size,
            last_checkpoint=str(self.ckpt.path(st.step)) if self.ckpt else None)


def train(cfg: TrainerConfig, ctx: DistContext, *, log: NullReporter, telemetry: Telemetry,
          result_path: str | None = None) -> RunResult:
    """Run (or resume) training to completion; every rank calls this."""
    trainer = Trainer(cfg, ctx, log=log, telemetry=telemetry)
    result = trainer.fit()
    if trainer.reports:  # rank 0 alone (of group 0 in a per-step job), after the last collective
        log.record(trainer.resolved_config(), checkpoint=result.last_checkpoint)
        metrics_dir = os.environ.get(contract.ENV_METRICS_DIR)
        if telemetry.enabled and metrics_dir:
            log.metrics(goodput_metrics(rank_goodput(metrics_dir, ctx.rank)), step=result.steps)
        log.model(trainer.model)
    if trainer.reports and result_path:  # whole or not at all: written aside, then renamed
        with open(f"{result_path}.part", "w") as f:
            json.dump({**asdict(result), contract.RESULT_MLFLOW_RUN_ID: log.run_id}, f, indent=1)
        os.replace(f"{result_path}.part", result_path)
    log.info(f"done: {result.steps} steps, eval accuracy {result.eval_accuracy:.4f}, "
             f"{result.train_samples_per_second:.0f} samples/s")
    return result
