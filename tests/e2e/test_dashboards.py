"""Dashboards, monitors and rules as shipped by the chart (helm template), and the metric names
they query checked against what the trainer really exports."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import yaml

from tests.support.cluster import OPERATOR_IMAGE_VALUES, REPO_ROOT

CHART = REPO_ROOT / "charts" / "ddpjob-operator"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
RULES = CHART / "rules" / "ddpjob-alerts.yaml"
HELM = REPO_ROOT / ".cache" / "bin" / "helm"
MONITORING = ("podMonitor", "serviceMonitor", "prometheusRule", "dashboards")

EXPORTER = textwrap.dedent("""
    import sys, types
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from ddpjob_trainer.telemetry import Telemetry
    t = Telemetry.from_env()
    t.set_total_steps(2); t.set_restart_count(0); t.step_started(step=1)
    t.step(step=1, epoch=0, loss=1.0, samples=1, step_seconds=0.1, data_wait_seconds=0.0, timestamp=1.0)
    t.eval(accuracy=0.5, loss=1.0); t.checkpoint(0.1); t.set_stage("eval"); t.set_stage("training")
    cuda = types.SimpleNamespace(memory_allocated=lambda d: 1, max_memory_allocated=lambda d: 1,
                                 memory_reserved=lambda d: 1)     # no GPU here: torch.cuda stand-in
    t.gpu_memory(types.SimpleNamespace(cuda=cuda), types.SimpleNamespace(type="cuda"))
    cuda.get_device_properties = lambda d: types.SimpleNamespace(uuid="0-1", name="fake")
    t.gpu_info(types.SimpleNamespace(cuda=cuda), types.SimpleNamespace(type="cuda"))
    t.compute([0.05])                                             # DeviceTimer.read() at a log step
    reg = CollectorRegistry(); MultiProcessCollector(reg, path=sys.argv[1])
    print(generate_latest(reg).decode())
""")


def annotations(path) -> list[dict]:
    return json.loads(path.read_text())["annotations"]["list"]


def exprs() -> list[str]:
    out = [t["expr"] for d in DASHBOARDS for p in json.loads(d.read_text())["panels"] for t in p.get("targets", [])]
    out += [a["expr"] for d in DASHBOARDS for a in annotations(d)]
    out += [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """Sample names a rank really exposes (multiprocess exposition, as the pod endpoint serves it)."""
    d = tmp_path_factory.mktemp("mp")
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["DDPJOB_METRICS_DIR"] = str(d)
    text = subprocess.run([sys.executable, "-c", EXPORTER, str(d)], env=env, check=True, capture_output=True,
                          text=True, timeout=120).stdout
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_trainer_metric_queried_is_exported(exported):
    queried = {m for e in exprs() for m in re.findall(r"\bddpjob_trainer_\w+", e)}
    assert queried, "no trainer metric queried at all?"
    assert queried <= exported, f"queried but never exported: {sorted(queried - exported)}"


def test_every_operator_metric_queried_is_exported():
    from prometheus_client import CollectorRegistry, generate_latest

    from ddpjob_operator.app.operator_metrics import RECOVERY_KINDS, OperatorMetrics

    from ddpjob_operator.decisions.goodput import Observed, advance

    m = OperatorMetrics(CollectorRegistry(), namespaces=["ns"])
    m.record_pass(("ns", "j"), prev_status={}, status={"phase": "Failed", "reason": "PodFailed",
                                                      "goodput": advance(None, Observed(now=100.0, created=0.0))},
                  hang_timeout=60)
    m.record_pass(("ns", "waiting"), prev_status={}, status={"phase": "Pending"})
    m.reconcile_seconds.observe(0.1)
    m.reconcile_errors.inc()
    text = generate_latest(m.registry).decode()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    queried = {x for e in exprs() for x in re.findall(r"\bddpjob_operator_\w+", e)}
    assert {"ddpjob_operator_job_hang_timeout_seconds", "ddpjob_operator_job_failed_timestamp_seconds",
            "ddpjob_operator_recovery_seconds_bucket", "ddpjob_operator_recovery_steps_lost_bucket"} <= queried
    assert queried <= exported, f"queried but never exported: {sorted(queried - exported)}"
    kinds = {k for e in exprs() for k in re.findall(r'ddpjob_operator_recovery_\w+\{kind="(\w+)"', e)}
    assert kinds == set(RECOVERY_KINDS), kinds  # the kinds of restart the operator observes


def test_no_label_named_job_is_used():
    for e in exprs():
        assert not re.search(r"[{,(]\s*job\s*[=~!]", e), e


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_readable_and_well_formed(path):
    text = path.read_text()
    assert text.startswith("{\n  "), "dashboards are pretty-printed JSON (readable diffs)"
    d = json.loads(text)
    assert d["uid"] and d["title"].startswith("DDPJob")
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        assert all(t["expr"].strip() for t in p["targets"])


def test_job_dashboard_has_the_required_views_and_variables():
    d = json.loads((CHART / "dashboards" / "ddpjob-job.json").read_text())
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"namespace", "ddpjob", "rank"} <= names
    titles = " | ".join(p["title"].lower() for p in d["panels"])
    for view in ("state", "progress", "eta", "loss", "throughput per rank", "step time per rank",
                 "data-wait", "gpu memory", "restarts", "checkpoint", "where the time went", "goodput"):
        assert view in titles, view


def test_overview_dashboard_shows_every_job_and_opens_each_one():
    d = json.loads((CHART / "dashboards" / "ddpjob-overview.json").read_text())
    ns = next(v for v in d["templating"]["list"] if v["name"] == "namespace")
    assert ns["multi"] and ns["includeAll"] and ns["allValue"] == ".*"     # all namespaces at once
    for p in d["panels"]:
        for t in p["targets"]:
            assert 'namespace=~"$namespace"' in t["expr"], (p["title"], t["expr"])
    titles = " | ".join(p["title"].lower() for p in d["panels"])
    for view in ("jobs training", "jobs by phase", "group restarts", "jobs failed", "throughput per job",
                 "progress per job", "time since last step per job", "step time per job", "data-wait share per job",
                 "where the time went", "goodput per job"):
        assert view in titles, view
    table = next(p for p in d["panels"] if p["title"] == "Jobs")
    assert all(t.get("instant") and t.get("format") == "table" for t in table["targets"])
    renamed = next(t for t in table["transformations"] if t["id"] == "organize")["options"]["renameByName"]
    assert set(renamed) == {f"Value #{t['refId']}" for t in table["targets"]}      # every column named
    link = next(o for o in table["fieldConfig"]["overrides"] if o["matcher"]["options"] == "ddpjob")
    job = json.loads((CHART / "dashboards" / "ddpjob-job.json").read_text())
    url = link["properties"][0]["value"][0]["url"]
    assert url.startswith(f"/d/{job['uid']}/") and "var-namespace=" in url and "var-ddpjob=${__value.raw}" in url


@pytest.mark.parametrize("name", ["ddpjob-overview.json", "ddpjob-job.json"])
def test_job_dashboards_mark_each_new_attempt(name):
    """A group restart shows on the time axis: the ranks' restart count went up (promtool checks the
    expression in tests/e2e/test_prometheus_rules.py)."""
    marks = [a for a in annotations(CHART / "dashboards" / name) if "ddpjob_trainer_restart_count" in a["expr"]]
    assert len(marks) == 1, marks
    a = marks[0]
    assert a["enable"] and a["datasource"]["uid"] == "${datasource}" and "{{ddpjob}}" in a["textFormat"]


def helm_template(*sets: str) -> list[dict]:
    if not HELM.exists():
        pytest.fail(f"{HELM} missing: run `make cluster-up` (it builds and links helm)")
    args = [str(HELM), "template", "t", str(CHART)]
    for s in (*OPERATOR_IMAGE_VALUES, *sets):
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_monitoring_objects_are_off_by_default():
    kinds = {d["kind"] for d in helm_template()}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
    assert not [d for d in helm_template() if d["kind"] == "ConfigMap"
                and (d["metadata"].get("labels") or {}).get("grafana_dashboard")]


@pytest.mark.parametrize("flag", MONITORING)
def test_each_flag_enables_only_its_object(flag):
    docs = helm_template(f"monitoring.{flag}.enabled=true", f"monitoring.{flag}.labels.release=kp")
    ours = [d for d in docs if d["kind"] in ("PodMonitor", "ServiceMonitor", "PrometheusRule")
            or (d["kind"] == "ConfigMap" and (d["metadata"].get("labels") or {}).get("grafana_dashboard"))]
    expected = {"podMonitor": {"PodMonitor"}, "serviceMonitor": {"ServiceMonitor"},
                "prometheusRule": {"PrometheusRule"}, "dashboards": {"ConfigMap"}}[flag]
    assert {d["kind"] for d in ours} == expected
    assert all(d["metadata"]["labels"]["release"] == "kp" for d in ours)


def test_shipped_objects_carry_the_files():
    on = [f"monitoring.{f}.enabled=true" for f in MONITORING]
    docs = helm_template(*on)
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())       # byte-for-byte the promtool-tested rules
    cms = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    shipped = {k: json.loads(v) for cm in cms for k, v in cm["data"].items()}
    assert shipped == {p.name: json.loads(p.read_text()) for p in DASHBOARDS}
    pm = next(d for d in docs if d["kind"] == "PodMonitor")
    ep = pm["spec"]["podMetricsEndpoints"][0]
    assert ep["port"] == "metrics" and ep["honorLabels"] is False    # metadata labels win (test_monitor_labels.py)
    assert pm["spec"]["selector"]["matchExpressions"][0]["key"] == "ddpjob.dev/job-name"
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True      # keep the jobs' namespace label
    svc = next(d for d in docs if d["kind"] == "Service" and any(p.get("name") == "metrics"
                                                                  for p in d["spec"]["ports"]))
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
