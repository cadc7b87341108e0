"""The MLflow tracker's pure pieces (trainer/ddpjob_trainer/tracking.py): flattened params, tags, the
run key, the bounded call queue (drops counted, never blocks, close within its deadline), and one
run per job against a fake client. The real server: tests/trainer/test_mlflow.py."""
from __future__ import annotations

import json
import threading
import time
import types

import pytest

from ddpjob_api.contract import public_uri
from ddpjob_trainer import tracking
from ddpjob_trainer.tracking import CallQueue, Tracker, flatten_params, run_key, run_tags


def test_params_flatten_nested_sections_to_dotted_keys():
    flat = flatten_params({"lr": 0.05, "compile": False, "data_path": None,
                           "checkpoint": {"dir": "/ckpt", "every_steps": 50},
                           "synthetic": {"shape": (3, 32, 32), "deep": {"x": 1}}, "mlflow": None})
    assert flat == {"lr": "0.05", "compile": "False", "data_path": "None", "checkpoint.dir": "/ckpt",
                    "checkpoint.every_steps": "50", "synthetic.shape": "3,32,32", "synthetic.deep.x": "1",
                    "mlflow": "None"}
    assert len(flatten_params({"long": "x" * 10_000})["long"]) == tracking.PARAM_VALUE_MAX


def test_the_run_key_is_the_jobs_uid_else_its_checkpoint_dir_else_none():
    uid = run_key({"DDPJOB_UID": "6b1f-uid"})
    assert uid == run_key({"DDPJOB_UID": "6b1f-uid"}, checkpoint_dir="/elsewhere") and len(uid) == 32
    assert uid != run_key({"DDPJOB_UID": "another"})
    assert run_key({}, checkpoint_dir="/ckpt") == run_key({}, checkpoint_dir="/ckpt/") != uid
    assert run_key({}) is None


def test_tags_name_the_job_the_attempt_the_shape_and_the_software():
    env = {"DDPJOB_NAME": "digits", "DDPJOB_NAMESPACE": "team-a", "DDPJOB_UID": "u-1", "DDPJOB_ATTEMPT": "2",
           "NNODES": "4", "NPROC_PER_NODE": "8", "WORLD_SIZE": "32", "DDPJOB_IMAGE": "reg.example/train:1.2"}
    cuda = types.SimpleNamespace(nccl=types.SimpleNamespace(version=lambda: (2, 27, 3)),
                                 get_device_name=lambda d: "NVIDIA H100 80GB HBM3")
    torch = types.SimpleNamespace(__version__="2.8.0+cu128", version=types.SimpleNamespace(cuda="12.8"), cuda=cuda)
    tags = run_tags(env, torch_mod=torch, device=types.SimpleNamespace(type="cuda", index=0))
    assert tags == {"ddpjob.name": "digits", "ddpjob.namespace": "team-a", "ddpjob.uid": "u-1",
                    "ddpjob.attempt": "2", "ddpjob.nodes_x_procs": "4x8", "ddpjob.world_size": "32",
                    "ddpjob.image": "reg.example/train:1.2",
                    "torch.version": "2.8.0+cu128", "torch.cuda": "12.8", "torch.nccl": "2.27.3",
                    "gpu.model": "NVIDIA H100 80GB HBM3"}
    cpu = run_tags({}, torch_mod=torch, device=types.SimpleNamespace(type="cpu"))
    assert cpu["ddpjob.name"] == "local" and cpu["ddpjob.nodes_x_procs"] == "1x1" and "gpu.model" not in cpu


def test_a_full_queue_drops_and_counts_and_never_blocks():
    drops: list[str] = []
    release, started = threading.Event(), threading.Event()
    done: list[int] = []
    q = CallQueue(maxsize=2, on_drop=drops.append, on_error=lambda e: None)
    q.submit(lambda: (started.set(), release.wait()))  # the worker holds this one (a hung server)
    assert started.wait(10)
    t0 = time.monotonic()
    accepted = [q.submit(lambda i=i: done.append(i)) for i in range(5)]
    assert time.monotonic() - t0 < 0.5  # put_nowait: no waiting at all
    assert accepted == [True, True, False, False, False] and drops == ["queue_full"] * 3
    release.set()
    assert q.close(lambda: done.append(99), seconds=10)
    assert done == [0, 1, 99]  # in order, then the final call
    assert not q.submit(lambda: None)  # closed


def test_close_skips_the_backlog_to_make_the_final_call_within_its_deadline():
    drops: list[str] = []
    release, started = threading.Event(), threading.Event()
    final = threading.Event()
    q = CallQueue(maxsize=10, on_drop=drops.append, on_error=lambda e: None)
    q.submit(lambda: (started.set(), release.wait(0.5)))  # a request that times out after 0.5 s
    assert started.wait(10)
    for _ in range(5):
        q.submit(lambda: release.wait(0.5))                # more of them queued behind it
    assert q.close(final.set, seconds=2.0)                 # 0.6 x 2 s, then what is queued is skipped
    assert final.is_set() and drops.count("skipped") >= 3, drops


def test_close_gives_up_at_its_deadline_when_the_call_in_flight_never_returns():
    never, started = threading.Event(), threading.Event()
    q = CallQueue(maxsize=1, on_drop=lambda r: None, on_error=lambda e: None)
    q.submit(lambda: (started.set(), never.wait()))
    assert started.wait(10)
    q.submit(lambda: None)                                 # the queue is full as well
    t0 = time.monotonic()
    assert q.close(lambda: None, seconds=0.3) is False
    assert time.monotonic() - t0 < 2.0
    never.set()


def test_errors_of_calls_are_reported_and_the_worker_goes_on():
    errors: list[BaseException] = []
    done = threading.Event()
    q = CallQueue(on_drop=lambda r: None, on_error=errors.append)
    q.submit(lambda: 1 / 0)
    assert q.close(done.set, seconds=5) and done.is_set()
    assert [type(e) for e in errors] == [ZeroDivisionError]


class FakeClient:
    """MLflow's client API as the tracker uses it, in memory (a server shared by its instances)."""

    def __init__(self, server: dict) -> None:
        self.s = server

    def get_experiment_by_name(self, name):
        eid = self.s["experiments"].get(name)
        return None if eid is None else types.SimpleNamespace(experiment_id=eid)

    def create_experiment(self, name):
        self.s["experiments"][name] = str(len(self.s["experiments"]))
        return self.s["experiments"][name]

    def search_runs(self, exp_ids, filter_string, max_results, order_by):
        key = filter_string.split("= '")[1].rstrip("'")
        return [r for r in self.s["runs"].values() if r.data.tags.get(tracking.KEY_TAG) == key][:max_results]

    def create_run(self, exp_id, run_name=None, tags=None):
        rid = f"run{len(self.s['runs'])}"
        run = types.SimpleNamespace(info=types.SimpleNamespace(run_id=rid, status="RUNNING", experiment_id=exp_id),
                                    data=types.SimpleNamespace(tags=dict(tags or {}), params={}, metrics=[]))
        self.s["runs"][rid] = run
        return run

    def get_run(self, run_id):
        if run_id not in self.s["runs"]:
            err = Exception(f"Run '{run_id}' not found")
            err.error_code = "RESOURCE_DOES_NOT_EXIST"  # type: ignore[attr-defined]  # MlflowException's
            raise err
        return self.s["runs"][run_id]

    def update_run(self, run_id, status=None):
        self.s["runs"][run_id].info.status = status

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        data = self.s["runs"][run_id].data
        for p in params:
            assert data.params.get(p.key, p.value) == p.value, "changing a param is not allowed"
            data.params[p.key] = p.value
        data.tags.update({t.key: t.value for t in tags})
        data.metrics += [(m.key, m.value, m.step) for m in metrics]

    def set_terminated(self, run_id, status):
        self.s["runs"][run_id].info.status = status

    def log_text(self, run_id, text, artifact_file):
        self.s.setdefault("artifacts", {})[(run_id, artifact_file)] = text

    def create_registered_model(self, name):
        models = self.s.setdefault("models", {})
        if name in models:
            err = Exception(f"Registered Model (name={name}) already exists.")
            err.error_code = "RESOURCE_ALREADY_EXISTS"  # type: ignore[attr-defined]  # MlflowException's
            raise err
        models[name] = []

    def create_model_version(self, name, source, run_id, await_creation_for):
        self.s["models"][name].append((source, run_id))
        return types.SimpleNamespace(version=str(len(self.s["models"][name])))


def attempt(server: dict, n: int, warnings: list[str]) -> Tracker:
    return Tracker(tracking_uri="http://fake", experiment="exp", run_name=None, key="k1",
                   tags={"ddpjob.attempt": str(n)}, warn=warnings.append, count_drop=lambda r: None,
                   client_factory=lambda uri: FakeClient(server))


def test_every_attempt_resumes_the_one_run_params_once_metrics_on_the_global_step():
    pytest.importorskip("mlflow")  # mlflow.entities: the trainer extra's client
    server: dict = {"experiments": {}, "runs": {}}
    warnings: list[str] = []
    first = attempt(server, 0, warnings)
    first.params({"lr": 0.1, "checkpoint": {"dir": "/c"}})
    first.metrics({"train_loss": 2.0}, step=10)
    assert first.close("FAILED")
    second = attempt(server, 1, warnings)
    assert second.ready.wait(10) and second.run_id == first.run_id == "run0"
    assert server["runs"]["run0"].info.status == "RUNNING"   # resumed
    second.params({"lr": 0.1, "checkpoint": {"dir": "/c"}, "world_size": 4})  # not logged again
    second.metrics({"train_loss": 1.0, "lr": None}, step=20)
    assert second.close("FINISHED")
    run = server["runs"]["run0"]
    assert len(server["runs"]) == 1 and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1", "checkpoint.dir": "/c"}
    assert run.data.tags == {tracking.KEY_TAG: "k1", "ddpjob.attempt": "1"}
    assert run.data.metrics == [("train_loss", 2.0, 10), ("train_loss", 1.0, 20)]
    assert warnings == []


def test_an_unreachable_server_is_a_warning_and_every_call_a_no_op():
    warnings: list[str] = []

    def refused(uri):
        raise ConnectionRefusedError("[Errno 111] Connection refused")
    t = Tracker(tracking_uri="http://127.0.0.1:9", experiment="e", run_name=None, key=None, tags={},
                warn=warnings.append, count_drop=lambda r: None, client_factory=refused)
    t.metrics({"loss": 1.0}, step=1)
    assert t.close("FINISHED") and t.run_id is None
    assert "Connection refused" in t.error and warnings[0].startswith("MLflow: no run at http://127.0.0.1:9")


def test_a_server_that_comes_back_gets_the_calls_queued_meanwhile(monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setattr(tracking, "REOPEN_SECONDS", (0.01, 0.02))
    server: dict = {"experiments": {}, "runs": {}}
    tries: list[int] = []
    back = threading.Event()

    def comes_back(uri):
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        back.set()
        return FakeClient(server)
    warnings: list[str] = []
    t = Tracker(tracking_uri="http://fake", experiment="e", run_name=None, key="k", tags={},
                warn=warnings.append, count_drop=lambda r: None, client_factory=comes_back)
    assert t.ready.wait(10) and t.run_id is None  # the first try failed: training goes on
    t.metrics({"train_loss": 2.0}, step=1)
    assert back.wait(10)
    assert t.close("FINISHED") and t.run_id == "run0" and len(tries) == 3
    assert server["runs"]["run0"].data.metrics == [("train_loss", 2.0, 1)]
    assert server["runs"]["run0"].info.status == "FINISHED"
    assert [w.split(" (")[0].split(":")[0] for w in warnings] == ["MLflow", "MLflow"], warnings


def test_required_without_a_server_fails_the_attempt(monkeypatch):
    pytest.importorskip("mlflow")
    from ddpjob_trainer.config import MlflowConfig
    from ddpjob_trainer.reporting import MlflowReporter
    from tests.support.localrun import free_ports

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    nobody = free_ports(1)[0]  # loopback, nothing listening: refused at once
    with pytest.raises(RuntimeError, match=rf"spec.trainer.mlflow.required: no MLflow run at http://127.0.0.1:{nobody}"):
        MlflowReporter(MlflowConfig(tracking_uri=f"http://127.0.0.1:{nobody}", required=True), environ={})


def test_drops_are_a_prometheus_counter_by_reason():
    from ddpjob_trainer.telemetry import Telemetry

    labels = {"ddpjob": "j", "namespace": "n", "rank": "0", "local_rank": "0", "node_rank": "0"}
    t = Telemetry(labels=labels)
    name = "ddpjob_trainer_mlflow_dropped_total"
    assert t.registry.get_sample_value(name, {**labels, "reason": "queue_full"}) is None  # none until one
    t.mlflow_dropped("queue_full")
    t.mlflow_dropped("queue_full")
    t.mlflow_dropped("failed")
    assert t.registry.get_sample_value(name, {**labels, "reason": "queue_full"}) == 2
    assert t.registry.get_sample_value(name, {**labels, "reason": "failed"}) == 1


def test_metrics_go_out_in_batches_at_most_every_flush_interval_and_at_close():
    pytest.importorskip("mlflow")
    server: dict = {"experiments": {}, "runs": {}}
    sent: list[int] = []

    class Counting(FakeClient):
        def log_batch(self, run_id, metrics=(), params=(), tags=()):
            if metrics:
                sent.append(len(metrics))
            super().log_batch(run_id, metrics=metrics, params=params, tags=tags)
    t = Tracker(tracking_uri="http://fake", experiment="e", run_name=None, key="k", tags={}, warn=print,
                count_drop=lambda r: None, client_factory=lambda uri: Counting(server))
    for step in range(1, 6):  # well within FLUSH_SECONDS: the first goes at once, the rest wait
        t.metrics({"train_loss": 1.0 / step, "lr": 0.1}, step=step)
    assert t.close("FINISHED")
    assert sent == [2, 8] and server["runs"]["run0"].info.status == "FINISHED"
    assert [m[2] for m in server["runs"]["run0"].data.metrics] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_a_batch_goes_out_after_the_flush_interval_without_another_call(monkeypatch):
    """A loop that stalls (or is held) after a log step: that step's metrics reach the run at the
    flush interval, not only at the next call or at close (before, they waited for either)."""
    pytest.importorskip("mlflow")
    monkeypatch.setattr(tracking, "FLUSH_SECONDS", 0.2)
    server: dict = {"experiments": {}, "runs": {}}
    sent = threading.Semaphore(0)

    class Signalling(FakeClient):
        def log_batch(self, run_id, metrics=(), params=(), tags=()):
            super().log_batch(run_id, metrics=metrics, params=params, tags=tags)
            if metrics:
                sent.release()
    t = Tracker(tracking_uri="http://fake", experiment="e", run_name=None, key="k", tags={}, warn=print,
                count_drop=lambda r: None, client_factory=lambda uri: Signalling(server))
    t.metrics({"train_loss": 1.0}, step=1)   # the first send goes at once
    assert sent.acquire(timeout=30)
    t.metrics({"train_loss": 0.5}, step=2)   # ... this one waits for the interval, then goes alone
    assert sent.acquire(timeout=30), "the batch was not sent without another call"
    assert [m[2] for m in server["runs"]["run0"].data.metrics] == [1, 2]
    assert t.close("FINISHED")


def test_a_tick_that_raises_is_reported_and_the_worker_goes_on():
    errors: list[BaseException] = []
    done = threading.Event()
    q = CallQueue(on_drop=lambda r: None, on_error=errors.append, tick=lambda: 1 / 0)
    q.submit(lambda: None)
    assert q.close(done.set, seconds=5) and done.is_set()
    assert ZeroDivisionError in {type(e) for e in errors}


def test_the_launchers_run_node_0_creates_it_the_other_nodes_find_it():
    server: dict = {"experiments": {}, "runs": {}}
    env = {"MLFLOW_TRACKING_URI": "http://fake", "MLFLOW_EXPERIMENT_NAME": "vision", "DDPJOB_UID": "u-1",
           "DDPJOB_NAME": "bert", "DDPJOB_MLFLOW_RUN_NAME": "a"}
    fake = {"client_factory": lambda uri: FakeClient(server)}
    with pytest.raises(LookupError, match="no run tagged ddpjob.key="):
        tracking.resolve(env, create=False, wait=0, **fake)   # a node before node 0 made it: none
    assert tracking.resolve(env, create=True, **fake) == ("run0", "0")
    assert tracking.resolve(env, create=False, **fake) == ("run0", "0")
    assert tracking.resolve(env, create=True, **fake) == ("run0", "0")   # the next attempt's node 0
    run = server["runs"]["run0"]
    assert run.data.tags[tracking.KEY_TAG] == tracking.run_key(env) and run.data.tags["ddpjob.name"] == "bert"
    # MLFLOW_RUN_ID (spec.env's): that run; one the server does not have: the job's, by its tag.
    other = FakeClient(server).create_run("0")
    assert tracking.resolve({**env, "MLFLOW_RUN_ID": other.info.run_id}, create=True, **fake)[0] == "run1"
    assert tracking.resolve({**env, "MLFLOW_RUN_ID": "gone"}, create=True, **fake)[0] == "run0"
    assert len(server["runs"]) == 2


def test_a_script_that_did_not_end_its_run_has_it_ended_by_its_launcher():
    server: dict = {"experiments": {}, "runs": {}}
    run = FakeClient(server).create_run("0")
    env = {"MLFLOW_TRACKING_URI": "http://fake", "MLFLOW_RUN_ID": run.info.run_id}
    assert tracking.end_if_running(env, "FAILED", client_factory=lambda uri: FakeClient(server))
    assert not tracking.end_if_running(env, "FINISHED", client_factory=lambda uri: FakeClient(server))
    assert run.info.status == "FAILED"


def test_the_tracker_resumes_the_launchers_run_and_reports_it():
    pytest.importorskip("mlflow")
    server: dict = {"experiments": {}, "runs": {}}
    made = FakeClient(server).create_run("0", tags={tracking.KEY_TAG: "other"})
    made.info.status = "FINISHED"
    opened: list = []
    t = Tracker(tracking_uri="http://fake", experiment="exp", run_name=None, key="k1", tags={}, warn=print,
                count_drop=lambda r: None, client_factory=lambda uri: FakeClient(server), run_id=made.info.run_id,
                on_open=lambda *ids: opened.append(ids))
    assert t.ready.wait(10) and t.run_id == made.info.run_id and opened == [(made.info.run_id, "0")]
    assert made.info.status == "RUNNING" and t.close("FINISHED") and len(server["runs"]) == 1


@pytest.mark.parametrize("text, shown", [
    ("https://user:secret@mlflow.example:443/x", "https://mlflow.example:443/x"),
    ("http://token@h/ and http://h2", "http://h/ and http://h2"),
    ("file:///data/mlruns", "file:///data/mlruns"),
    ("databricks", "databricks"),
])
def test_uris_lose_their_userinfo_wherever_they_are_shown(text, shown):
    assert public_uri(text) == shown


def test_params_never_carry_a_uris_credentials():
    pytest.importorskip("mlflow")
    server: dict = {"experiments": {}, "runs": {}}
    t = attempt(server, 0, [])
    t.params({"mlflow": {"tracking_uri": "https://u:pw@m.example"}})
    assert t.close("FINISHED")
    assert server["runs"]["run0"].data.params == {"mlflow.tracking_uri": "https://m.example"}


def test_the_jobs_record_names_the_job_its_resolved_config_and_its_last_checkpoint():
    env = {"DDPJOB_NAME": "bert", "DDPJOB_NAMESPACE": "team-a", "DDPJOB_UID": "u-1", "DDPJOB_ATTEMPT": "2",
           "NNODES": "4", "NPROC_PER_NODE": "8", "DDPJOB_IMAGE": "reg.example/bert:3"}
    config = {"lr": 0.1, "synthetic": {"shape": (3, 32, 32)}, "data_path": None, "compile": False,
              "mlflow": {"tracking_uri": "https://u:pw@m.example", "register_model": "bert"}}
    record = tracking.job_record(env, config, checkpoint="/ckpt/step-00000400")
    assert record == {
        "job": {"name": "bert", "namespace": "team-a", "uid": "u-1", "image": "reg.example/bert:3", "attempt": 2,
                "nodes": 4, "nprocPerNode": 8},
        "trainer": {"lr": 0.1, "synthetic": {"shape": [3, 32, 32]}, "data_path": None, "compile": False,
                    "mlflow": {"tracking_uri": "https://m.example", "register_model": "bert"}},
        "checkpoint": "/ckpt/step-00000400"}
    local = tracking.job_record({}, {}, checkpoint=None)
    assert local["job"] == {"name": "local", "namespace": "", "uid": "", "image": "", "attempt": 0, "nodes": 1,
                            "nprocPerNode": 1}
    assert local["checkpoint"] is None


def test_the_record_is_an_artifact_and_its_checkpoint_a_tag():
    pytest.importorskip("mlflow")
    server: dict = {"experiments": {}, "runs": {}}
    t = attempt(server, 0, [])
    t.record({"job": {"name": "j"}, "checkpoint": "/c/step-8"})
    assert t.close("FINISHED")
    assert json.loads(server["artifacts"][("run0", tracking.JOB_ARTIFACT)])["checkpoint"] == "/c/step-8"
    assert server["runs"]["run0"].data.tags[tracking.CHECKPOINT_TAG] == "/c/step-8"


def test_registering_makes_a_new_version_of_the_named_model_created_when_absent():
    server: dict = {"experiments": {}, "runs": {}}
    client = FakeClient(server)
    assert tracking.register(client, "digits", run_id="r1") == "1"
    assert tracking.register(client, "digits", run_id="r2") == "2"  # it exists: another version
    assert server["models"] == {"digits": [("runs:/r1/model", "r1"), ("runs:/r2/model", "r2")]}

    class Refusing(FakeClient):
        def create_registered_model(self, name):
            raise PermissionError("403 PERMISSION_DENIED")
    with pytest.raises(PermissionError):  # the tracker's worker counts and warns it (failed)
        tracking.register(Refusing(server), "other", run_id="r3")


def test_a_call_on_a_connection_the_server_just_closed_is_made_once_more():
    tries: list[str] = []

    class Closing:
        def log_batch(self, run_id):
            tries.append(run_id)
            if len(tries) == 1:  # what MLflow raises, worded by urllib3
                raise Exception("API request to http://m/api/2.0/mlflow/runs/log-batch failed with exception "
                                "HTTPConnectionPool(...): Max retries exceeded (Caused by ProtocolError("
                                "'Connection aborted.', RemoteDisconnected('Remote end closed connection')))")
            if run_id == "timeout":
                raise TimeoutError("Read timed out. (read timeout=5)")
            return "sent"
    client = tracking.OnceMore(Closing())
    assert client.log_batch("r1") == "sent" and tries == ["r1", "r1"]
    with pytest.raises(TimeoutError):  # anything else is not tried again: a hung server holds no longer
        client.log_batch("timeout")
    assert tries == ["r1", "r1", "timeout"]


def test_close_waits_for_a_queued_model_by_its_size():
    """A model's save and upload get a deadline that grows with it (a 7 GB model: 350 s more at the
    slow link's 20 MB/s), not one fixed for small models."""
    assert tracking.close_seconds(None) == tracking.CLOSE_SECONDS
    small, large = tracking.close_seconds(10**6), tracking.close_seconds(7 * 10**9)
    assert small == pytest.approx(tracking.CLOSE_SECONDS + tracking.MODEL_SECONDS + 0.05)
    assert large - small == pytest.approx((7e9 - 1e6) / 20e6)
    torch = pytest.importorskip("torch")
    server: dict = {"experiments": {}, "runs": {}}
    t = Tracker(tracking_uri="http://fake", experiment="e", run_name=None, key="k", tags={}, warn=print,
                count_drop=lambda r: None, client_factory=lambda uri: FakeClient(server))
    t._log_model = lambda *a: None   # the upload itself: tests/trainer/test_mlflow.py
    deadlines: list[float] = []
    close = t._calls.close
    t._calls.close = lambda final, *, seconds: (deadlines.append(seconds), close(final, seconds=seconds))[1]
    t.model(torch.nn.Linear(1000, 1000), torch_version=torch.__version__)
    assert t.close("FINISHED")
    assert deadlines == [tracking.close_seconds(4 * (1000 * 1000 + 1000))]   # float32 weight and bias


class FakeSystemMonitor:
    """MLflow's SystemMetricsMonitor as system_metrics() drives it; publish fails while `down`."""
    instances: list["FakeSystemMonitor"] = []
    down = 0

    def __init__(self, run_id, *, node_id, resume_logging, tracking_uri):
        self.sampling_interval = 0   # a sample every tick
        self.published: list[dict] = []
        self.samples = 0
        self.monitors = [types.SimpleNamespace(clear_metrics=lambda: None)]
        self.mlflow_logger = types.SimpleNamespace(data=[], flush=lambda: None)
        self.args = (run_id, node_id, resume_logging, tracking_uri)
        FakeSystemMonitor.instances.append(self)

    def collect_metrics(self):
        self.samples += 1

    def aggregate_metrics(self):
        return {"cpu_utilization_percentage": float(self.samples)}

    def publish_metrics(self, metrics):
        if FakeSystemMonitor.down:
            FakeSystemMonitor.down -= 1
            raise ConnectionError("server down")
        self.published.append(metrics)


def test_system_metrics_go_on_after_failed_requests_and_end_with_a_last_sample(monkeypatch):
    from mlflow.system_metrics import system_metrics_monitor

    monkeypatch.setattr(system_metrics_monitor, "SystemMetricsMonitor", FakeSystemMonitor)
    FakeSystemMonitor.instances, FakeSystemMonitor.down = [], 3
    warnings: list[str] = []
    env = {"MLFLOW_RUN_ID": "r1", "MLFLOW_TRACKING_URI": "http://fake"}
    ticks = iter(range(10))
    tracking.system_metrics(env, node_id="node_1", stopped=lambda: next(ticks) >= 6, warn=warnings.append, tick=0)
    (mon,) = FakeSystemMonitor.instances
    assert mon.args == ("r1", "node_1", True, "http://fake")
    # 7 samples: 6 while running (the first 3 lost with the server down), the last one at the stop.
    assert mon.samples == 7 and len(mon.published) == 4, (mon.samples, mon.published)
    assert len(warnings) == 1 and "system metrics of node_1 not logged: ConnectionError" in warnings[0]


def test_system_metrics_that_cannot_start_are_one_warning(monkeypatch):
    from mlflow.system_metrics import system_metrics_monitor

    def broken(*a, **kw):
        raise ModuleNotFoundError("No module named 'psutil'")
    monkeypatch.setattr(system_metrics_monitor, "SystemMetricsMonitor", broken)
    warnings: list[str] = []
    tracking.system_metrics({"MLFLOW_RUN_ID": "r1", "MLFLOW_TRACKING_URI": "http://fake"}, node_id="node_0",
                            stopped=lambda: False, warn=warnings.append)
    assert warnings == ["MLflow: system metrics of node_0 off: ModuleNotFoundError: No module named 'psutil'"]
