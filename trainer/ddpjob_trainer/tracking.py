"""MLflow tracking for the built-in trainer: one run per job, never in training's way.

Every MLflow call runs on one background thread, fed by a bounded queue (`CallQueue`): a step only
puts a small closure there, never waits for the server. A full queue drops the call and counts it
(`ddpjob_trainer_mlflow_dropped_total{reason="queue_full"}`, plus a warning at most once a minute);
a call that fails (server down, frozen, refusing) is counted as `reason="failed"`. Requests time
out after MLFLOW_HTTP_REQUEST_TIMEOUT seconds (default here 5, MLflow's own is 120) without
retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES 0, MLflow's own is 7 with backoff: minutes), so a hung
server holds the worker, never a step. A variable set in the pod's env wins over these defaults.
Metrics are sent in batches, one request at most every FLUSH_SECONDS (and at close); a batch waits
no longer than that, also when no call follows it (a loop stalled or held after a log step).

One run per job: the run carries the tag `ddpjob.key` (a hash of the job's UID; locally the runner
derives one from the job name and its work directory). Each attempt finds the run by that tag and
resumes it (status back to RUNNING), so after a group restart metrics go on at the global step in
the same run; params are logged once, by the attempt that finds the run without them (a resume
never changes a param), and what changes between attempts (`ddpjob.attempt`) is a tag.

Start: opening the run is the queue's first call. An unreachable server is a warning and training
goes on; the worker tries again (after 1 s, doubling up to 30 s) while the calls queue up behind
it (dropped and counted once the queue is full), so a server that comes back later gets them.
`spec.trainer.mlflow.required: true` instead waits for the first try (at most START_SECONDS) and
fails the attempt without a run. End: after a successful run rank 0 queues the job's record (the
artifact JOB_ARTIFACT: the job, its resolved trainer config, its last checkpoint; that checkpoint
also as the tag CHECKPOINT_TAG, which each attempt may change), where rank 0's time went
(goodput_metrics) and the trained model (registered as
a new version of `mlflow.registerModel` when the spec names one); `close(status)` flushes what is
queued within a deadline (then skips the rest), and ends the run FINISHED, FAILED or KILLED
(SIGTERM: a shorter deadline).
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any

from ddpjob_api import contract
from ddpjob_api.contract import public_uri

HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"}
QUEUE_SIZE = 1000          # calls; a log step puts one, so this is many minutes of a stalled server
START_SECONDS = 30.0       # `required: true`: how long the first rank waits for its run
CLOSE_SECONDS = 15.0       # close(): flush, then end the run, within this
MODEL_SECONDS = 120.0      # ... plus this when the trained model is to be saved and uploaded,
# ... plus its size at this rate: a slow link to the artifact store (a 7 GB model gets 6 more minutes).
MODEL_UPLOAD_BYTES_PER_SECOND = 20e6
KILLED_SECONDS = 3.0       # close("KILLED"): the launcher's SIGKILL follows SIGTERM after 5 s
REOPEN_SECONDS = (1.0, 30.0)  # no run yet: try again after 1 s, doubling up to 30 s
WARN_EVERY_SECONDS = 60.0
LAUNCHER_HTTP_TIMEOUT = 15  # seconds a request of the launcher's (`main`) may take: before training
# After SIGTERM, the system metrics process's last publish and flush: two requests, then a margin.
SYSTEM_METRICS_END_SECONDS = 2 * float(HTTP_DEFAULTS["MLFLOW_HTTP_REQUEST_TIMEOUT"]) + 2.0
KEY_TAG = "ddpjob.key"
CHECKPOINT_TAG = "ddpjob.checkpoint"  # the last checkpoint a successful attempt wrote
JOB_ARTIFACT = "ddpjob/job.json"      # job_record(), logged at the end of a successful run
MODEL_ARTIFACT = "model"
PARAM_BATCH = 100          # MLflow's log_batch limit on params and tags
METRIC_BATCH = 1000        # ... and on metrics
# Metrics go out in one request at most this often (and at close): a request costs the client and
# the server milliseconds of CPU, which at every log step of a fast loop would be a few % of it.
FLUSH_SECONDS = 5.0
PARAM_VALUE_MAX = 6000


def close_seconds(model_bytes: int | None) -> float:
    """close()'s deadline: the flush, and with a model queued (its state's size in bytes) the model's
    save and upload at a slow link's rate."""
    if model_bytes is None:
        return CLOSE_SECONDS
    return CLOSE_SECONDS + MODEL_SECONDS + model_bytes / MODEL_UPLOAD_BYTES_PER_SECOND


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config sections as dotted keys (`checkpoint.dir`), values as MLflow stores them:
    strings; sequences comma-joined (`synthetic.shape: 3,32,32`)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_params(value, prefix=name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(str(v) for v in value)[:PARAM_VALUE_MAX]
        else:
            out[name] = str(value)[:PARAM_VALUE_MAX]
    return out


def run_key(env: Mapping[str, str], *, checkpoint_dir: str | None = None) -> str | None:
    """What identifies the job across its attempts: its UID (the operator's, or the local runner's
    name + work directory one); without one, its checkpoint directory (what a resume reads). None:
    nothing ties two attempts together, so every start is a run of its own."""
    ident = env.get(contract.ENV_JOB_UID) or (f"dir:{os.path.abspath(checkpoint_dir)}" if checkpoint_dir else "")
    return hashlib.sha256(ident.encode()).hexdigest()[:32] if ident else None


def run_tags(env: Mapping[str, str], *, torch_mod: Any = None, device: Any = None) -> dict[str, str]:
    """Which DDPJob, attempt and software this is (set by every attempt: `ddpjob.attempt` changes)."""
    nodes = env.get(contract.ENV_NNODES) or env.get(contract.PET_NNODES) or "1"
    nproc = env.get(contract.ENV_NPROC_PER_NODE) or env.get(contract.TORCHRUN_LOCAL_WORLD_SIZE) or "1"
    tags = {"ddpjob.name": env.get(contract.ENV_JOB_NAME, "local"),
            "ddpjob.namespace": env.get(contract.ENV_JOB_NAMESPACE, ""),
            "ddpjob.uid": env.get(contract.ENV_JOB_UID, ""),
            "ddpjob.attempt": env.get(contract.ENV_ATTEMPT, "0"),
            "ddpjob.nodes_x_procs": f"{nodes}x{nproc}",
            "ddpjob.world_size": env.get(contract.ENV_WORLD_SIZE, "1"),
            "ddpjob.image": env.get(contract.ENV_IMAGE, "")}
    if torch_mod is not None:
        tags["torch.version"] = str(torch_mod.__version__)
        tags["torch.cuda"] = str(torch_mod.version.cuda or "none")
        if getattr(device, "type", "cpu") == "cuda":
            nccl = torch_mod.cuda.nccl.version()
            tags["torch.nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
            tags["gpu.model"] = torch_mod.cuda.get_device_name(device)
    return tags


def job_record(env: Mapping[str, str], config: Mapping[str, Any], *, checkpoint: str | None) -> dict[str, Any]:
    """What the run keeps of the job (JOB_ARTIFACT): which DDPJob and shape (the pod's env), the
    trainer config as it was resolved (defaults applied, `auto`s decided: what the params hold,
    unflattened), and the path of the last checkpoint (None without checkpoint.dir). No URI's
    credentials."""
    job = {"name": env.get(contract.ENV_JOB_NAME, "local"), "namespace": env.get(contract.ENV_JOB_NAMESPACE, ""),
           "uid": env.get(contract.ENV_JOB_UID, ""), "image": env.get(contract.ENV_IMAGE, ""),
           "attempt": int(env.get(contract.ENV_ATTEMPT, "0")),
           "nodes": int(env.get(contract.ENV_NNODES) or 1), "nprocPerNode": int(env.get(contract.ENV_NPROC_PER_NODE) or 1)}
    return _public({"job": job, "trainer": dict(config), "checkpoint": checkpoint})


def goodput_metrics(seconds: Mapping[str, float]) -> dict[str, float]:
    """The ranks' ledger as the run's metrics at its end: `goodput_<category>_seconds` for each
    category rank 0 saw (telemetry's goodput_seconds, every worker it had in its pod) and `goodput`,
    the training share of them. The job's whole ledger, queued and suspended time and the group
    restarts' included, is the operator's status.goodput (the local runner's summary)."""
    out = {f"goodput_{c}_seconds": round(float(seconds.get(c, 0.0)), 3) for c in contract.RANK_GOODPUT_CATEGORIES}
    total = sum(out.values())
    out["goodput"] = round(out["goodput_training_seconds"] / total, 4) if total > 0 else 0.0
    return out


def _public(obj: Any) -> Any:
    """`obj` as JSON-able data with every string's URIs shown without userinfo."""
    if isinstance(obj, Mapping):
        return {str(k): _public(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_public(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    return public_uri(str(obj))


# What urllib3 says when the server closed a kept-alive connection as this request went out on it
# (uvicorn, MLflow's server, closes idle ones after 5 s): the request never reached the server.
_STALE_CONNECTION = ("RemoteDisconnected", "Connection aborted")


class OnceMore:
    """An MLflow client whose calls are made once more, at once, when the first went out on a
    connection the server had just closed. MLflow's own retries are off (HTTP_DEFAULTS: a retry
    after a timeout would double a hung server's hold on the tracking thread), and without this a
    send every FLUSH_SECONDS can meet the server's idle timeout and lose its batch."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except Exception as exc:
                if not any(s in str(exc) for s in _STALE_CONNECTION):
                    raise
            return attr(*args, **kwargs)
        return call


class _Final:
    """The last call: it runs even when the backlog is being skipped."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn


class CallQueue:
    """A bounded queue of calls and the one thread that makes them. `submit` never blocks: a full
    queue drops the call and reports it to `on_drop`; a call that raises goes to `on_error`.

    `tick`, on the same thread after each call and whenever the time it asked for has passed, does
    what is due without a call (a batch to send) and answers in how many seconds it wants to run
    again (None: only after the next call). Not once close() skips the backlog."""

    def __init__(self, *, maxsize: int = QUEUE_SIZE, on_drop: Callable[[str], None],
                 on_error: Callable[[BaseException], None], name: str = "ddpjob-mlflow",
                 tick: Callable[[], float | None] = lambda: None) -> None:
        self._q: queue.Queue[Callable[[], None] | _Final] = queue.Queue(maxsize)
        self._on_drop, self._on_error, self._tick = on_drop, on_error, tick
        self._skip = threading.Event()
        self._done = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], None]) -> bool:
        """Queue `call`; False (dropped, counted) when the queue is full or closed."""
        if self._closed:
            return False
        try:
            self._q.put_nowait(call)
        except queue.Full:
            self._on_drop("queue_full")
            return False
        return True

    def _run(self) -> None:
        wait: float | None = None
        while True:
            try:
                call = self._q.get(timeout=wait)
            except queue.Empty:
                wait = self._ticked()
                continue
            final = isinstance(call, _Final)
            if self._skip.is_set() and not final:
                self._on_drop("skipped")
                continue
            try:
                call.fn() if isinstance(call, _Final) else call()
            except Exception as exc:  # noqa: BLE001 - tracking never fails training
                self._on_error(exc)
            if final:
                self._done.set()
                return
            wait = self._ticked()

    def _ticked(self) -> float | None:
        if self._skip.is_set():
            return None
        try:
            return self._tick()
        except Exception as exc:  # noqa: BLE001 - tracking never fails training
            self._on_error(exc)
            return None

    def close(self, final: Callable[[], None], *, seconds: float) -> bool:
        """Make the queued calls, then `final`, within `seconds`: after 60% of them what is still
        queued is skipped so that `final` gets its turn. True when `final` ran."""
        if self._closed:
            return self._done.is_set()
        self._closed = True
        end = time.monotonic() + seconds
        soft = time.monotonic() + 0.6 * seconds
        while True:
            try:
                self._q.put(_Final(final), timeout=max(0.0, soft - time.monotonic()))
                break
            except queue.Full:
                self._skip.set()
                if time.monotonic() >= end:
                    return False
                soft = end
        if not self._done.wait(timeout=max(0.0, soft - time.monotonic())):
            self._skip.set()
            self._done.wait(timeout=max(0.0, end - time.monotonic()))
        return self._done.is_set()


class Tracker:
    """Rank 0's MLflow run, every call made on the CallQueue's thread."""

    def __init__(self, *, tracking_uri: str, experiment: str, run_name: str | None, key: str | None,
                 tags: dict[str, str], warn: Callable[[str], None], count_drop: Callable[[str], None],
                 client_factory: Callable[[str], Any] | None = None, queue_size: int = QUEUE_SIZE,
                 run_id: str | None = None, on_open: Callable[[str, str], None] | None = None) -> None:
        self.tracking_uri, self.experiment, self.run_name, self.key = tracking_uri, experiment, run_name, key
        self.shown_uri = public_uri(tracking_uri)  # in warnings: never a URI's credentials
        self.given_run_id = run_id       # MLFLOW_RUN_ID (the launcher's): the run to resume, if the server has it
        self._on_open = on_open          # (run id, experiment id) once the run is open
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.error: str | None = None    # why there is no run (after `ready`)
        self.ready = threading.Event()   # the first try to open the run is over (run_id: its outcome)
        self._closing = threading.Event()  # close() was called: stop trying to open the run
        self._warn, self._count_drop = warn, count_drop
        self._client: Any = None
        self._has_params = False
        self._model_bytes: int | None = None   # the queued model's size (its close deadline)
        self._batch: list[Any] = []      # metrics not sent yet (the worker's own)
        self._flushed = 0.0              # monotonic time of the last send
        self._client_factory = client_factory or _mlflow_client
        self._last_warning = {"queue_full": 0.0, "failed": 0.0}
        self._counts = {"queue_full": 0, "failed": 0, "skipped": 0}
        self._calls = CallQueue(maxsize=queue_size, on_drop=self._dropped, on_error=self._failed,
                                tick=self._flush_due)
        self._calls.submit(lambda: self._open(tags))

    # --- on the caller's thread: never waits for the server --------------------------------------
    def params(self, params: Mapping[str, Any]) -> None:
        """Log params once per run (the first attempt that finds the run without them)."""
        flat = {k: public_uri(v) for k, v in flatten_params(params).items()}
        self._calls.submit(lambda: self._log_params(flat))

    def metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Log metrics at the global step."""
        stamp = int(time.time() * 1000)
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        self._calls.submit(lambda: self._log_metrics(values, step, stamp))

    def model(self, model: Any, *, torch_version: str, register_as: str | None = None) -> None:
        """Log `model` (a CPU copy nobody trains any more) as the run's artifact `model`, in torch's
        standard format (loadable with mlflow.pytorch.load_model("runs:/<id>/model")); with
        `register_as`, then as a new version of that registered model ("models:/<name>/<version>")."""
        if self._calls.submit(lambda: self._log_model(model, torch_version, register_as)):
            self._model_bytes = sum(int(getattr(t, "nbytes", 0)) for t in model.state_dict().values())

    def record(self, record: Mapping[str, Any]) -> None:
        """Log the job's record (job_record()) as JOB_ARTIFACT, its checkpoint as CHECKPOINT_TAG."""
        text = json.dumps(record, indent=2, sort_keys=True)
        checkpoint = record.get("checkpoint")
        self._calls.submit(lambda: self._log_record(text, checkpoint))

    def close(self, status: str, *, seconds: float | None = None) -> bool:
        """Flush within the deadline and end the run with `status` (FINISHED, FAILED, KILLED)."""
        if seconds is None:
            seconds = KILLED_SECONDS if status == "KILLED" else close_seconds(self._model_bytes)
        self._closing.set()
        ok = self._calls.close(lambda: self._end(status), seconds=seconds)
        lost = self._counts["queue_full"] + self._counts["failed"] + self._counts["skipped"]
        if not ok:
            self._warn(f"MLflow: the run was not ended {status} within {seconds:.0f}s "
                       f"(tracking server {self.shown_uri} slow or unreachable); it may stay RUNNING")
        elif lost:
            self._warn(f"MLflow: {lost} call(s) were not logged ({self._counts})")
        return ok

    def counts(self) -> dict[str, int]:
        """Calls lost so far, by reason (queue_full, failed, skipped)."""
        return dict(self._counts)

    def _dropped(self, reason: str) -> None:
        self._counts[reason] = self._counts.get(reason, 0) + 1
        self._count_drop(reason)
        now = time.monotonic()
        if reason == "queue_full" and now - self._last_warning["queue_full"] >= WARN_EVERY_SECONDS:
            self._last_warning["queue_full"] = now
            self._warn(f"MLflow: the tracking queue is full ({self._counts['queue_full']} call(s) dropped so "
                       f"far; tracking server {self.shown_uri} slow or unreachable); training goes on")

    def _failed(self, exc: BaseException) -> None:
        self._dropped("failed")
        now = time.monotonic()
        if now - self._last_warning["failed"] >= WARN_EVERY_SECONDS:
            self._last_warning["failed"] = now
            self._warn(f"MLflow: a call to {self.shown_uri} failed ({self._counts['failed']} so far): "
                       f"{type(exc).__name__}: {public_uri(str(exc))[:300]}")

    # --- on the worker thread --------------------------------------------------------------------
    def _open(self, tags: dict[str, str]) -> None:
        """Open the run; while the server cannot be reached, try again until close()."""
        wait = REOPEN_SECONDS[0]
        while not self._try_open(tags):
            if self._closing.wait(wait):  # one last try: the queued calls are worth it
                self._try_open(tags)
                return
            wait = min(2 * wait, REOPEN_SECONDS[1])

    def _try_open(self, tags: dict[str, str]) -> bool:
        first = not self.ready.is_set()
        try:
            client = OnceMore(self._client_factory(self.tracking_uri))
            run = find_run(client, experiment=self.experiment, key=self.key, run_id=self.given_run_id,
                           run_name=self.run_name, create=True)
            self._has_params = bool(run.data.params)
            if run.info.status != "RUNNING":
                client.update_run(run.info.run_id, status="RUNNING")
            _log_batched(client, run.info.run_id, tags=tags)
            self._client, self.run_id, self.error = client, run.info.run_id, None
            self.experiment_id = run.info.experiment_id
            if self._on_open is not None:
                self._on_open(self.run_id, self.experiment_id)
            if not first:
                self._warn(f"MLflow: run {self.run_id} open at {self.shown_uri} after all")
            return True
        except Exception as exc:  # noqa: BLE001 - reported, and training goes on (unless required)
            self.error = f"{type(exc).__name__}: {public_uri(str(exc))[:500]}"
            if first:
                self._warn(f"MLflow: no run at {self.shown_uri} (experiment {self.experiment!r}): "
                           f"{self.error}; training goes on, the calls queue up while it tries again")
            return False
        finally:
            self.ready.set()

    def _log_params(self, params: dict[str, str]) -> None:
        if self.run_id and not self._has_params:
            _log_batched(self._client, self.run_id, params=params)
            self._has_params = True

    def _log_metrics(self, values: dict[str, float], step: int, stamp: int) -> None:
        if self.run_id and values:
            from mlflow.entities import Metric

            self._batch += [Metric(k, v, stamp, step) for k, v in values.items()]
            if len(self._batch) >= METRIC_BATCH:
                self._flush()

    def _flush_due(self) -> float | None:
        """The queue's tick: send the batch once FLUSH_SECONDS have passed since the last send, with
        or without a call after it (a loop stalled after a log step still has that step's metrics
        in the run); else the seconds until then (None: nothing to send)."""
        if not (self.run_id and self._batch):
            return None
        left = FLUSH_SECONDS - (time.monotonic() - self._flushed)
        if left > 0:
            return left
        self._flush()
        return None

    def _flush(self) -> None:
        batch, self._batch, self._flushed = self._batch, [], time.monotonic()
        for i in range(0, len(batch), METRIC_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i:i + METRIC_BATCH])

    def _log_record(self, text: str, checkpoint: str | None) -> None:
        if self.run_id:
            self._client.log_text(self.run_id, text, JOB_ARTIFACT)
            if checkpoint:
                _log_batched(self._client, self.run_id, tags={CHECKPOINT_TAG: checkpoint})

    def _log_model(self, model: Any, torch_version: str, register_as: str | None) -> None:
        if not self.run_id:
            return
        import tempfile

        import mlflow.pytorch

        with tempfile.TemporaryDirectory(prefix="ddpjob-model-") as tmp:
            # Requirements named, not inferred (inference loads the model in a subprocess: seconds).
            mlflow.pytorch.save_model(model, f"{tmp}/model", serialization_format="pickle",
                                      pip_requirements=[f"torch=={torch_version}"])
            self._client.log_artifacts(self.run_id, f"{tmp}/model", MODEL_ARTIFACT)
        if register_as:
            register(self._client, register_as, run_id=self.run_id)

    def _end(self, status: str) -> None:
        if self.run_id:
            try:
                if self._batch:
                    self._flush()
            finally:
                self._client.set_terminated(self.run_id, status=status)


def register(client: Any, name: str, *, run_id: str) -> str:
    """Make the run's MODEL_ARTIFACT a new version of registered model `name` (created when absent,
    also when another job creates it meanwhile); the version."""
    try:
        client.create_registered_model(name)
    except Exception as exc:
        if getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
            raise
    # The server answers READY at once for a runs:/ source: nothing to wait for.
    version = client.create_model_version(name, source=f"runs:/{run_id}/{MODEL_ARTIFACT}", run_id=run_id,
                                          await_creation_for=0)
    return str(version.version)


def experiment_id(client: Any, name: str) -> str:
    """The id of experiment `name`, created when absent (another job may create it meanwhile)."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return str(exp.experiment_id)
    try:
        return str(client.create_experiment(name))
    except Exception:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return str(exp.experiment_id)


def find_run(client: Any, *, experiment: str, key: str | None, run_id: str | None = None,
             run_name: str | None = None, create: bool = False, tags: Mapping[str, str] | None = None) -> Any:
    """The job's one run: `run_id` when the server has it (MLFLOW_RUN_ID), else the oldest run of
    `experiment` tagged `ddpjob.key` = `key`, else (with `create`) a new one with that tag and `tags`;
    None when there is none and `create` is off."""
    if run_id:
        try:
            return client.get_run(run_id)
        except Exception as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                raise  # unreachable or refusing: not a reason for a second run
    exp_id = experiment_id(client, experiment)
    if key:
        found = client.search_runs([exp_id], filter_string=f"tags.`{KEY_TAG}` = '{key}'",
                                   max_results=1, order_by=["attributes.start_time ASC"])
        if found:
            return found[0]
    if not create:
        return None
    return client.create_run(exp_id, run_name=run_name,
                             tags={**(tags or {}), **({KEY_TAG: key} if key else {})} or None)


def resolve(env: Mapping[str, str], *, create: bool, wait: float = 0.0, interval: float = 1.0,
            client_factory: Callable[[str], Any] | None = None) -> tuple[str, str]:
    """(run id, experiment id) of the job's run for a launcher, from the pod's env (MLflow's
    variables, DDPJOB_UID): node 0 finds or creates it, the other nodes only look it up. Tries
    again for `wait` seconds (node 0 may still be creating it; a busy server may time out), then
    raises the last reason."""
    uri = env[contract.ENV_MLFLOW_TRACKING_URI]
    experiment = env.get(contract.ENV_MLFLOW_EXPERIMENT) or contract.MLFLOW_DEFAULT_EXPERIMENT
    key = run_key(env)
    deadline = time.monotonic() + wait
    while True:
        try:
            client = (client_factory or _mlflow_client)(uri)
            run = find_run(client, experiment=experiment, key=key, run_id=env.get(contract.ENV_MLFLOW_RUN_ID),
                           run_name=env.get(contract.ENV_MLFLOW_RUN_NAME) or None, create=create,
                           tags=run_tags(env))
            if run is not None:
                return str(run.info.run_id), str(run.info.experiment_id)
            why: Exception = LookupError(f"no run tagged {KEY_TAG}={key} in experiment {experiment!r} at {public_uri(uri)}")
        except Exception as exc:  # noqa: BLE001 - tried again until the deadline, then raised
            why = exc
        if time.monotonic() >= deadline:
            raise why
        time.sleep(interval)


def end_if_running(env: Mapping[str, str], status: str, *, client_factory: Callable[[str], Any] | None = None) -> bool:
    """End the run MLFLOW_RUN_ID with `status` unless something ended it already (a user's script
    that ran `mlflow.end_run()`); True when this call ended it."""
    client = (client_factory or _mlflow_client)(env[contract.ENV_MLFLOW_TRACKING_URI])
    run = client.get_run(env[contract.ENV_MLFLOW_RUN_ID])
    if run.info.status != "RUNNING":
        return False
    client.set_terminated(run.info.run_id, status=status)
    return True


def _log_batched(client: Any, run_id: str, *, params: Mapping[str, str] | None = None,
                 tags: Mapping[str, str] | None = None) -> None:
    """log_batch within MLflow's limits (100 params or tags a request)."""
    from mlflow.entities import Param, RunTag

    for kind, items in (("params", [Param(k, v) for k, v in (params or {}).items()]),
                        ("tags", [RunTag(k, v) for k, v in (tags or {}).items()])):
        for i in range(0, len(items), PARAM_BATCH):
            client.log_batch(run_id, **{kind: items[i:i + PARAM_BATCH]})


def system_metrics(env: Mapping[str, str], *, node_id: str, stopped: Callable[[], bool],
                   warn: Callable[[str], None], tick: float = 0.2) -> None:
    """Log this node's system metrics into the run MLFLOW_RUN_ID as system/<node_id>/... until
    `stopped()` (spec.trainer.mlflow.systemMetrics; the launcher runs this in a process of its own,
    beside training). MLflow's monitor samples the node (psutil; GPUs through NVML where there are
    any); the loop is ours, not its thread's, which ends for good at the first failed request: a
    server that is down costs the samples of that time and a warning a minute, and logging goes on
    when it is back. Steps continue the run's (an attempt after a restart resumes them). A node
    where the monitor cannot start is one warning, never a failure."""
    _short_http_requests()
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(env[contract.ENV_MLFLOW_RUN_ID], node_id=node_id, resume_logging=True,
                                       tracking_uri=env[contract.ENV_MLFLOW_TRACKING_URI])
    except Exception as exc:  # noqa: BLE001 - e.g. psutil missing from a user's own image
        warn(f"MLflow: system metrics of {node_id} off: {type(exc).__name__}: {public_uri(str(exc))[:300]}")
        return
    warned = -WARN_EVERY_SECONDS
    stopping = False
    while not stopping:   # a last sample at the stop: the node's state when its training ended
        due = time.monotonic() + float(monitor.sampling_interval)
        while not (stopping := stopped()) and time.monotonic() < due:
            time.sleep(tick)
        try:
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
        except Exception as exc:  # noqa: BLE001 - a side service: warn, drop the samples, go on
            for m in monitor.monitors:
                m.clear_metrics()
            monitor.mlflow_logger.data = []
            if time.monotonic() - warned >= WARN_EVERY_SECONDS:
                warned = time.monotonic()
                warn(f"MLflow: system metrics of {node_id} not logged: {type(exc).__name__}: "
                     f"{public_uri(str(exc))[:300]}")
    with suppress(Exception):  # the last samples only
        monitor.mlflow_logger.flush()


def _short_http_requests() -> None:
    """MLflow's HTTP requests short and without retries (HTTP_DEFAULTS), unless the env sets them."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)


def _mlflow_client(tracking_uri: str) -> Any:
    """MLflow's client with short HTTP timeouts and no retries (unless the env sets them)."""
    _short_http_requests()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def main(argv: list[str] | None = None) -> int:
    """`python -m ddpjob_trainer.tracking resolve [--create] [--wait S]`: print the job's run as JSON
    ({"run_id", "experiment_id"}); `end STATUS`: end MLFLOW_RUN_ID if still RUNNING; `system-metrics
    --node-id ID`: log the node's system metrics into MLFLOW_RUN_ID until SIGTERM. The launcher
    runs this in a child process (MLflow's import may start threads, and the launcher forks torchrun
    with none running) under a deadline of its own. Exit 1 with the reason on stderr."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m ddpjob_trainer.tracking")
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("resolve")
    r.add_argument("--create", action="store_true")
    r.add_argument("--wait", type=float, default=0.0)
    e = sub.add_parser("end")
    e.add_argument("status", choices=["FINISHED", "FAILED", "KILLED"])
    m = sub.add_parser("system-metrics")
    m.add_argument("--node-id", required=True)
    args = p.parse_args(argv)
    if args.what == "system-metrics":
        import signal

        stop: list[int] = []   # a plain flag: a handler taking a lock the main thread holds would hang
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: stop.append(signum))
        system_metrics(os.environ, node_id=args.node_id, stopped=lambda: bool(stop),
                       warn=lambda msg: print(f"WARNING {msg}", file=sys.stderr, flush=True))
        return 0
    # Nothing trains yet (or any more): a busy server may take longer than a step may wait.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(LAUNCHER_HTTP_TIMEOUT))
    try:
        if args.what == "end":
            print(json.dumps({"ended": end_if_running(os.environ, args.status)}))
        else:
            run_id, exp_id = resolve(os.environ, create=args.create, wait=args.wait)
            print(json.dumps({"run_id": run_id, "experiment_id": exp_id}))
    except Exception as exc:  # noqa: BLE001 - the launcher decides what a missing run means
        print(f"{type(exc).__name__}: {public_uri(str(exc))[:500]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
