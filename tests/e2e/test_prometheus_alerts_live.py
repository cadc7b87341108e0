"""The alert expressions on real series: a local 2-node `command:` job whose rank 1 has a slow data
loader, scraped by a real Prometheus. DDPJobStraggler and DDPJobDataLoaderStarving select rank 1
(and only rank 1); the stalled one selects nothing while steps advance."""
from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from tests.e2e.test_prometheus import (DDPJOB, RULES, Prometheus, ensure_prometheus, free_ports, rules,
                                       stop_local_run)
from tests.support.cluster import wait_for

SLOW_INPUT_SCRIPT = '''
import os, time
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from ddpjob_trainer import telemetry

dist.init_process_group("gloo")
rank, slow = dist.get_rank(), int(os.environ.get("SLOW_INPUT_RANK", "-1"))
steps = 4000

def batches():
    for _ in range(steps):
        if rank == slow:
            time.sleep(0.2)                     # this rank's data loader is slow
        yield torch.randn(32, 64), torch.randint(0, 10, (32,))

model = DDP(nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
tm = telemetry.Telemetry.from_env()
tm.set_total_steps(steps)
for x, y in tm.track(batches()):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    tm.record_loss(loss)
    time.sleep(0.02)
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def slow_input_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("slowinput")
    (work / "slow_input.py").write_text(SLOW_INPUT_SCRIPT)
    spec = work / "custom.yaml"
    spec.write_text(yaml.safe_dump({
        "apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "slowinput"},
        "spec": {"nodes": 2, "nprocPerNode": 1, "gpusPerNode": 0, "image": "reg/trainer:1",
                 "command": ["torchrun", "slow_input.py"], "failurePolicy": {"maxRestarts": 0}}}))
    base = free_ports(2, consecutive=True)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPJOB_")}
    env["SLOW_INPUT_RANK"] = "1"
    log = open(work / "run.log", "w")
    proc = subprocess.Popen([str(DDPJOB), "run", str(spec), "--local", "--metrics-port-base", str(base),
                             "--no-progress", "--workdir", str(work / "wd")],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield {"ports": [base, base + 1], "proc": proc, "log": work / "run.log"}
    finally:
        stop_local_run(proc, work / "wd")
        log.close()


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
