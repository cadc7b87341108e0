"""The alert expressions on real series: a local 2-node `command:` job whose rank 1 has a slow data
loader, scraped by a real Prometheus. DDPJobStraggler and DDPJobDataLoaderStarving select rank 1
(and only rank 1); the stalled one selects nothing while steps advance."""
from __future__ import annotations

import pytest

from tests.e2e.test_prometheus import RULES, Prometheus, ensure_prometheus, rules
from tests.support.localrun import local_run, write_slow_input_job
from tests.support.cluster import wait_for

@pytest.fixture(scope="module")
def slow_input_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("slowinput")
    with local_run(write_slow_input_job(work, name="slowinput"), work, SLOW_INPUT_RANK="1") as run:
        yield {"ports": run.ports, "proc": run.proc, "log": run.log}


@pytest.fixture(scope="module")
def prom(slow_input_run, tmp_path_factory):
    p = Prometheus(ensure_prometheus()[0], tmp_path_factory.mktemp("prom"), rule_files=[RULES],
                   targets={"ddpjob-trainers": [f"127.0.0.1:{port}" for port in slow_input_run["ports"]]})
    try:
        def ready():
            if slow_input_run["proc"].poll() is not None:
                raise AssertionError(f"training ended: {slow_input_run['log'].read_text()[-3000:]}")
            return len(p.series('ddpjob:own_step_seconds:2m{ddpjob="slowinput"}')) == 2 and \
                p.series('ddpjob_trainer_step{ddpjob="slowinput"} >= 40')
        wait_for(ready, timeout=240, interval=1, desc="both ranks stepping and the recording rules evaluated")
        yield p
    finally:
        p.stop()


def expr(alert: str) -> str:
    return next(r["expr"] for r in rules() if r.get("alert") == alert)


@pytest.mark.parametrize("alert", ["DDPJobStraggler", "DDPJobDataLoaderStarving"])
def test_alert_selects_the_slow_rank(prom, alert):
    got = wait_for(lambda: prom.series(expr(alert)), timeout=60, interval=1, desc=f"{alert} returning data")
    assert {(s["metric"]["ddpjob"], s["metric"]["rank"]) for s in got} == {("slowinput", "1")}, got


def test_stalled_selects_nothing_while_steps_advance(prom):
    assert prom.series(expr("DDPJobStalled")) == []
    assert prom.series('ddpjob:seconds_since_last_step{ddpjob="slowinput"} < 60')
