"""The alert rules under promtool (Debian's prometheus package): syntax, and each alert firing
exactly in its scenario (and staying silent in the healthy twin)."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.e2e.test_prometheus import RULES, ensure_prometheus, rules


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
    # Last step at t=100 s, still scraped: stalled after 600 s + `for: 2m`.
    "stalled": {"interval": "1m", "input_series": [
        series("ddpjob_trainer_last_step_timestamp_seconds", "100x30", **rank(0)),
        series("ddpjob_trainer_last_step_timestamp_seconds", "90x30", **rank(1)),
    ], "alert_rule_test": [
        {"eval_time": "12m", "alertname": "DDPJobStalled", "exp_alerts": []},
        {"eval_time": "15m", "alertname": "DDPJobStalled", "exp_alerts": [{
            "exp_labels": {"severity": "critical", "namespace": "ns", "ddpjob": "j"},
            "exp_annotations": {
                "summary": "DDPJob ns/j is stalled",
                "description": "No rank of j finished a training step for 13m 20s. See `kubectl describe ddpj j "
                               "-n ns` (Stalled condition names the ranks)."}}]},
    ]},
    "failed": {"interval": "1m", "input_series": [
        series("ddpjob_operator_jobs_failed_total", "0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1", reason="BadConfig"),
    ], "alert_rule_test": [
        {"eval_time": "2m", "alertname": "DDPJobFailed", "exp_alerts": []},
        {"eval_time": "5m", "alertname": "DDPJobFailed", "exp_alerts": [{
            "exp_labels": {"severity": "warning", "reason": "BadConfig"},
            "exp_annotations": {
                "summary": "DDPJob(s) failed: BadConfig",
                "description": "1 DDPJob(s) failed in the last 10 minutes with reason BadConfig. "
                               "`kubectl get ddpj -A` shows which; `kubectl describe` has the message."}}]},
        {"eval_time": "20m", "alertname": "DDPJobFailed", "exp_alerts": []},   # no new failure in 10 min
    ]},
    # The first failure with a new reason: the labelled counter is born at 1 (increase() sees nothing).
    "first-failure": {"interval": "1m", "input_series": [
        series("ddpjob_operator_jobs_failed_total", "_ _ _ 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1", reason="Unschedulable"),
    ], "alert_rule_test": [
        {"eval_time": "2m", "alertname": "DDPJobFailed", "exp_alerts": []},
        {"eval_time": "5m", "alertname": "DDPJobFailed", "exp_alerts": [{
            "exp_labels": {"severity": "warning", "reason": "Unschedulable"},
            "exp_annotations": {
                "summary": "DDPJob(s) failed: Unschedulable",
                "description": "1 DDPJob(s) failed in the last 10 minutes with reason Unschedulable. "
                               "`kubectl get ddpj -A` shows which; `kubectl describe` has the message."}}]},
        {"eval_time": "20m", "alertname": "DDPJobFailed", "exp_alerts": []},
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
}


def test_promtool_check_rules(promtool):
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_every_alert_has_a_firing_scenario():
    alerts = {r["alert"] for r in rules() if "alert" in r}
    fired = {t["alertname"] for s in SCENARIOS.values() for t in s["alert_rule_test"] if t["exp_alerts"]}
    assert alerts == fired == {"DDPJobStalled", "DDPJobStraggler", "DDPJobFailed", "DDPJobDataLoaderStarving"}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_alert_scenario(promtool, tmp_path, name):
    spec = {"rule_files": [str(RULES)], "evaluation_interval": "15s", "tests": [SCENARIOS[name]]}
    f = tmp_path / f"{name}.test.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
