"""DDPJobStalled before the first step and in eval, under promtool (Debian's prometheus package):
the stage a job is stuck in, timed against the job's own hangTimeoutSeconds."""
from __future__ import annotations

import json

import pytest

from tests.e2e import test_prometheus_rules as rules_tests
from tests.e2e.test_prometheus_rules import promtool, rank, series  # noqa: F401  (fixture)


def in_stage(r: int, stage: str, since: str) -> list[dict]:
    """Rank r in `stage` since a start-time series (the other stages at 0, as the trainer exports)."""
    return [series("ddpjob_trainer_stage", "1x40", **rank(r), stage=stage),
            series("ddpjob_trainer_stage", "0x40", **rank(r), stage="training"),
            series("ddpjob_trainer_stage_start_timestamp_seconds", since, **rank(r))]


def hang_timeout(seconds: int) -> dict:
    return series("ddpjob_operator_job_hang_timeout_seconds", f"{seconds}x40", namespace="ns", ddpjob="j")


def stuck_alert(stage: str, duration: str) -> dict:
    return {"exp_labels": {"severity": "critical", "namespace": "ns", "ddpjob": "j", "stage": stage},
            "exp_annotations": {
                "summary": "DDPJob ns/j is stalled",
                "description": f"DDPJob j has not finished its first step: ranks have been in stage {stage} "
                               f"for {duration}. See `kubectl describe ddpj j -n ns` (Stalled condition "
                               "names the ranks)."}}


SCENARIOS = {
    # Both ranks entered rendezvous at t=60 s and never left; hangTimeoutSeconds=120: stuck from
    # 180 s, firing after `for: 2m`.
    "frozen-in-rendezvous": {"interval": "1m", "input_series": [
        *in_stage(0, "rendezvous", "60x40"), *in_stage(1, "rendezvous", "60x40"), hang_timeout(120),
    ], "alert_rule_test": [
        {"eval_time": "3m", "alertname": "DDPJobStalled", "exp_alerts": []},
        {"eval_time": "6m", "alertname": "DDPJobStalled", "exp_alerts": [stuck_alert("rendezvous", "5m 0s")]},
    ]},
    # Rank 1 never found its master; rank 0 moved on to process-group init at t=240 s (progress):
    # the job is stuck from 360 s, the alert names the stage each group of ranks is in.
    "frozen-across-stages": {"interval": "1m", "input_series": [
        *in_stage(0, "rendezvous", "0x3 240x40"), *in_stage(1, "waiting_for_master", "0x40"), hang_timeout(120),
    ], "alert_rule_test": [
        {"eval_time": "7m", "alertname": "DDPJobStalled", "exp_alerts": []},
        {"eval_time": "9m", "alertname": "DDPJobStalled", "exp_alerts": [
            stuck_alert("rendezvous", "5m 0s"), stuck_alert("waiting_for_master", "9m 0s")]},
    ]},
    # No hangTimeoutSeconds: a start-up of 9 minutes is not a stall (600 s default).
    "slow-start-up": {"interval": "1m", "input_series": [*in_stage(0, "first_step", "0x40")],
                      "alert_rule_test": [{"eval_time": "11m", "alertname": "DDPJobStalled", "exp_alerts": []}]},
    # Last step at t=100 s, then an eval and the next epoch's data loading (training since 400 s),
    # hangTimeoutSeconds=300: 380 s since the last step is no stall, 440 s since the last stage is.
    "after-a-long-eval": {"interval": "1m", "input_series": [
        series("ddpjob_trainer_last_step_timestamp_seconds", "100x40", **rank(0)),
        *in_stage(0, "training", "400x40"), hang_timeout(300),
    ], "alert_rule_test": [
        {"eval_time": "8m", "alertname": "DDPJobStalled", "exp_alerts": []},
        {"eval_time": "14m", "alertname": "DDPJobStalled", "exp_alerts": [{
            "exp_labels": {"severity": "critical", "namespace": "ns", "ddpjob": "j"},
            "exp_annotations": {
                "summary": "DDPJob ns/j is stalled",
                "description": "No rank of j finished a training step for 7m 20s. See `kubectl describe ddpj j "
                               "-n ns` (Stalled condition names the ranks)."}}]},
    ]},
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_stalled_by_stage(promtool, tmp_path, name, monkeypatch):  # noqa: F811  (the fixture)
    # test_prometheus_rules' runner (group order and all), for a scenario of this file.
    monkeypatch.setitem(rules_tests.SCENARIOS, name, SCENARIOS[name])
    rules_tests.test_alert_scenario(promtool, tmp_path, name)


@pytest.mark.parametrize("eval_time,state", [("2m", 4), ("5m", 1)])
def test_training_state_panel_before_the_first_step(promtool, tmp_path, eval_time, state):  # noqa: F811
    """In rendezvous since t=100 s, hangTimeoutSeconds=120: Starting (4), then Stalled (1)."""
    d = json.loads((rules_tests.RULES.parent.parent / "dashboards" / "ddpjob-job.json").read_text())
    expr = next(p["targets"][0]["expr"] for p in d["panels"] if p["title"] == "Training state")
    q = expr.replace("$namespace", "ns").replace("$ddpjob", "j")
    test = {"interval": "1m", "input_series": [*in_stage(0, "rendezvous", "100x10"), hang_timeout(120)],
            "promql_expr_test": [{"expr": q, "eval_time": eval_time,
                                  "exp_samples": [{"labels": '{ddpjob="j", namespace="ns"}', "value": state}]}]}
    rules_tests.promtool_test(promtool, tmp_path, [test])
