"""Per-rank Prometheus metrics (the prefix: contract.METRIC_PREFIX; the operator's scrape.py reads them).

Every local rank writes into a shared prometheus-client multiprocess directory
(DDPJOB_METRICS_DIR); the pod's launcher serves one endpoint over all of them.
Label children are bound once in __init__, so recording a step only writes a few
floats into an mmap (no label lookups, no per-step objects kept).

Your own training script (a `command:` job run under the launcher) gets the same
dashboards with a few lines::

    from ddpjob_trainer import telemetry
    tm = telemetry.Telemetry.from_env()
    tm.set_total_steps(epochs * len(loader))
    for epoch in range(epochs):
        for x, y in tm.track(loader, epoch=epoch):   # times data wait and each step
            loss = train_step(x, y)
            tm.record_loss(loss)                     # float or 0-d tensor

Set DDPJOB_TELEMETRY=0 to turn every call into a no-op.

Stages (what a hang before the first step is named by): `stage{stage=S}` is 1 for the stage the
rank is in and 0 for the others, `stage_start_timestamp_seconds` the Unix time it began. The pod's
launcher sets waiting_for_master and rendezvous for the ranks it is about to start; the built-in
trainer sets process_group_init, first_step, then training, eval and checkpoint. In your own
script, `track()` sets first_step and its first finished step training; `set_stage` sets any
other (e.g. `tm.set_stage("eval")` around your evaluation, then `tm.set_stage("training")`).

Where a rank's time went: `goodput_seconds_total{category=C}` (contract.GOODPUT_SECONDS) counts the
seconds of each category a rank sees: starting (from its node's launcher to its first step),
recovering (a restarted worker: from the failure its agent saw to its first step), training and
recomputing (its steps' time; recomputing the steps up to the one reached before that failure),
evaluating and checkpointing (the time in those stages, `set_stage`), stalled (counted by the
pod's agent when it kills a stalled worker). Queued and suspended are the operator's alone (no
rank runs then): status.goodput and docs/goodput.md hold the job's whole ledger.

Meaning (what the operator's detectors rely on): `step_seconds` is the whole optimizer step,
data wait included; `data_wait_seconds` is the part spent waiting for the batch. The built-in
trainer measures `step_seconds` from one step boundary to the next and lets a GPU run ahead of
the host between log steps, where it synchronizes: single samples may be short or long, their
sum over a log interval is the device's time. `loss` is sampled: the built-in trainer reads the
loss to the host only at log steps (logEverySteps), so the gauge shows the loss of the last log
step, never a value it did not read. A gauge never set
(e.g. eval_accuracy before the first evaluation, GPU memory on CPU) is not exported at all.

On a GPU, `compute_seconds` is each step's device time of its forward passes (loss included),
timed by CUDA events (DeviceTimer) and read at log steps, after the loss read has synchronized:
no per-step sync. Forward only, because it is the part of a step with no collective in it (DDP
all-reduces in backward and the trainer turns the forward buffer broadcast off): a rank waiting
for its peers never shows it, a throttled or slower GPU does, where the host's step time, which
runs ahead of the device under NCCL, cannot. `gpu_info{uuid, name}` is 1 for the rank's GPU; its
`uuid` is spelled as DCGM's `UUID` label ("GPU-..."), so DCGM's utilisation joins per rank.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

from ddpjob_api import contract

PREFIX = contract.METRIC_PREFIX
LABELS = ("ddpjob", "namespace", "rank", "local_rank", "node_rank")
GPU_INFO = PREFIX + "gpu_info"   # an info metric (labels uuid, name); bench/gpu_check.py reads it
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def rank_labels(env: Mapping[str, str], *, rank: Any, local_rank: Any, node_rank: Any) -> dict[str, str]:
    """A rank's LABELS: its job's (from the env) and its place in the job."""
    return {"ddpjob": env.get(contract.ENV_JOB_NAME, "local"), "namespace": env.get(contract.ENV_JOB_NAMESPACE, ""),
            "rank": str(rank), "local_rank": str(local_rank), "node_rank": str(node_rank)}


def _prepare_multiprocess() -> str | None:
    """Point prometheus-client at the shared dir (also if it was imported before the env was set)."""
    d = os.environ.get(contract.ENV_METRICS_DIR)
    if d:
        os.makedirs(d, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = d
        from prometheus_client import values

        # The value class is chosen when prometheus_client is first imported; fix it up if
        # that happened before DDPJOB_METRICS_DIR was known (otherwise nothing reaches the dir).
        if not getattr(values.ValueClass, "_multiprocess", False):
            values.ValueClass = values.get_value_class()
    return d


class Telemetry:
    """Metrics of one rank; use `Telemetry.from_env()` inside a torchrun worker."""

    def __init__(self, *, labels: dict[str, str], enabled: bool = True, started_at: float | None = None,
                 restarted: bool = False, step_reached: int | None = None) -> None:
        """`started_at`: when this rank's start began (its node's launcher; a restarted worker: the
        failure); `restarted`: that start is a recovery; `step_reached`: the newest step the rank's
        pod had finished before the failure (its steps up to it are recomputed)."""
        self.enabled = enabled
        self.labels = labels
        self._global_step = 0
        self._pending_loss = float("nan")
        self._last_epoch: int | None = None
        self._stage: str | None = None
        self._stage_at = 0.0
        self._stepped = False
        self._started_at = started_at
        self._restarted = restarted
        self._reached = step_reached if step_reached is not None else -1
        if not enabled:
            return
        _prepare_multiprocess()
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        names = list(labels)
        # A registry of our own: a second Telemetry in one process never clashes, and the
        # values live in the multiprocess files anyway (served by serve_node_endpoint).
        self.registry = reg = CollectorRegistry(auto_describe=True)

        def gauge(name: str, doc: str):
            return Gauge(PREFIX + name, doc, names, registry=reg,
                         multiprocess_mode="mostrecent").labels(**labels)

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, names, registry=reg).labels(**labels)

        self._step = gauge(contract.STEP, "Optimizer steps completed (global, across epochs).")
        self._started = gauge(contract.STEP_STARTED, "Optimizer step this rank has its batch for (in progress).")
        self._epoch = gauge(contract.EPOCH, "Current epoch (0-based).")
        self._total = gauge(contract.TOTAL_STEPS, "Optimizer steps the whole run will take.")
        self._loss = gauge(contract.LOSS, "Training loss of the last step whose loss was read (built-in "
                           "trainer: every logEverySteps steps) on this rank.")
        self._samples = counter(contract.SAMPLES, "Training samples processed by this rank.")
        self._step_s = Histogram(
            PREFIX + contract.STEP_SECONDS, "Wall time of one optimizer step on this rank.", names,
            registry=reg, buckets=STEP_BUCKETS,
        ).labels(**labels)
        self._wait = counter(contract.DATA_WAIT_SECONDS, "Seconds spent waiting for the next batch.")
        self._last = gauge(contract.LAST_STEP_TIMESTAMP, "Unix time the last step finished.")
        self._acc = gauge(contract.EVAL_ACCURACY, "Validation accuracy of the last evaluation.")
        self._eval_loss = gauge(contract.EVAL_LOSS, "Validation loss of the last evaluation.")
        self._ckpt = gauge(contract.CHECKPOINT_SECONDS, "Seconds training stood still for the last checkpoint "
                           "(with async saving: the host copy, not the write).")
        self._restarts = gauge(contract.RESTART_COUNT, "Group restarts before this attempt.")
        # Of this worker process: with the agent's failure times, an in-place restart's recovery.
        self._first_step = gauge(contract.FIRST_STEP_TIMESTAMP, "Unix time this worker process finished "
                                 "its first step.")
        self._resumed = gauge(contract.RESUMED_FROM_STEP, "The step this worker process resumed from "
                              "(0: from the start).")
        self._gpu_alloc = gauge(contract.GPU_MEMORY_ALLOCATED, "torch.cuda.memory_allocated().")
        self._gpu_max = gauge(contract.GPU_MEMORY_MAX_ALLOCATED, "torch.cuda.max_memory_allocated().")
        self._gpu_reserved = gauge("gpu_memory_reserved_bytes", "torch.cuda.memory_reserved().")
        # No child bound here: a CPU rank, which records no value, exports no device series at all.
        self._compute_s = Histogram(
            PREFIX + contract.COMPUTE_SECONDS, "Device (GPU) time of one optimizer step's forward passes on this "
            "rank, from CUDA events; no collective runs in it, so waiting for peers never counts.",
            names, registry=reg, buckets=STEP_BUCKETS)
        self._gpu_info = Gauge(GPU_INFO, "1 for this rank's GPU; uuid as DCGM's UUID label.",
                               names + ["uuid", "name"], registry=reg, multiprocess_mode="mostrecent")
        # Bound per reason at the first drop (tracking.py): a run without MLflow exports none.
        self._mlflow_family = Counter(
            PREFIX + "mlflow_dropped", "MLflow calls not made, by reason: queue_full (the bounded queue "
            "was full), failed (the tracking server refused, timed out or erred), skipped (closing past "
            "its deadline).", names + ["reason"], registry=reg)
        self._mlflow_run = Gauge(PREFIX + contract.MLFLOW_RUN_INFO, "1 for the job's MLflow run (rank 0 only): "
                                 "the operator copies it into status.mlflow.", names + ["run_id", "experiment_id"],
                                 registry=reg, multiprocess_mode="mostrecent")
        stage = Gauge(PREFIX + contract.STAGE, "1 for the stage this rank is in (" + ", ".join(contract.STAGES) + "), "
                      "0 for the others.", names + ["stage"], registry=reg, multiprocess_mode="mostrecent")
        self._stages = {s: stage.labels(**labels, stage=s) for s in contract.STAGES}
        self._stage_start = gauge(contract.STAGE_START_TIMESTAMP, "Unix time this rank's current stage began.")
        seconds = goodput_family(reg, names)
        self._goodput = {c: seconds.labels(**labels, category=c) for c in contract.RANK_GOODPUT_CATEGORIES}

    @classmethod
    def from_env(cls, *, enabled: bool | None = None) -> "Telemetry":
        """Labels from torchrun's and the operator's env vars."""
        env = os.environ
        restart = _number(env.get(contract.ENV_RESTART))
        failed_at = _number(env.get(contract.ENV_FAILED_AT)) if restart else None
        reached = _number(env.get(contract.ENV_STEP_REACHED)) if restart else None
        rank: Any = env.get(contract.TORCHRUN_RANK, "0")
        if env.get(contract.ENV_FT_LIGHTHOUSE):  # a per-step job: torchrun's world is the pod, the job spans them
            from .faulttolerance import job_rank
            rank = job_rank(env)
        labels = rank_labels(env, rank=rank,
                             local_rank=env.get(contract.TORCHRUN_LOCAL_RANK, "0"),
                             node_rank=env.get(contract.ENV_NODE_RANK, env.get(contract.TORCHRUN_GROUP_RANK, "0")))
        if enabled is None:
            enabled = env.get(contract.ENV_TELEMETRY, "1") != "0"
        # A worker restarted without a failure its agent saw (its peers' round): from its own start.
        started = failed_at or (None if restart else _number(env.get(contract.ENV_NODE_STARTED))) or process_start()
        return cls(labels=labels, enabled=enabled, started_at=started, restarted=bool(restart),
                   step_reached=int(reached) if reached is not None else None)

    @property
    def stage(self) -> str | None:
        """The stage this process last set (None: none yet)."""
        return self._stage

    def set_stage(self, stage: str, *, timestamp: float | None = None) -> None:
        """Enter `stage` (one of contract.STAGES): every stage's gauge is written, so that the process that
        set the stage last (the launcher, then the rank) wins in the shared directory."""
        if stage not in contract.STAGES:
            raise ValueError(f"unknown stage {stage!r}; one of {', '.join(contract.STAGES)}")
        if not self.enabled or stage == self._stage:
            return
        now = time.time() if timestamp is None else timestamp
        left = contract.STAGE_GOODPUT.get(self._stage or "")
        if left is not None:
            self._goodput[left].inc(max(0.0, now - self._stage_at))
        self._stage, self._stage_at = stage, now
        for name, child in self._stages.items():
            child.set(1 if name == stage else 0)
        self._stage_start.set(now)

    def renew_stage(self) -> None:
        """The current stage begun again now (its start gauge only; its goodput is not cut): what
        the hang watchdogs read as progress, for a rank a test holds on purpose (debug.Knobs.hold)."""
        if self.enabled and self._stage is not None:
            self._stage_start.set(time.time())

    def set_total_steps(self, n: int) -> None:
        """The number of optimizer steps the run will take."""
        if self.enabled:
            self._total.set(n)

    def set_restart_count(self, n: int) -> None:
        """Group restarts that happened before this attempt."""
        if self.enabled:
            self._restarts.set(n)

    def resumed_from(self, step: int) -> None:
        """The step this worker process resumed from (0: none)."""
        if self.enabled:
            self._resumed.set(step)

    def step_started(self, *, step: int) -> None:
        """This rank has the batch for `step` in hand (lets a hang name the rank that never got there)."""
        if self.enabled:
            self._started.set(step)

    def step(self, *, step: int, epoch: int, loss: float | None, samples: int,
             step_seconds: float, data_wait_seconds: float, timestamp: float) -> None:
        """Record one finished optimizer step; `loss` None: not read this step (gauge kept)."""
        if not self.enabled:
            return
        if self._stage is None or self._stage == "first_step":
            self.set_stage("training")  # the first finished step ends start-up
        if not self._stepped:
            self._stepped = True
            self._first_step.set(timestamp)
            if self._started_at is not None:  # up to the first step's own start
                self._goodput["recovering" if self._restarted else "starting"].inc(
                    max(0.0, timestamp - step_seconds - self._started_at))
        self._goodput["recomputing" if step <= self._reached else "training"].inc(step_seconds)
        self._global_step = step
        self._step.set(step)
        if epoch != self._last_epoch:  # changes once per epoch: skip the mmap write otherwise
            self._last_epoch = epoch
            self._epoch.set(epoch)
        if loss is not None:
            self._loss.set(loss)
        self._samples.inc(samples)
        self._step_s.observe(step_seconds)
        self._wait.inc(data_wait_seconds)
        self._last.set(timestamp)

    def eval(self, *, accuracy: float, loss: float) -> None:
        """Record a finished evaluation."""
        if self.enabled:
            self._acc.set(accuracy)
            self._eval_loss.set(loss)

    def checkpoint(self, seconds: float) -> None:
        """Record how long the last checkpoint took."""
        if self.enabled:
            self._ckpt.set(seconds)

    def mlflow_dropped(self, reason: str, n: int = 1) -> None:
        """Count MLflow calls that were not made (tracking.py), by reason."""
        if self.enabled:  # the child is bound at a reason's first drop: prometheus_client keeps it
            self._mlflow_family.labels(**self.labels, reason=reason).inc(n)

    def mlflow_run(self, run_id: str, experiment_id: str) -> None:
        """Export which MLflow run the job logs to (rank 0: the launcher of node 0, the trainer)."""
        if self.enabled:
            self._mlflow_run.labels(**self.labels, run_id=run_id, experiment_id=experiment_id).set(1)

    def gpu_memory(self, torch_mod: Any, device: Any) -> None:
        """Record GPU memory of `device` (call every few steps, not every step)."""
        if self.enabled and getattr(device, "type", "cpu") == "cuda":
            self._gpu_alloc.set(torch_mod.cuda.memory_allocated(device))
            self._gpu_max.set(torch_mod.cuda.max_memory_allocated(device))
            self._gpu_reserved.set(torch_mod.cuda.memory_reserved(device))

    def gpu_info(self, torch_mod: Any, device: Any) -> None:
        """Record which GPU `device` is (once per process); nothing on CPU."""
        if self.enabled and getattr(device, "type", "cpu") == "cuda":
            props = torch_mod.cuda.get_device_properties(device)
            self._gpu_info.labels(**self.labels, uuid=gpu_uuid(props), name=props.name).set(1)

    def compute(self, step_seconds: Iterable[float]) -> None:
        """Record device compute time, one value per optimizer step (DeviceTimer.read())."""
        seconds = list(step_seconds) if self.enabled else []
        if seconds:  # the child is bound once per call, off the per-value loop, and only with a value
            child = self._compute_s.labels(**self.labels)
            for s in seconds:
                child.observe(s)

    # ---- the few-lines API for users' own scripts ----------------------------------------
    def record_loss(self, loss: Any) -> None:
        """Remember the loss of the current step (a float or a 0-d tensor); `track` records it."""
        if self.enabled:
            self._pending_loss = _as_float(loss)

    def track(self, batches: Iterable[Any], *, epoch: int = 0, samples: int | None = None) -> Iterator[Any]:
        """Yield `batches`; each yielded batch is one step, timed from yield to the next request.

        `samples` per step defaults to the length of the batch's first element.
        """
        if self._stage is None:
            self.set_stage("first_step")
        t0 = time.perf_counter()
        for batch in batches:
            t1 = time.perf_counter()
            if self.enabled:
                self._started.set(self._global_step + 1)
            yield batch
            t2 = time.perf_counter()
            n = samples if samples is not None else _batch_len(batch)
            self.step(step=self._global_step + 1, epoch=epoch, loss=self._pending_loss, samples=n,
                      step_seconds=t2 - t0, data_wait_seconds=t1 - t0, timestamp=time.time())
            t0 = time.perf_counter()

    @contextlib.contextmanager
    def timed_step(self, *, epoch: int = 0, samples: int = 0) -> Iterator[TimedStep]:
        """`with tm.timed_step(epoch=e, samples=n) as s: ...; s.loss = loss.item()` records one step
        (one that raises records nothing)."""
        s = TimedStep(epoch=epoch, samples=samples)
        t0 = time.perf_counter()
        self.step_started(step=self._global_step + 1)
        yield s
        self.step(step=self._global_step + 1, epoch=s.epoch, loss=_as_float(s.loss), samples=s.samples,
                  step_seconds=time.perf_counter() - t0, data_wait_seconds=s.data_wait, timestamp=time.time())


@dataclass(slots=True)
class TimedStep:
    """What a `timed_step` body reports: its loss (a float or a 0-d tensor) and the seconds of
    the step spent waiting for data."""

    epoch: int
    samples: int
    loss: Any = float("nan")
    data_wait: float = 0.0


def _as_float(loss: Any) -> float:
    return float(loss.item() if hasattr(loss, "item") else loss)


def gpu_uuid(props: Any) -> str:
    """torch's device-properties uuid as nvidia-smi and DCGM spell it ("GPU-<hex uuid>")."""
    u = str(props.uuid)
    return u if u.startswith(("GPU-", "MIG-")) else "GPU-" + u


class DeviceTimer:
    """Device time between start() and stop(), summed per optimizer step, read without a sync per
    step: events are recorded on the device's stream and read only at log steps, after the loss
    read has waited for the stream anyway.

    `new_event` makes a timing event (record/synchronize/elapsed_time in ms, torch.cuda.Event's
    API); events are reused, so a run allocates about two per micro-batch of one log interval.
    """

    def __init__(self, new_event: Callable[[], Any]) -> None:
        self._new_event = new_event
        self._free: list[Any] = []
        self._open: list[tuple[Any, Any]] = []       # (start, stop) pairs of the step in progress
        self._steps: list[list[tuple[Any, Any]]] = []  # finished steps not read yet
        self._started: Any = None

    @classmethod
    def for_device(cls, device: Any) -> "DeviceTimer":
        """CUDA events on a CUDA device; elsewhere a timer that records and returns nothing."""
        if getattr(device, "type", "cpu") != "cuda":
            return _NoDeviceTimer()
        import torch

        return cls(lambda: torch.cuda.Event(enable_timing=True))

    def _event(self) -> Any:
        return self._free.pop() if self._free else self._new_event()

    def start(self) -> None:
        self._started = self._event()
        self._started.record()

    def stop(self) -> None:
        end = self._event()
        end.record()
        self._open.append((self._started, end))
        self._started = None

    def end_step(self) -> None:
        """Close the optimizer step: what was timed since the last end_step is one value."""
        if self._open:
            self._steps.append(self._open)
            self._open = []

    def read(self) -> list[float]:
        """Seconds per step closed since the last read. Waits for the last event (a no-op once the
        caller synchronized), so it is correct anywhere and costs nothing at log steps."""
        if not self._steps:
            return []
        self._steps[-1][-1][1].synchronize()
        out = [sum(a.elapsed_time(b) for a, b in pairs) / 1000.0 for pairs in self._steps]
        self._free += [e for pairs in self._steps for pair in pairs for e in pair]
        self._steps = []
        return out


class _NoDeviceTimer(DeviceTimer):
    """CPU: host step times already are the compute's times; nothing to record."""

    def __init__(self) -> None:
        super().__init__(lambda: None)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def end_step(self) -> None:
        pass

    def read(self) -> list[float]:
        return []


def goodput_family(registry: Any, names: list[str]) -> Any:
    """The GOODPUT_SECONDS counter family (labels `names` + category): a rank's and its agent's
    (the stalled seconds) are one series per rank and category in the pod's endpoint."""
    from prometheus_client import Counter

    return Counter(PREFIX + contract.GOODPUT_SECONDS, "Seconds of this rank's time by category (contract."
                   "GOODPUT_CATEGORIES; no queued or suspended: no rank runs then).", names + ["category"],
                   registry=registry)


def metric_files(metrics_dir: str) -> list[str]:
    """The pod's multiprocess metric files that can be read: each process creates its files as it
    first uses a kind of metric (a worker's start, a gauge mode's first use), and prometheus_client
    opens a new file empty before it sizes it; merged in that moment, the empty file fails the
    whole read (struct.error) where it is only a file with nothing in it yet."""
    import glob

    out = []
    for path in glob.glob(os.path.join(metrics_dir, "*.db")):
        with contextlib.suppress(OSError):  # a live gauge's file removed as its process ended
            if os.path.getsize(path) >= 8:  # the used-bytes header: sized, readable
                out.append(path)
    return out


def merged_metrics(metrics_dir: str) -> Iterable[Any]:
    """The metric families of every process in the pod's multiprocess directory, merged as the
    pod's endpoint serves them (metric_files: those that can be read)."""
    from prometheus_client.multiprocess import MultiProcessCollector

    return MultiProcessCollector.merge(metric_files(metrics_dir))


def rank_goodput(metrics_dir: str, rank: int | str) -> dict[str, float]:
    """`rank`'s GOODPUT_SECONDS by category as its pod's endpoint serves them (every worker process
    the rank had in the pod, and its agent's), read from the pod's multiprocess directory."""
    out: dict[str, float] = {}
    name = PREFIX + contract.GOODPUT_SECONDS + "_total"
    for family in merged_metrics(metrics_dir):
        for s in family.samples:
            if s.name == name and s.labels.get("rank") == str(rank) and s.labels.get("category"):
                out[s.labels["category"]] = out.get(s.labels["category"], 0.0) + s.value
    return out


def _number(text: str | None) -> float | None:
    """A number from the env, None when absent or not one."""
    try:
        value = float(text) if text else None
    except ValueError:
        return None
    return value if value is not None and value == value and abs(value) != float("inf") else None


def process_start() -> float | None:
    """This process's start (Unix time; None: unknown): the launcher's is its ranks' start, a rank
    that no launcher started counts its start from its own."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - a start unknown is a category not counted, never a failure
        return None


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    try:
        return len(first)
    except TypeError:
        return 1


def serve_node_endpoint(port: int, metrics_dir: str, *, addr: str = "0.0.0.0", stacks_dir: str | None = None):
    """Serve every local rank's metrics (the multiprocess dir) on one port; returns the server.
    With `stacks_dir`, contract.STACKS_PATH serves the stack captures kept there (stacks.kept) as
    JSON: what the operator keeps in the job's ConfigMap and the local runner prints on a stall."""
    import json
    import socket
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    os.makedirs(metrics_dir, exist_ok=True)
    from prometheus_client import CollectorRegistry, make_wsgi_app
    from prometheus_client.multiprocess import MultiProcessCollector

    class Collector(MultiProcessCollector):
        def collect(self):
            return merged_metrics(metrics_dir)  # a file being created is not a failed scrape

    registry = CollectorRegistry()
    Collector(registry, path=metrics_dir)
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        if stacks_dir and environ.get("PATH_INFO") == contract.STACKS_PATH:
            from .stacks import kept

            body = json.dumps(kept(stacks_dir)).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return metrics(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log_message(self, format, *args):
            """No line per scrape."""

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    server = make_server(addr, port, app, Server, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
