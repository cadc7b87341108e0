"""Progress, straggler and hang detection by the real operator against real trainer endpoints.

The DDPJob's pods are "Running" on kwok's fake nodes; the training itself runs on this machine
(`ddpjob run --local --metrics-port-base P`: node N serves metrics on P + N), and the operator is
pointed at it with DDPJOB_SCRAPE_URL_TEMPLATE=http://127.0.0.1:{rank_port}/metrics
({rank_port} = spec.metricsPort + node rank). Test knob (trainer/ddpjob_trainer/debug.py):
DDPJOB_DEBUG_FREEZE_RANK="<rank>:<step>", DDPJOB_DEBUG_FREEZE_STAGE="<rank>:<stage>"; the straggler is a `command:` job whose rank 1 has a slow
data loader (SLOW_INPUT_RANK, below).
"""
from __future__ import annotations

import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from tests.cluster.conftest import wait_for
from tests.cluster.test_operator import crd, k8s, running, start_operator  # noqa: F401  (fixtures)
from tests.support.localrun import in_stage, local_run, rank_samples, wait_ranks, write_digits_job, write_slow_input_job
from tests.support.status import condition, table_row

URL_TEMPLATE = "http://127.0.0.1:{rank_port}/metrics"
DDPJOB = str(Path(sys.executable).parent / "ddpjob")  # the CLI as a user runs it


@contextmanager
def local_training(tmp_path: Path, *, epochs: int = 40, hang_timeout: int | None = None, **debug_env: str):
    """A real 2-node CPU run of examples/digits.yaml serving metrics on base, base+1 (yields .base, .proc);
    its frozen ranks stay frozen (restartOnHang off: no agent restarts them)."""
    with local_run(write_digits_job(tmp_path, epochs=epochs, restart_on_hang=False, hang_timeout=hang_timeout),
                   tmp_path, DDPJOB_DEBUG_STEP_SLEEP="0.05", **debug_env) as run:
        yield run


def pod_of_rank(run, job: str, rank: int) -> str:
    """The pod whose node holds a global rank: c10d, not the node's index, decides that (each
    local node serves its metrics for the pod of its index, as a pod does)."""
    return f"{job}-{rank_samples(run.ports)[rank].node_rank}"


def wait_job(k8s, name: str, run, pred, desc: str, timeout: float) -> dict:
    """k8s.wait_status that gives up at once (with the training log) when the training died."""
    def check():
        if run.proc.poll() is not None:
            return {"training exited": run.proc.returncode}
        st = k8s.status(name)
        return st if pred(st) else None
    got = wait_for(check, timeout=timeout, desc=f"{name}: {desc} (status {k8s.status(name)})")
    assert "training exited" not in got, f"training ended early: {got}\n{run.log.read_text()[-3000:]}"
    return got


def apply_job(k8s, name: str, base: int, **spec):
    # The pods never run here (kwok); only their names, ranks and phase matter to the monitor.
    return k8s.apply(name, nodes=2, gpusPerNode=0, metricsPort=base, **spec)


def test_progress_and_loss_in_status_and_kubectl_get(start_operator, k8s, crd, tmp_path):
    with local_training(tmp_path) as run:
        start_operator(DDPJOB_SCRAPE_URL_TEMPLATE=URL_TEMPLATE)
        apply_job(k8s, "prog", run.base)
        k8s.wait_status("prog", running(2), "both pods Running", timeout=60)
        # Both ranks in the same pass: one scrape that times out on a loaded machine is not a bug.
        st = wait_job(k8s, "prog", run, lambda s: (s.get("progress") or {}).get("step", 0) >= 20
                      and "loss" in s["progress"] and s["progress"].get("ranksReporting") == 2,
                      "progress from both ranks with a step >= 20 and a loss", timeout=180)
        p = st["progress"]
        assert p["totalSteps"] > p["step"] and 0 < p["percent"] < 100
        assert p["samplesPerSecond"] > 0
        assert p["lastStepTime"].endswith("Z") and p["eta"]
        out = crd.kubectl("get", "ddpj", "prog", "-n", k8s.ns).stdout
        header, row = out.splitlines()[:2]
        cols = table_row(header, row)
        assert "%" in cols["PROGRESS"], out
        assert float(cols["LOSS"]) > 0, out
        # Healthy: both detector conditions present and False.
        assert condition(st, "Stalled")["status"] == "False"
        assert condition(st, "Straggler")["status"] == "False"


def test_slowed_rank_is_reported_as_straggler(start_operator, k8s, crd, tmp_path):
    with local_training(tmp_path, epochs=60, DDPJOB_DEBUG_SLOW_RANK="1:0.25") as run:
        start_operator(DDPJOB_SCRAPE_URL_TEMPLATE=URL_TEMPLATE)
        apply_job(k8s, "slow", run.base, hangTimeoutSeconds=120)
        k8s.wait_status("slow", running(2), "both pods Running", timeout=60)
        st = wait_job(k8s, "slow", run, lambda s: (condition(s, "Straggler") or {}).get("status") == "True",
                      "Straggler condition True", timeout=240)
        msg = condition(st, "Straggler")["message"]
        pod = pod_of_rank(run, "slow", 1)
        node = next(p.spec.node_name for p in k8s.pods("slow") if p.metadata.name == pod)
        assert f"rank 1 (pod {pod} on node {node}" in msg and "rank 0" not in msg, msg


FREEZE_AT = 30
HANG_TIMEOUT = 10


def frozen_after_a_step(samples: dict) -> bool:
    """Rank 1 took its last batch, for step FREEZE_AT, and rank 0 has its batch for the next step:
    rank 1 has done its part of step FREEZE_AT's all-reduce (rank 0 could not have gone on) and
    froze after it; rank 0 waits for it in the next one. Nothing of the job moves again."""
    r0, r1 = samples.get(0), samples.get(1)
    return bool(r0 and r1 and r1.step_started == FREEZE_AT and r0.step_started == FREEZE_AT + 1)


def test_frozen_rank_turns_job_stalled_naming_that_rank(start_operator, k8s, crd, tmp_path):
    """Rank 1 freezes after its step FREEZE_AT, rank 0 waits for it in the next step's collective.
    Stalled names rank 1, by its progress and by the stacks its agent captured (the freeze's
    frame); the operator keeps every rank's capture in the job's ConfigMap, which `ddpjob logs
    --stacks` prints."""
    with local_training(tmp_path, hang_timeout=HANG_TIMEOUT, DDPJOB_DEBUG_FREEZE_RANK=f"1:{FREEZE_AT}") as run:
        # The job and its 10 s hang timeout come once the freeze has happened: a start-up slower
        # than 10 s (a cold machine's rendezvous) would otherwise be the stall this test sees.
        wait_ranks(run, frozen_after_a_step, f"rank 1 frozen at step {FREEZE_AT}, rank 0 in the next step",
                   timeout=420)
        start_operator(DDPJOB_SCRAPE_URL_TEMPLATE=URL_TEMPLATE)
        apply_job(k8s, "frozen", run.base, hangTimeoutSeconds=HANG_TIMEOUT, failurePolicy={"restartOnHang": False})
        k8s.wait_status("frozen", running(2), "both pods Running", timeout=60)
        st = wait_job(k8s, "frozen", run, lambda s: (condition(s, "Stalled") or {}).get("status") == "True",
                      "Stalled condition True", timeout=240)
        msg = condition(st, "Stalled")["message"]
        pod1 = pod_of_rank(run, "frozen", 1)
        assert f"rank 1 (pod {pod1}" in msg and "rank 0" not in msg, msg
        assert f"; stacks: rank 1 (pod {pod1}" in msg and "ddpjob_trainer/debug.py:" in msg and " _freeze < " in msg, msg
        # Every rank's captures, kept in the job's own ConfigMap (the agents took them at half the
        # hang timeout and at the whole; the monitor fetched them from the pods' endpoints).
        def kept():
            cm = k8s.core.read_namespaced_config_map("frozen-stacks", k8s.ns) if "frozen-stacks" in {
                c.metadata.name for c in k8s.core.list_namespaced_config_map(k8s.ns).items} else None
            data = (cm.data or {}) if cm else {}
            return cm if {".rank-0.", ".rank-1."} <= {k[k.index(".rank-"):k.index(".rank-") + 8] for k in data} else None
        cm = wait_for(kept, timeout=60, desc="both ranks' stacks in ConfigMap frozen-stacks")
        (owner,) = cm.metadata.owner_references
        uid = k8s.job("frozen")["metadata"]["uid"]
        assert (owner.kind, owner.name, owner.uid, owner.controller) == ("DDPJob", "frozen", uid, True)
        cli = subprocess.run([DDPJOB, "logs", "frozen", "-n", k8s.ns, "--stacks", "--attempt", "0"], env=crd.env(),
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        out = cli.stdout
        assert f"=== rank 1 (pod {pod1}" in out and "in _freeze" in out, out[-3000:]
        assert re.search(r"=== rank 0 \(pod frozen-\d on node \S+\), attempt 0 restart 0: \w+ capture at .*, waiting in \w",
                         out), out[-3000:]
        evs = wait_for(lambda: [e for e in k8s.events("frozen") if e[1] == "Stalled"], timeout=30,
                       desc="a Stalled event")
        assert evs[0][0] == "Warning" and "rank 1" in evs[0][2]
        assert st["phase"] == "Running"   # restartOnHang is off here: Stalled is only a condition


def test_job_frozen_before_its_first_step_is_stalled_naming_the_stage(start_operator, k8s, crd, tmp_path):
    """Rank 1 freezes on entering first_step (its data and model never come), so rank 0 waits in the
    first step's all-reduce: no step is ever taken. Until hangTimeoutSeconds has passed, Stalled is
    False and claims no advancing steps; then it is True and names the stage."""
    with local_training(tmp_path, DDPJOB_DEBUG_FREEZE_STAGE="1:first_step") as run:
        # Both ranks in first_step before the job (and its timeout) exists: a cold rendezvous
        # longer than 20 s would otherwise be reported, rightly, as stuck in rendezvous.
        wait_ranks(run, in_stage("first_step"), "both ranks in first_step")
        start_operator(DDPJOB_SCRAPE_URL_TEMPLATE=URL_TEMPLATE)
        apply_job(k8s, "early", run.base, hangTimeoutSeconds=20, failurePolicy={"restartOnHang": False})
        k8s.wait_status("early", running(2), "both pods Running", timeout=60)
        seen: list[dict] = []

        def stalled(s: dict) -> bool:
            c = condition(s, "Stalled")
            if c and c not in seen:
                seen.append(c)
            return bool(c) and c["status"] == "True"

        st = wait_job(k8s, "early", run, stalled, "Stalled condition True", timeout=240)
        msg = condition(st, "Stalled")["message"]
        assert condition(st, "Stalled")["reason"] == "StuckInStage", st
        assert msg.startswith("stuck in first_step for ") and "(hangTimeoutSeconds 20)" in msg, msg
        assert f"rank 1 (pod {pod_of_rank(run, 'early', 1)} on node " in msg, msg
        assert "step" not in (st.get("progress") or {}), st
        calm = [c for c in seen if c["status"] == "False"]
        assert all(c["reason"] == "Starting" and "advancing" not in c["message"] for c in calm), seen
        evs = wait_for(lambda: [e for e in k8s.events("early") if e[1] == "Stalled"], timeout=30,
                       desc="a Stalled event")
        assert evs[0][0] == "Warning" and "first_step" in evs[0][2]


@contextmanager
def local_custom_script(tmp_path: Path, **env_extra: str):
    """`ddpjob run --local` of a 2-node command: job running SLOW_INPUT_SCRIPT (yields .base, .proc)."""
    with local_run(write_slow_input_job(tmp_path, name="custom"), tmp_path, **env_extra) as run:
        yield run


def test_rank_with_a_slow_data_loader_is_reported_as_straggler(start_operator, k8s, crd, tmp_path):
    with local_custom_script(tmp_path, SLOW_INPUT_RANK="1") as run:
        start_operator(DDPJOB_SCRAPE_URL_TEMPLATE=URL_TEMPLATE)
        apply_job(k8s, "input", run.base, hangTimeoutSeconds=120)
        k8s.wait_status("input", running(2), "both pods Running", timeout=60)
        st = wait_job(k8s, "input", run, lambda s: (condition(s, "Straggler") or {}).get("status") == "True",
                      "Straggler condition True", timeout=240)
        msg = condition(st, "Straggler")["message"]
        pod = pod_of_rank(run, "input", 1)
        node = next(p.spec.node_name for p in k8s.pods("input") if p.metadata.name == pod)
        assert f"rank 1 (pod {pod} on node {node}" in msg and "rank 0" not in msg, msg
        evs = wait_for(lambda: [e for e in k8s.events("input") if e[1] == "Straggler"], timeout=30,
                       desc="a Straggler event")
        assert evs[0][0] == "Warning" and "rank 1" in evs[0][2]
        assert condition(st, "Stalled")["status"] == "False"
        assert st["progress"]["totalSteps"] == 4000 and st["progress"]["step"] > 0
