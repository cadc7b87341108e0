"""The alert rules under promtool (Debian's prometheus package): syntax, and each alert firing
exactly in its scenario (and staying silent in the healthy twin)."""
from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_dashboards import helm_template
from tests.e2e.test_prometheus import RULES, ensure_prometheus, rules

RUNBOOK = "https://github.com/ddpjob/ddpjob/blob/main/docs/runbook.md"


@pytest.fixture(scope="module")
def promtool() -> str:
    return ensure_prometheus()[1]


def series(metric: str, values: str, **labels: str) -> dict:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{metric}{{{body}}}", "values": values}


def rank(r: int) -> dict:
    return {"namespace": "ns", "ddpjob": "j", "rank": str(r), "node_rank": str(r)}


def lockstep(step_sums: list[str], waits: list[str] = ("0x60", "0x60")) -> list[dict]:
    """Two DDP ranks at 1 step/s; step_sums[r] / waits[r]: rank r's step_seconds_sum / data wait series."""
    out = []
    for r, (ssum, wait) in enumerate(zip(step_sums, waits)):
        out += [series("ddpjob_trainer_step", "0+15x60", **rank(r)),
                series("ddpjob_trainer_last_step_timestamp_seconds", "0+15x60", **rank(r)),
                series("ddpjob_trainer_step_seconds_count", "0+15x60", **rank(r)),
                series("ddpjob_trainer_step_seconds_sum", ssum, **rank(r)),
                series("ddpjob_trainer_data_wait_seconds_total", wait, **rank(r))]
    return out


def straggler_alert(ratio: str) -> dict:
    return {"exp_labels": {"severity": "warning", **rank(0)},
            "exp_annotations": {
                "summary": "DDPJob ns/j: rank 0 is a straggler",
                "description": f"Rank 0 (node rank 0) needs {ratio}x the fastest rank's own time per step; "
                               "the other ranks wait for it in all-reduce."}}


def stalled_alert(duration: str) -> dict:
    return {"exp_labels": {"severity": "critical", "namespace": "ns", "ddpjob": "j"},
            "exp_annotations": {
                "summary": "DDPJob ns/j is stalled",
                "description": f"No rank of j finished a training step for {duration}. See `kubectl describe ddpj j "
                               "-n ns` (Stalled condition names the ranks)."}}


SCENARIOS = {
    # Rank 0 sleeps outside its step (0.2 s of work); rank 1 waits 0.8 s for it inside all-reduce.
    "straggler": {"interval": "15s", "input_series": lockstep(["0+3x60", "0+15x60"]), "alert_rule_test": [
        {"eval_time": "3m", "alertname": "DDPJobStraggler", "exp_alerts": []},   # `for: 5m` not yet over
        {"eval_time": "9m", "alertname": "DDPJobStraggler", "exp_alerts": [straggler_alert("5")]},
        {"eval_time": "9m", "alertname": "DDPJobStalled", "exp_alerts": []},
    ]},
    # Rank 0's input pipeline is slow: 0.8 s of data wait inside its 1 s step; rank 1 spends the
    # same 0.8 s in all-reduce. Step times are equal; the data wait tells them apart.
    "straggler-data": {"interval": "15s",
                       "input_series": lockstep(["0+15x60", "0+15x60"], ["0+12x60", "0x60"]),
                       "alert_rule_test": [
        {"eval_time": "9m", "alertname": "DDPJobStraggler", "exp_alerts": [straggler_alert("5")]},
    ]},
    "healthy": {"interval": "15s", "input_series": lockstep(["0+3x60", "0+3x60"]), "alert_rule_test": [
        {"eval_time": "9m", "alertname": "DDPJobStraggler", "exp_alerts": []},
        {"eval_time": "9m", "alertname": "DDPJobStalled", "exp_alerts": []},
        {"eval_time": "9m", "alertname": "DDPJobDataLoaderStarving", "exp_alerts": []},
    ]},
    # Last step at t=100 s, still scraped, the job sets no hangTimeoutSeconds: stalled after 600 s + `for: 2m`.
    "stalled": {"interval": "1m", "input_series": [
        series("ddpjob_trainer_last_step_timestamp_seconds", "100x30", **rank(0)),
        series("ddpjob_trainer_last_step_timestamp_seconds", "90x30", **rank(1)),
    ], "alert_rule_test": [
        {"eval_time": "12m", "alertname": "DDPJobStalled", "exp_alerts": []},
        {"eval_time": "15m", "alertname": "DDPJobStalled", "exp_alerts": [stalled_alert("13m 20s")]},
    ]},
    # spec.hangTimeoutSeconds=120, exported by the operator: stalled after 120 s + `for: 2m`.
    "stalled-own-timeout": {"interval": "1m", "input_series": [
        series("ddpjob_trainer_last_step_timestamp_seconds", "100x30", **rank(0)),
        series("ddpjob_operator_job_hang_timeout_seconds", "120x30", namespace="ns", ddpjob="j"),
    ], "alert_rule_test": [
        {"eval_time": "3m", "alertname": "DDPJobStalled", "exp_alerts": []},
        {"eval_time": "6m", "alertname": "DDPJobStalled", "exp_alerts": [stalled_alert("4m 20s")]},
    ]},
    # spec.hangTimeoutSeconds=1800 (a slow checkpoint is normal for this job): 600 s is not a stall.
    "stalled-long-timeout": {"interval": "1m", "input_series": [
        series("ddpjob_trainer_last_step_timestamp_seconds", "100x40", **rank(0)),
        series("ddpjob_operator_job_hang_timeout_seconds", "1800x40", namespace="ns", ddpjob="j"),
    ], "alert_rule_test": [
        {"eval_time": "15m", "alertname": "DDPJobStalled", "exp_alerts": []},
        {"eval_time": "35m", "alertname": "DDPJobStalled", "exp_alerts": [stalled_alert("33m 20s")]},
    ]},
    # Job j failed at t=180 s (the operator exports its status.completionTime): one alert naming the
    # job and its reason, for 10 minutes.
    "failed": {"interval": "1m", "input_series": [
        series("ddpjob_operator_job_failed_timestamp_seconds", "_ _ _ 180x20", namespace="ns", ddpjob="j",
               reason="ImagePullBackOff"),
        series("ddpjob_operator_job_failed_timestamp_seconds", "_ _ _ -3600x20", namespace="ns", ddpjob="old",
               reason="PodFailed"),                      # failed an hour before: silent
    ], "alert_rule_test": [
        {"eval_time": "2m", "alertname": "DDPJobFailed", "exp_alerts": []},
        {"eval_time": "5m", "alertname": "DDPJobFailed", "exp_alerts": [{
            "exp_labels": {"severity": "warning", "namespace": "ns", "ddpjob": "j", "reason": "ImagePullBackOff"},
            "exp_annotations": {
                "summary": "DDPJob ns/j failed: ImagePullBackOff",
                "description": "DDPJob j in namespace ns failed with reason ImagePullBackOff. "
                               "`kubectl describe ddpj j -n ns` has the message."}}]},
        {"eval_time": "14m", "alertname": "DDPJobFailed", "exp_alerts": []},   # 11 minutes later
    ]},
    # 12 of every 15 seconds of stepping are data wait (80 %).
    "starving": {"interval": "1m", "input_series": [
        series("ddpjob_trainer_data_wait_seconds_total", "0+12x40", **rank(0)),
        series("ddpjob_trainer_step_seconds_sum", "0+15x40", **rank(0)),
        series("ddpjob_trainer_data_wait_seconds_total", "0+1x40", **rank(1)),
        series("ddpjob_trainer_step_seconds_sum", "0+15x40", **rank(1)),
    ], "alert_rule_test": [
        {"eval_time": "8m", "alertname": "DDPJobDataLoaderStarving", "exp_alerts": []},
        {"eval_time": "20m", "alertname": "DDPJobDataLoaderStarving", "exp_alerts": [{
            "exp_labels": {"severity": "warning", **rank(0)},
            "exp_annotations": {
                "summary": "DDPJob ns/j: data loader starves rank 0",
                "description": "Rank 0 waits for input 80% of each step. Raise DataLoader workers, use faster "
                               "storage, or prefetch."}}]},
    ]},
    # The operator was scraped for 10 minutes, then its target went (staleness: its series count as
    # present for 5 more): absent from 15m, firing after `for: 5m`.
    "operator-down": {"interval": "1m", "input_series": [
        series("ddpjob_operator_reconcile_seconds_count", "0+1x10", instance="op:8080"),
    ], "alert_rule_test": [
        {"eval_time": "12m", "alertname": "DDPJobOperatorDown", "exp_alerts": []},
        {"eval_time": "18m", "alertname": "DDPJobOperatorDown", "exp_alerts": []},    # `for` not over
        {"eval_time": "25m", "alertname": "DDPJobOperatorDown", "exp_alerts": [{
            "exp_labels": {"severity": "critical"},
            "exp_annotations": {
                "summary": "No DDPJob operator is up (or none is scraped)",
                "description": "Prometheus has no ddpjob_operator_* series from any operator replica. While no "
                               "operator runs, no DDPJob is reconciled: new jobs get no pods, failed pods are not "
                               "restarted, finished jobs keep their phase."}}]},
    ]},
    "operator-up": {"interval": "1m", "input_series": [
        series("ddpjob_operator_reconcile_seconds_count", "0+1x40", instance="op:8080"),
    ], "alert_rule_test": [
        {"eval_time": "30m", "alertname": "DDPJobOperatorDown", "exp_alerts": []},
    ]},
    # Two failed passes a minute for 40 minutes (a job that cannot be reconciled, retried with backoff):
    # rate > 0 from 1m, firing after `for: 15m`.
    "reconcile-errors": {"interval": "1m", "input_series": [
        series("ddpjob_operator_reconcile_errors_total", "0+2x40", instance="op:8080"),
    ], "alert_rule_test": [
        {"eval_time": "10m", "alertname": "DDPJobReconcileErrors", "exp_alerts": []},
        {"eval_time": "20m", "alertname": "DDPJobReconcileErrors", "exp_alerts": [{
            "exp_labels": {"severity": "warning", "instance": "op:8080"},
            "exp_annotations": {
                "summary": "DDPJob operator op:8080: reconcile passes keep failing",
                "description": "33.33m failed reconcile passes per second over the last 5 minutes. The "
                               "operator's log names each job and its error, on lines `reconcile "
                               "<namespace>/<job> failed (retry in ...)`."}}]},
    ]},
    # Three errors at 5m (an API server restart), none after: never 15 minutes of them.
    "reconcile-errors-transient": {"interval": "1m", "input_series": [
        series("ddpjob_operator_reconcile_errors_total", "0x4 3x36", instance="op:8080"),
    ], "alert_rule_test": [
        {"eval_time": "8m", "alertname": "DDPJobReconcileErrors", "exp_alerts": []},
        {"eval_time": "25m", "alertname": "DDPJobReconcileErrors", "exp_alerts": []},
    ]},
    # j Pending since t=60 s and still is; k was Pending for 5 minutes, then ran (its series went).
    "pending": {"interval": "1m", "input_series": [
        series("ddpjob_operator_job_pending_since_timestamp_seconds", "60x30", namespace="ns", ddpjob="j"),
        series("ddpjob_operator_job_pending_since_timestamp_seconds", "60x5", namespace="ns", ddpjob="k"),
    ], "alert_rule_test": [
        {"eval_time": "10m", "alertname": "DDPJobPendingTooLong", "exp_alerts": []},
        {"eval_time": "20m", "alertname": "DDPJobPendingTooLong", "exp_alerts": [{
            "exp_labels": {"severity": "warning", "namespace": "ns", "ddpjob": "j"},
            "exp_annotations": {
                "summary": "DDPJob ns/j has been Pending for 19m 0s",
                "description": "DDPJob j in namespace ns has not started all its nodes. `kubectl describe ddpj j "
                               "-n ns` (conditions Unschedulable, ContainersNotStarting, GangScheduled, Admitted) "
                               "and its pods' events say why."}}]},
    ]},
}
NEW_ALERTS = {"DDPJobOperatorDown", "DDPJobReconcileErrors", "DDPJobPendingTooLong"}


def with_runbooks(test: dict, base: str = RUNBOOK) -> dict:
    """A scenario whose expected alerts also carry their runbook_url (every alert has one)."""
    test = copy.deepcopy(test)
    for t in test["alert_rule_test"]:
        for a in t["exp_alerts"]:
            a["exp_annotations"]["runbook_url"] = f"{base}#{t['alertname'].lower()}"
    return test


def promtool_test(promtool: str, tmp_path: Path, tests: list[dict], *, rule_file: Path | None = None,
                  interval: str = "1m", what: str = "") -> None:
    """`promtool test rules` on `tests` (with `rule_file`'s rules, our two groups in order, else none)."""
    spec: dict = {"rule_files": [str(rule_file)] if rule_file else [], "evaluation_interval": interval}
    if rule_file:
        # promtool evaluates the two groups in a random order unless told: an alert evaluated first
        # sees the previous evaluation's recorded value, and the duration in its description is 15 s
        # off the expected one (harmless on a server, whose groups run on their own timers anyway).
        spec["group_eval_order"] = ["ddpjob.rules", "ddpjob.alerts"]
    f = tmp_path / "promtool.test.yaml"
    f.write_text(yaml.safe_dump({**spec, "tests": tests}, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{what}{out.stdout}{out.stderr}"


def test_promtool_check_rules(promtool):
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_every_alert_has_a_firing_scenario():
    alerts = {r["alert"] for r in rules() if "alert" in r}
    fired = {t["alertname"] for s in SCENARIOS.values() for t in s["alert_rule_test"] if t["exp_alerts"]}
    assert alerts == fired == {"DDPJobStalled", "DDPJobStraggler", "DDPJobFailed", "DDPJobDataLoaderStarving",
                               *NEW_ALERTS}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_alert_scenario(promtool, tmp_path, name):
    promtool_test(promtool, tmp_path, [with_runbooks(SCENARIOS[name])], rule_file=RULES, interval="15s")


def counter_panels() -> list[tuple[str, str]]:
    out = []
    for name in ("ddpjob-operator.json", "ddpjob-overview.json"):
        d = json.loads((RULES.parent.parent / "dashboards" / name).read_text())
        out += [(f"{d['title']}: {p['title']}", t["expr"].replace("$namespace", ".*"))
                for p in d["panels"] for t in p["targets"]
                if re.search(r"ddpjob_operator_\w+_total", t["expr"]) and "increase(" in t["expr"]]
    return out


@pytest.mark.parametrize("title,expr", counter_panels(), ids=lambda v: v if len(v) < 40 else None)
def test_counter_panels_count_the_first_event_of_every_series(promtool, tmp_path, title, expr):
    """Over the last 10 minutes: one series born at 1 (the operator's first failure in a namespace
    before it was ever scraped), one born at 0 that went to 1, one that did not move: 2 events."""
    metric = re.search(r"ddpjob_operator_\w+_total", expr).group(0)
    q = expr.replace("$__range", "10m").replace("$__rate_interval", "10m")
    labels = {"reason": "R"} if "by (reason)" in q else {}
    test = {"interval": "1m", "input_series": [
        series(metric, "_x9 1x6", namespace="a", **labels),
        series(metric, "0x7 1x8", namespace="b", **labels),
        series(metric, "2x15", namespace="c", **labels),
    ], "promql_expr_test": [{"expr": q, "eval_time": "15m", "exp_samples": [
        {"labels": "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "value": 2}]}]}
    promtool_test(promtool, tmp_path, [test], what=f"{title}: ")


@pytest.mark.parametrize("hang,state", [(None, 0), (120, 1), (1800, 0)])
def test_training_state_panel_uses_the_jobs_hang_timeout(promtool, tmp_path, hang, state):
    """Last step 200 s ago: Stalled (1) only when the job's own hangTimeoutSeconds is shorter."""
    d = json.loads((RULES.parent.parent / "dashboards" / "ddpjob-job.json").read_text())
    expr = next(p["targets"][0]["expr"] for p in d["panels"] if p["title"] == "Training state")
    q = expr.replace("$namespace", "ns").replace("$ddpjob", "j")
    inputs = [series("ddpjob_trainer_step", "5x10", **rank(0)), series("ddpjob_trainer_total_steps", "100x10", **rank(0)),
              series("ddpjob_trainer_last_step_timestamp_seconds", "100x10", **rank(0))]
    if hang:
        inputs.append(series("ddpjob_operator_job_hang_timeout_seconds", f"{hang}x10", namespace="ns", ddpjob="j"))
    test = {"interval": "1m", "input_series": inputs, "promql_expr_test": [
        {"expr": q, "eval_time": "5m", "exp_samples": [{"labels": '{ddpjob="j", namespace="ns"}', "value": state}]}]}
    promtool_test(promtool, tmp_path, [test])


def chart_rules(tmp_path, *sets: str) -> tuple[Path, dict]:
    """The chart's PrometheusRule (helm template with `sets`), as a plain rule file for promtool."""
    docs = helm_template("monitoring.prometheusRule.enabled=true", *sets)
    spec = next(d for d in docs if d["kind"] == "PrometheusRule")["spec"]
    f = tmp_path / "chart-rules.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    return f, spec


def test_alert_settings_come_from_values(promtool, tmp_path):
    """Severity, `for`, runbook base and enabled, set in values, are what Prometheus evaluates."""
    f, spec = chart_rules(tmp_path, "monitoring.prometheusRule.alerts.DDPJobPendingTooLong.for=30m",
                          "monitoring.prometheusRule.alerts.DDPJobPendingTooLong.severity=page",
                          "monitoring.prometheusRule.alerts.DDPJobStraggler.enabled=false",
                          "monitoring.prometheusRule.runbookBaseURL=https://wiki.example/ddpjob")
    alerts = {r["alert"] for g in spec["groups"] for r in g["rules"] if "alert" in r}
    assert "DDPJobStraggler" not in alerts and "DDPJobPendingTooLong" in alerts
    pending = copy.deepcopy(SCENARIOS["pending"])
    pending["alert_rule_test"] = [
        {"eval_time": "20m", "alertname": "DDPJobPendingTooLong", "exp_alerts": []},     # 15m no longer
        {"eval_time": "30m", "alertname": "DDPJobPendingTooLong", "exp_alerts": [{
            "exp_labels": {"severity": "page", "namespace": "ns", "ddpjob": "j"},
            "exp_annotations": {**pending["alert_rule_test"][1]["exp_alerts"][0]["exp_annotations"],
                                "summary": "DDPJob ns/j has been Pending for 29m 0s"}}]}]
    pending["input_series"] = [series("ddpjob_operator_job_pending_since_timestamp_seconds", "60x40",
                                      namespace="ns", ddpjob="j")]
    promtool_test(promtool, tmp_path, [with_runbooks(pending, "https://wiki.example/ddpjob")], rule_file=f, interval="15s")


def test_every_alert_has_its_settings_in_values():
    """values.yaml names every alert of the rule file (the chart fails on one it lacks) and its defaults
    are the rule file's: the promtool scenarios above test what a default install runs."""
    values = yaml.safe_load((RULES.parent.parent / "values.yaml").read_text())["monitoring"]["prometheusRule"]
    assert values["runbookBaseURL"] == RUNBOOK
    in_file = {r["alert"]: r for r in rules() if "alert" in r}
    assert set(values["alerts"]) == set(in_file)
    for name, r in in_file.items():
        expected = {"enabled": True, "severity": r["labels"]["severity"], "for": r.get("for", "")}
        if "threshold" in values["alerts"][name]:
            expected["threshold"] = float(re.search(r" > ([0-9.]+)$", r["expr"].strip()).group(1))
        assert values["alerts"][name] == expected, name
    assert "threshold" in values["alerts"]["DDPJobDataLoaderStarving"]


@pytest.mark.parametrize("threshold,fires", [("0.7", True), ("0.9", False)])
def test_data_wait_threshold_comes_from_values(promtool, tmp_path, threshold, fires):
    """The starving scenario's rank waits 80 % of each step: above a 0.7 threshold, below 0.9."""
    f, _ = chart_rules(tmp_path, f"monitoring.prometheusRule.alerts.DDPJobDataLoaderStarving.threshold={threshold}")
    scenario = copy.deepcopy(SCENARIOS["starving"])
    if not fires:
        for t in scenario["alert_rule_test"]:
            t["exp_alerts"] = []
    promtool_test(promtool, tmp_path, [with_runbooks(scenario)], rule_file=f, interval="15s")


def dashboard_annotation(name: str, needle: str) -> str:
    d = json.loads((RULES.parent.parent / "dashboards" / name).read_text())
    expr = next(a["expr"] for a in d["annotations"]["list"] if needle in a["expr"])
    return expr.replace("$namespace", "ns").replace("$ddpjob", "j")


def expect(expr: str, at: str, samples: list[dict]) -> dict:
    return {"expr": expr, "eval_time": at, "exp_samples": samples}


@pytest.mark.parametrize("name", ["ddpjob-overview.json", "ddpjob-job.json"])
def test_attempt_annotation_marks_the_group_restart_once(promtool, tmp_path, name):
    """Attempt 0's two ranks until 10m (then their pods go: stale), attempt 1's from 12m: one mark, at
    12m; none before it, none for the first attempt, none once attempt 1 is the steady state."""
    expr = dashboard_annotation(name, "ddpjob_trainer_restart_count")
    old = [series("ddpjob_trainer_restart_count", "0x10 stale", **rank(r), pod=f"j-{r}-a0") for r in (0, 1)]
    new = [series("ddpjob_trainer_restart_count", "_x12 1x10", **rank(r), pod=f"j-{r}-a1") for r in (0, 1)]
    mark = [{"labels": '{ddpjob="j", namespace="ns"}', "value": 1}]
    test = {"interval": "1m", "input_series": old + new, "promql_expr_test": [
        expect(expr, "5m", []), expect(expr, "11m", []), expect(expr, "12m", mark), expect(expr, "15m", [])]}
    promtool_test(promtool, tmp_path, [test])


def test_group_restart_annotation_names_the_reason(promtool, tmp_path):
    """The operator's counter (born at 0) goes to 1 at 6m with reason PodFailed: a mark around 6m only."""
    expr = dashboard_annotation("ddpjob-overview.json", "ddpjob_operator_jobs_restarted_total")
    inputs = [series("ddpjob_operator_jobs_restarted_total", "0x5 1x10", namespace="ns", reason="PodFailed"),
              series("ddpjob_operator_jobs_restarted_total", "0x15", namespace="ns", reason="Stalled")]
    mark = [{"labels": '{namespace="ns", reason="PodFailed"}', "value": 1}]
    test = {"interval": "1m", "input_series": inputs, "promql_expr_test": [
        expect(expr, "4m", []), expect(expr, "6m", mark), expect(expr, "10m", [])]}
    promtool_test(promtool, tmp_path, [test])
