"""A real Prometheus (Debian package, on loopback) scraping a real local 2-node training run.

Asserts: every rank's endpoint exports the contract metrics with the contract labels; every query
of the job dashboard (variables substituted) and every recording rule returns data; every alert
expression is accepted by Prometheus. The GPU panels (memory, compute time, GPU per rank) are
checked against a process whose telemetry was fed by a fake CUDA module and device timer (no GPU
here) under its own ddpjob label.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import REPO_ROOT, wait_for
from tests.support.localrun import free_ports, in_stage, local_run, wait_ranks, write_digits_job

CHART = REPO_ROOT / "charts" / "ddpjob-operator"
RULES = CHART / "rules" / "ddpjob-alerts.yaml"
DASHBOARDS = CHART / "dashboards"

# CONTRACT (design.md): metrics every rank exports, and the labels on them.
TRAINER_METRICS = [
    "ddpjob_trainer_step", "ddpjob_trainer_epoch", "ddpjob_trainer_total_steps", "ddpjob_trainer_loss",
    "ddpjob_trainer_samples_total", "ddpjob_trainer_step_seconds_bucket", "ddpjob_trainer_step_seconds_sum",
    "ddpjob_trainer_step_seconds_count", "ddpjob_trainer_data_wait_seconds_total",
    "ddpjob_trainer_last_step_timestamp_seconds", "ddpjob_trainer_eval_accuracy",
    "ddpjob_trainer_eval_loss", "ddpjob_trainer_checkpoint_seconds", "ddpjob_trainer_restart_count",
    "ddpjob_trainer_stage", "ddpjob_trainer_stage_start_timestamp_seconds",
]
GPU_METRICS = ["ddpjob_trainer_gpu_memory_allocated_bytes", "ddpjob_trainer_gpu_memory_max_allocated_bytes",
               "ddpjob_trainer_gpu_memory_reserved_bytes", "ddpjob_trainer_compute_seconds",
               "ddpjob_trainer_gpu_info"]
JOB = "digits"
GPU_JOB = "gpu-fake"
NAMESPACE = "default"   # from_manifest's default namespace; the local runner labels with it


def ensure_prometheus() -> tuple[str, str]:
    """Paths of prometheus and promtool, installing Debian's package when missing."""
    out = subprocess.run([str(REPO_ROOT / "hack" / "ensure-prometheus.sh")], capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        pytest.fail(f"hack/ensure-prometheus.sh failed: {out.stderr[-2000:]}")
    prom = out.stdout.strip().splitlines()[-1]
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    return prom, promtool


class Prometheus:
    """A throw-away Prometheus on a free loopback port with a temp config and TSDB."""

    def __init__(self, binary: str, workdir: Path, *, targets: dict[str, list[str]], rule_files=(),
                 scrape_configs=()):
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": name, "static_configs": [{"targets": t}]}
                               for name, t in targets.items()] + list(scrape_configs),
        }
        cfg = workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115  (the child's for its lifetime)
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._ready, timeout=60, desc=f"prometheus ready on {self.url} (log {workdir}/prometheus.log)")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}")
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
            return r.status == 200

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; returns the JSON body even for a 400 (bad query)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def series(self, expr: str) -> list[dict]:
        body = self.query(expr)
        assert body.get("status") == "success", f"query failed: {expr}\n{body.get('error')}"
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


FAKE_GPU = textwrap.dedent("""
    import os, sys, time, types
    from ddpjob_trainer.telemetry import Telemetry, serve_node_endpoint
    # No GPU on this machine: a stand-in for torch.cuda's memory counters and device properties.
    cuda = types.SimpleNamespace(memory_allocated=lambda d: 3 << 30, max_memory_allocated=lambda d: 5 << 30,
                                 memory_reserved=lambda d: 6 << 30, get_device_properties=lambda d:
                                 types.SimpleNamespace(uuid="0a1b2c3d-0000-1111-2222-333344445555", name="fake"))
    fake_torch, device = types.SimpleNamespace(cuda=cuda), types.SimpleNamespace(type="cuda")
    t = Telemetry(labels={"ddpjob": "gpu-fake", "namespace": "default", "rank": "0", "local_rank": "0",
                          "node_rank": "0"})
    t.set_total_steps(10)
    t.gpu_memory(fake_torch, device)
    t.gpu_info(fake_torch, device)
    serve_node_endpoint(int(sys.argv[1]), os.environ["DDPJOB_METRICS_DIR"], addr="127.0.0.1")
    print("ready", flush=True)
    for _ in range(1800):   # device time keeps coming, as at a training job's log steps (rate() has data)
        t.compute([0.02])
        time.sleep(0.5)
""")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def prometheus_bin() -> tuple[str, str]:
    return ensure_prometheus()


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """`ddpjob run examples/digits.yaml --local --metrics-port-base P`, slowed so it outlives the checks."""
    work = tmp_path_factory.mktemp("train")
    # 40 epochs, slowed: long enough for every check below.
    with local_run(write_digits_job(work, epochs=40), work, DDPJOB_DEBUG_STEP_SLEEP="0.1") as run:
        gpu_port = free_ports(1)[0]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDPJOB_")}
        gpu = subprocess.Popen([sys.executable, "-c", FAKE_GPU, str(gpu_port)], stdout=subprocess.PIPE,
                               text=True, env=dict(env, DDPJOB_METRICS_DIR=str(work / "gpu-mp")),
                               start_new_session=True)
        try:
            assert gpu.stdout.readline().strip() == "ready"
            yield {"ports": run.ports, "gpu_port": gpu_port, "proc": run.proc, "log": run.log}
        finally:
            _stop(gpu)


# The operator's metrics endpoint, in a process of its own as the operator's is: served from a
# thread of the test process, its scrapes timed out for seconds at a time on a loaded machine
# (the test process's other work held it), and each miss reset the alert's `for`.
OPERATOR_EXPORTER = textwrap.dedent("""
    import sys, time
    from prometheus_client import CollectorRegistry, start_http_server
    from ddpjob_operator.app.operator_metrics import OperatorMetrics
    from ddpjob_operator.decisions.goodput import Observed, advance
    registry = CollectorRegistry()
    hang = float(sys.argv[2]) if sys.argv[2] else None
    now = time.time()  # a ledger as the operator's pass computes it: 100 s old, stepping for 70
    ledger = advance(None, Observed(now=now, created=now - 100, scheduled_at=now - 90, stepped_at=now - 70,
                                    ranks={"checkpointing": 3.0, "evaluating": 2.0}))
    OperatorMetrics(registry).record_pass((sys.argv[3], sys.argv[4]), prev_status={},
                                          status={"phase": "Running", "goodput": ledger}, hang_timeout=hang)
    start_http_server(int(sys.argv[1]), addr="127.0.0.1", registry=registry)
    print("ready", flush=True)
    time.sleep(3600)
""")


@contextlib.contextmanager
def operator_exporter(hang_timeout: float | None = None):
    """The operator's metrics (the real OperatorMetrics) on a loopback port, the run's job Running in
    them, as an in-cluster operator would export it; yields the port."""
    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-c", OPERATOR_EXPORTER, str(port),
                             "" if hang_timeout is None else f"{hang_timeout:g}", NAMESPACE, JOB],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield port
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def prom(prometheus_bin, training, tmp_path_factory):
    """Prometheus scraping both simulated nodes (+ the fake-GPU endpoint and the operator's metrics),
    with our rule file loaded."""
    with operator_exporter() as operator_port:
        targets = {"ddpjob-trainers": [f"127.0.0.1:{p}" for p in training["ports"]],
                   "ddpjob-gpu-fake": [f"127.0.0.1:{training['gpu_port']}"],
                   "ddpjob-operator": [f"127.0.0.1:{operator_port}"]}
        p = Prometheus(prometheus_bin[0], tmp_path_factory.mktemp("prom"), targets=targets, rule_files=[RULES])
        try:
            def enough():
                if training["proc"].poll() is not None:
                    raise AssertionError(f"training ended early ({training['proc'].returncode}); "
                                         f"log: {training['log'].read_text()[-3000:]}")
                ranks = p.series(f'ddpjob_trainer_step{{ddpjob="{JOB}"}} >= 30')
                evals = p.series(f'ddpjob_trainer_eval_accuracy{{ddpjob="{JOB}"}} > 0')
                ckpt = p.series(f'ddpjob_trainer_checkpoint_seconds{{ddpjob="{JOB}"}} > 0')
                rules = p.series("ddpjob:own_step_seconds:2m")
                return len(ranks) == 2 and len(evals) == 2 and ckpt and len(rules) == 2
            wait_for(enough, timeout=240, interval=1,
                     desc="both ranks past step 30 with an evaluation and a checkpoint, scraped by Prometheus")
            yield p
        finally:
            p.stop()


def substitute(expr: str, *, job: str = JOB, namespace: str = NAMESPACE) -> str:
    """Grafana's variables as the dashboard would fill them for one job, all ranks."""
    return (expr.replace("$namespace", namespace).replace("$ddpjob", job).replace("$rank", ".*")
            .replace("$__rate_interval", "30s").replace("$__range", "10m").replace("$__interval", "5s"))


def dashboard_targets(name: str):
    """(panel title, expr) of every query in a dashboard."""
    dash = json.loads((DASHBOARDS / name).read_text())
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            yield panel["title"], t["expr"]


def rules():
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_every_rank_exports_the_contract_metrics_with_labels(prom):
    for metric in TRAINER_METRICS:
        got = prom.series(f'{metric}{{ddpjob="{JOB}", namespace="{NAMESPACE}"}}')
        ranks = {(s["metric"].get("rank"), s["metric"].get("node_rank"), s["metric"].get("local_rank"))
                 for s in got}
        assert {("0", "0", "0"), ("1", "1", "0")} <= ranks, f"{metric}: {ranks}"
    # nothing of ours carries a `job` label other than Prometheus' own scrape job
    jobs = {s["metric"]["job"] for s in prom.series(f'ddpjob_trainer_step{{ddpjob="{JOB}"}}')}
    assert jobs == {"ddpjob-trainers"}


@pytest.mark.parametrize("title,expr", list(dashboard_targets("ddpjob-job.json")))
def test_job_dashboard_query_returns_data(prom, title, expr):
    job = GPU_JOB if any(m in expr for m in GPU_METRICS) else JOB
    got = prom.series(substitute(expr, job=job))
    assert got, f"panel {title!r}: no data for {substitute(expr, job=job)}"
    assert all(s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in got), f"panel {title!r}: {got}"


@pytest.mark.parametrize("title,expr", list(dashboard_targets("ddpjob-overview.json")))
def test_overview_dashboard_query_returns_data(prom, title, expr):
    """Every query of the all-jobs dashboard (namespace "All" is ".*"; here the run's own namespace)."""
    got = prom.series(substitute(expr))
    assert got, f"panel {title!r}: no data for {substitute(expr)}"
    assert all(s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in got), f"panel {title!r}: {got}"
    if "ddpjob_trainer_" in expr and "count(count" not in expr:
        assert JOB in {s["metric"].get("ddpjob") for s in got}, f"panel {title!r}: {got}"


def test_dashboard_variables_list_the_job_and_ranks(prom):
    dash = json.loads((DASHBOARDS / "ddpjob-job.json").read_text())
    values = {}
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"]["query"])
        assert m, var["query"]
        match = substitute(m.group(1))
        values[var["name"]] = prom.api(f"label/{m.group(2)}/values", **{"match[]": match})["data"]
    assert NAMESPACE in values["namespace"] and JOB in values["ddpjob"]
    assert {"0", "1"} <= set(values["rank"])


@pytest.mark.parametrize("rule", [r["record"] for r in rules() if "record" in r])
def test_recording_rule_returns_data(prom, rule):
    got = prom.series(f'{rule}{{ddpjob="{JOB}"}}')
    assert got, f"recording rule {rule} has no data"


@pytest.mark.parametrize("alert", [r["alert"] for r in rules() if "alert" in r])
def test_alert_expression_is_valid_against_real_series(prom, alert):
    rule = next(r for r in rules() if r.get("alert") == alert)
    body = prom.query(rule["expr"])
    assert body["status"] == "success", f"{alert}: {body.get('error')}"
    # A healthy run fires nothing (firing is covered by promtool test rules).
    assert body["data"]["result"] == [], f"{alert} fires on a healthy run: {body['data']['result']}"
    loaded = {r["name"]: r for g in prom.api("rules")["data"]["groups"] for r in g["rules"]}
    assert loaded[alert]["health"] == "ok", loaded[alert]


# ---- a job frozen before its first step ------------------------------------------------------------
EARLY_HANG_TIMEOUT = 20


@pytest.fixture(scope="module")
def frozen_before_first_step(tmp_path_factory):
    """A real 2-node run whose rank 1 freezes on entering first_step (rank 0 then waits in the first
    all-reduce): no step is ever taken. Beside it, the operator's own metrics exporter (the real
    OperatorMetrics) exporting the job's hangTimeoutSeconds, as an in-cluster operator would."""
    work = tmp_path_factory.mktemp("early")
    with operator_exporter(hang_timeout=EARLY_HANG_TIMEOUT) as operator_port, \
            local_run(write_digits_job(work, epochs=40, restart_on_hang=False), work,
                      DDPJOB_DEBUG_FREEZE_STAGE="1:first_step") as run:
        # Prometheus starts once both ranks are in first_step: a cold rendezvous longer than the
        # 20 s timeout would otherwise be the (rightly) pending alert, for stage rendezvous.
        wait_ranks(run, in_stage("first_step"), "both ranks in first_step")
        yield {"ports": run.ports, "operator_port": operator_port, "proc": run.proc, "log": run.log}


def test_stalled_fires_for_a_job_frozen_before_its_first_step(prometheus_bin, frozen_before_first_step,
                                                              tmp_path):
    run = frozen_before_first_step
    targets = {"ddpjob-trainers": [f"127.0.0.1:{p}" for p in run["ports"]],
               "ddpjob-operator": [f"127.0.0.1:{run['operator_port']}"]}
    p = Prometheus(prometheus_bin[0], tmp_path / "prom", targets=targets, rule_files=[RULES])
    try:
        def alert_state(state: str):
            if run["proc"].poll() is not None:
                raise AssertionError(f"training ended ({run['proc'].returncode}): {run['log'].read_text()[-3000:]}")
            alerts = [a for a in p.api("alerts")["data"]["alerts"] if a["labels"]["alertname"] == "DDPJobStalled"]
            return [a for a in alerts if a["state"] == state]

        # pending once the job has been stuck for its own 20 s (not the 600 s default), firing after `for`
        pending = wait_for(lambda: alert_state("pending") or alert_state("firing"), timeout=120, interval=1,
                           desc="DDPJobStalled pending for the frozen job")
        assert p.series(f'ddpjob:hang_timeout_seconds{{ddpjob="{JOB}"}} == {EARLY_HANG_TIMEOUT}')
        assert not p.series(f'ddpjob_trainer_step{{ddpjob="{JOB}"}}'), "the job took a step"
        firing = wait_for(lambda: alert_state("firing"), timeout=240, interval=2, desc="DDPJobStalled firing")
        labels = {(a["labels"]["namespace"], a["labels"]["ddpjob"], a["labels"].get("stage")) for a in firing}
        assert labels == {(NAMESPACE, JOB, "first_step")}, firing
        assert pending[0]["labels"].get("stage") == "first_step"
        desc = firing[0]["annotations"]["description"]
        assert desc.startswith(f"DDPJob {JOB} has not finished its first step: ranks have been in stage first_step"), desc
    finally:
        p.stop()
