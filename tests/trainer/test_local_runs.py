"""`ddpjob run --local` with real torchrun agents and gloo workers on CPU."""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.support.localrun import free_ports, pids_with_env
from tests.support.stopping import (
    MOMENTS,
    STOP_BOUND_SECONDS,
    cpu_load,
    describe,
    cmdline,
    kill_run,
    is_worker,
    moment_reached,
    run_processes,
    wait_for_moment,
    wait_gone,
)

from ddpjob_api import contract
from ddpjob_api.contract import STALL_ERROR_RE

from ddpjob_operator.decisions import stacks as blame

from .helpers import DDPJOB, REPO, run_local, single_process_eval, write_job

pytestmark = pytest.mark.timeout(600)


def test_digits_example_converges_across_two_nodes(tmp_path):
    proc, s = run_local(REPO / "examples" / "digits.yaml", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["phase"] == "Succeeded"
    assert (s["world_size"], s["nodes"], s["nproc_per_node"]) == (2, 2, 1)
    assert s["eval_samples"] == s["eval_dataset_size"] == 359
    assert s["eval_accuracy"] >= 0.95
    assert s["restarts"] == 0 and s["resumed_from_step"] == 0
    assert s["train_samples_per_second"] > 0
    # Undisturbed: every second of it in queued, starting, training, checkpointing or evaluating.
    g = s["goodput"]
    assert s["in_place_restarts"] == 0 and s["restart_history"] == []
    assert g["seconds"]["recovering"] == g["seconds"]["recomputing"] == g["seconds"]["stalled"] == 0, g
    assert sum(g["seconds"].values()) == pytest.approx(g["wallSeconds"], rel=0.02)
    assert g["wallSeconds"] == pytest.approx(s["wall_seconds"], rel=0.02)  # the runner's own clock
    assert g["seconds"]["training"] > 0 and g["seconds"]["starting"] > 0 and g["seconds"]["evaluating"] > 0
    assert f"goodput {g['display']} training of" in proc.stderr.splitlines()[-1]


def test_eval_is_exact_when_world_size_does_not_divide_the_validation_set(tmp_path):
    trainer = {"dataset": "digits", "model": "convnet", "epochs": 1, "batchSize": 16, "lr": 0.05,
               "checkpoint": {"dir": "ckpt", "keep": 1}}
    job = write_job(tmp_path / "three.yaml", name="three", nodes=3, trainer=trainer)
    proc, s = run_local(job, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["world_size"] == 3 and 359 % 3 != 0
    # DistributedSampler would pad to 360 and count a sample twice; every sample counts once.
    assert s["eval_samples"] == s["eval_dataset_size"] == 359
    acc, loss, n = single_process_eval(Path(s["last_checkpoint"]), trainer)
    assert n == 359
    assert s["eval_accuracy"] == pytest.approx(acc, abs=1e-12)
    assert s["eval_loss"] == pytest.approx(loss, rel=1e-6)


def _find_worker(job_name: str, rank: int) -> int | None:
    """PID of the torchrun worker process with RANK=rank of this job (not its agent or launcher)."""
    for pid in set(pids_with_env(f"DDPJOB_NAME={job_name}")) & set(pids_with_env(f"RANK={rank}")):
        if is_worker(cmdline(pid)):
            return pid
    return None


def _scrape(port: int) -> dict:
    from ddpjob_operator.decisions.samples import parse_metrics
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return parse_metrics(resp.read().decode())
    except OSError:
        return {}


HANG_TIMEOUT = 60  # a stage of a loaded CI machine (a rank in process-group set-up waiting for its
# peer still importing torch) stays far below it: a slow start is not this test's stall
FREEZE_AT = 3
STEPS = 24
CHECKPOINT_EVERY = 4


def _failures(ports: list[int]) -> list[tuple[int, dict]]:
    """(rank, failure) of every worker failure the nodes' agents export."""
    return [(r, f) for port in ports for r, s in _scrape(port).items() for f in s.worker_failures]


def test_frozen_then_sigkilled_rank_1_restarts_the_workers_in_place_and_resumes_from_checkpoint(tmp_path):
    """No group restart, twice. First rank 1 freezes (alive, never stepping again: the default
    failurePolicy.restartOnHang): its node's agent kills its worker once it made no progress for
    hangTimeoutSeconds, and the failure names the stall; every rank's stack was captured before
    (rank 0's at half the timeout: it dies with rank 1's kill), the freeze's frame in rank 1's, the
    collective in rank 0's, and the runner prints them. Then its new worker is SIGKILLed. Each
    time torchrun's agents restart every node's workers where they are (c10d rendezvous), the
    node's metrics name the failure and each rank's first step after it, the node logs mark each
    start, and the run still takes exactly its steps. A step lasts DDPJOB_DEBUG_STEP_SLEEP or more,
    so the frozen rank's last progress is a step older than rank 0's (which waits in the next
    all-reduce): its agent kills it first, the earliest failure, the one the operator names.

    The runner reports both as the operator would (restartHistory, its events' words) and its
    goodput ledger accounts for them: no checkpoint precedes the stall (every CHECKPOINT_EVERY
    steps, no snapshots), so its restart does its steps again, and the SIGKILL comes two steps past
    a checkpoint."""
    job = write_job(tmp_path / "killme.yaml", name="killme", max_restarts=3, hangTimeoutSeconds=HANG_TIMEOUT,
                    trainer={"dataset": "digits", "model": "convnet", "epochs": 2, "maxSteps": STEPS, "batchSize": 32,
                             "lr": 0.05, "checkpoint": {"dir": "ckpt", "everySteps": CHECKPOINT_EVERY, "keep": 2,
                                                        "snapshotEverySteps": 0}})
    summary = tmp_path / "summary.json"
    work = tmp_path / "work"
    ports = free_ports(2, consecutive=True)
    proc = subprocess.Popen(
        [*DDPJOB, "run", str(job), "--local", "--no-progress", "--summary-json", str(summary),
         "--workdir", str(work), "--metrics-port-base", str(ports[0])],
        env={**os.environ, "DDPJOB_DEBUG_STEP_SLEEP": "0.5", "DDPJOB_DEBUG_FREEZE_RANK": f"1:{FREEZE_AT}"},
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 420
        stall = None
        while time.monotonic() < deadline and stall is None:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            failures = _failures(ports)
            # Rank 1's record (its peer, stuck in the next collective, may be killed for a stall
            # too, later: the operator names the earliest, and so does the assert below).
            stall = next(((r, f) for r, f in failures if r == 1 and f["error"].startswith("stalled:")), None)
            time.sleep(0.2)
        assert stall, "rank 1's agent never restarted it for its stall"
        rank, failure = stall
        assert rank == 1 and failure["restarted"] == "true" and failure["signal"] == "SIGKILL", failures
        assert STALL_ERROR_RE.match(failure["error"]), failure  # what the operator shows as reason Stalled
        assert failure["error"].endswith(f"s in training after step {FREEZE_AT - 1} (hang timeout {HANG_TIMEOUT}s)")
        # Rank 0, waiting in the next collective, failed with it, if at all: by an exception (its
        # peer gone), which its own agent may see before rank 1's agent sees the kill, or killed for
        # a stall of its own later. Either way the operator names rank 1 (decisions/inplace: a
        # worker a signal ended, else the earliest).
        assert all(f["signal"] == "" or f["time"] > failure["time"] for r, f in failures if r == 0), failures
        # And so do the stacks both agents captured before the kill, each rank's newest: rank 1 in
        # the freeze, rank 0 in the collective it waits for it in.
        samples = {**_scrape(ports[0]), **_scrape(ports[1])}
        culprit = blame.of_restart(samples, restart=0, failed_at=failure["time"], window=HANG_TIMEOUT)
        assert culprit is not None and culprit.ranks == (1,), {r: s.stack_captures for r, s in samples.items()}
        assert culprit.frames.startswith("ddpjob_trainer/debug.py:"), culprit
        assert "_freeze < ddpjob_trainer/debug.py:" in culprit.frames, culprit
        print(f"stacks: rank 1 at {culprit.frames}; rank 0 waits in {culprit.waiting_in}")
        # The whole dumps, served by each node's endpoint (what the operator keeps in a ConfigMap).
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}{contract.STACKS_PATH}", timeout=5) as resp:
            rank0 = [r for r in json.loads(resp.read()) if r["rank"] == 0]
        assert rank0 and rank0[-1]["waiting"] and "thread 0x" in rank0[-1]["text"], rank0
        killed = None
        while time.monotonic() < deadline and killed is None:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            # Two steps past a checkpoint of step 8 or later, long after the restart for the stall
            # (a loaded machine's poll may miss that window: the next checkpoint's comes).
            saved = [int(p.name[5:]) for p in (work / "ckpt").glob("step-*") if p.name[5:].isdigit()]
            rank1 = _scrape(ports[1]).get(1)
            if saved and max(saved) >= 8 and rank1 is not None and (rank1.step or 0) >= max(saved) + 2:
                pid = _find_worker("killme", 1)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    killed = pid
            time.sleep(0.2)
        assert killed, "never saw a rank-1 worker two steps past a checkpoint of step 8 or later to kill"
        # Rank 1's node's agent reports the failure; then every rank's new worker steps.
        sigkill, firsts = None, {}
        while time.monotonic() < deadline and (sigkill is None or len(firsts) < 2):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            sigkill = sigkill or next((f for r, f in _failures(ports) if r == 1 and f["signal"] == "SIGKILL"
                                       and not f["error"].startswith("stalled:")), None)
            if sigkill is not None:
                samples = {**_scrape(ports[0]), **_scrape(ports[1])}
                firsts = {r: s.first_step_timestamp for r, s in samples.items()
                          if s.first_step_timestamp and s.first_step_timestamp > sigkill["time"]}
            time.sleep(0.2)
        assert sigkill and sigkill["restarted"] == "true" and sigkill["exit_code"] == "-9", sigkill
        assert sigkill["error"] == "killed by SIGKILL", sigkill
        assert len(firsts) == 2, f"not every rank stepped after the restart: {firsts}"
        print(f"in place: SIGKILL to every rank's next step in {max(firsts.values()) - sigkill['time']:.2f}s")
        samples = {**_scrape(ports[0]), **_scrape(ports[1])}  # every worker the ranks had, in each node
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    s = json.loads(summary.read_text())
    assert proc.returncode == 0, out[-3000:]
    # The runner printed every rank's stack at the stall: the freeze's frame and the collective.
    assert "stacks, each rank's newest:" in out and "in _freeze" in out, out[-4000:]
    assert re.search(r"=== rank 0 \(node \d\), attempt 0 restart 0: \w+ capture at .*, waiting in \w", out), out[-4000:]
    assert s["phase"] == "Succeeded"
    assert s["restarts"] == 0 and "restarting the whole group" not in out  # no group restart
    assert s["resumed_from_step"] >= 8
    assert s["steps"] == STEPS  # nothing lost, nothing repeated
    logs = [(work / "logs" / "attempt-0" / f"node-{node}.log").read_text() for node in (0, 1)]
    assert any("[ddpjob-agent] rank 1 stalled: no progress" in log for log in logs), logs[1][-2000:]
    for log in logs:
        for restart in (0, 1, 2):
            assert f"==> ddpjob: attempt 0 restart {restart} <==" in log, log[-2000:]

    # Both restarts in place counted and recorded as the operator does, and said as its events say them.
    assert s["in_place_restarts"] == 2, s
    stalled, sigkilled = s["restart_history"]
    assert all((e["kind"], e["attempt"], e["rank"], e["pod"]) == ("InPlace", 0, 1, "killme-1")
               for e in (stalled, sigkilled)), s["restart_history"]
    assert stalled["reason"] == "Stalled" and STALL_ERROR_RE.match(stalled["message"]), stalled
    assert (sigkilled["exitCode"], sigkilled["signal"]) == (-9, "SIGKILL") and "reason" not in sigkilled, sigkilled
    # No checkpoint before the stall: its restart began again at 0; the SIGKILL's at a checkpoint.
    # (the newest step any failed rank had finished: rank 0 may have finished the step rank 1 froze in)
    assert stalled["resumedFromStep"] == 0 and stalled["stepsLost"] == stalled["stepAtFailure"] >= FREEZE_AT - 1, stalled
    assert sigkilled["stepsLost"] == sigkilled["stepAtFailure"] - sigkilled["resumedFromStep"] >= 0, sigkilled
    assert sigkilled["resumedFromStep"] == s["resumed_from_step"]  # what the final workers' result says
    # Each said when first seen (its cause, unless a peer's failure was seen a scrape earlier) ...
    for used in (1, 2):
        assert f"; restarting in place ({used}/3 of failurePolicy.maxRestarts used)" in out, out[-3000:]
    # ... and when every rank stepped again, naming the cause.
    for e in (stalled, sigkilled):
        assert (f"stepping again from step {e['resumedFromStep']} {e['recoverySeconds']:g}s after the worker of "
                f"rank 1 (pod killme-1) failed ({e['stepsLost']} step(s) lost)") in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "restarts 0 (group), 2 in place" in last and f"goodput {s['goodput']['display']} training of" in last

    # Where the time went: every second once, the restarts' time theirs.
    g, history = s["goodput"], s["restart_history"]
    assert sum(g["seconds"].values()) == pytest.approx(g["wallSeconds"], rel=0.02)
    assert g["wallSeconds"] == pytest.approx(s["wall_seconds"], rel=0.02)
    assert g["seconds"]["recovering"] == pytest.approx(sum(e["recoverySeconds"] for e in history), abs=1.0)
    step_time = statistics.median(x.step_seconds_sum / x.step_seconds_count for x in samples.values())
    assert g["seconds"]["recomputing"] == pytest.approx(sum(e.get("stepsLost", 0) for e in history) * step_time, rel=0.1)
    assert g["seconds"]["stalled"] == pytest.approx(float(STALL_ERROR_RE.match(stalled["message"]).group(1)))
    assert g["seconds"]["training"] > 0 and g["ratio"] == pytest.approx(g["seconds"]["training"] / g["wallSeconds"],
                                                                          abs=1e-3)
    # ... and as the ranks saw it (their own counters): the restarted ones recovered, rank 1 stalled
    # and then did the steps before the stall again.
    assert samples[1].goodput["stalled"] >= HANG_TIMEOUT and samples[1].goodput["recovering"] > 0
    assert samples[1].goodput["recomputing"] > 0 and samples[1].goodput["starting"] > 0


def test_missing_dataset_is_a_bad_configuration_and_is_not_retried(tmp_path):
    missing = tmp_path / "no-such-images"
    job = write_job(tmp_path / "nodata.yaml", name="nodata", max_restarts=3, trainer={
        "dataset": "imagefolder", "dataPath": str(missing), "model": "convnet", "epochs": 1})
    proc, s = run_local(job, tmp_path, timeout=240)
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert s["phase"] == "Failed" and s["restarts"] == 0 and s["exit_code"] == 78
    # Said on the failure's own line, from what the rank recorded (not from the log's tail, which
    # torchrun's traceback and in-place restarts can push it out of).
    assert f"(attempt 0): bad configuration: spec.trainer.dataPath: {missing} " in proc.stderr, proc.stderr[-3000:]
    assert "not retrying" in proc.stderr
    # Nor restarted in place: each node's agent ends its round at the first exit 78.
    logs = {p.name: p.read_text() for p in (tmp_path / "work" / "logs" / "attempt-0").glob("node-*.log")}
    assert logs and all("attempt 0 restart 0 <==" in log and "restart 1 <==" not in log for log in logs.values()), logs


@pytest.mark.parametrize("trainer, needle", [
    ({"dataset": "digits", "epochz": 3}, "spec.trainer.epochz: unknown"),
    ({"dataset": "mnist"}, "spec.trainer.dataset"),
    ({"batchSize": "big"}, "spec.trainer.batchSize"),
    ({"checkpoint": {"dir": "c", "every": 5}}, "spec.trainer.checkpoint.every: unknown"),
])
def test_bad_trainer_config_is_refused_before_anything_starts(tmp_path, trainer, needle):
    job = write_job(tmp_path / "bad.yaml", name="bad", trainer=trainer)
    proc, _ = run_local(job, tmp_path, timeout=120)
    assert proc.returncode == 2
    assert needle in proc.stderr


def test_launcher_exits_78_on_bad_config_without_starting_torchrun(tmp_path):
    env = {**os.environ, "DDPJOB_TRAINER_CONFIG": '{"model": "transformer"}', "NODE_RANK": "0"}
    proc = subprocess.run([os.sys.executable, "-m", "ddpjob_trainer.launch"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78
    assert "spec.trainer.model" in proc.stderr


def test_custom_script_example_runs_unchanged(tmp_path):
    proc, s = run_local(REPO / "examples" / "custom-script.yaml", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["phase"] == "Succeeded" and s["world_size"] == 2
    # Rank 0 prints it, on whichever node c10d gave rank 0.
    logs = [(tmp_path / "work" / "logs" / "attempt-0" / f"node-{n}.log").read_text() for n in (0, 1)]
    assert any("training finished" in log for log in logs), logs


def _job_processes(job_name: str) -> list[int]:
    return pids_with_env(f"DDPJOB_NAME={job_name}")


def test_failing_rank_error_is_printed_and_the_job_fails(tmp_path):
    # Node 1 leaves a snapshot in this job's /dev/shm, as a trainer's would be when it fails.
    script = ("import os, sys, time\n"
              "from ddpjob_api.contract import snapshot_root\n"
              "if os.environ['NODE_RANK'] == '1':\n"
              "    d = snapshot_root(); d.mkdir(exist_ok=True); (d / 'rank-1-step-00000001.pt').write_bytes(b'x')\n"
              "    sys.exit(f'boom on node 1; snapshots in {d}')\n"
              "time.sleep(60)\n")
    # launcher: false runs the command verbatim (no wait for a master this script never opens).
    job = write_job(tmp_path / "boom.yaml", name="boom", trainer={}, max_restarts=1,
                    command=["python", "-c", script], launcher=False)
    proc, s = run_local(job, tmp_path, timeout=120)
    assert proc.returncode == 1
    assert s["phase"] == "Failed" and s["restarts"] == 1 and s["failed_rank"] == 1
    assert "boom on node 1" in proc.stderr and "restart budget exhausted" in proc.stderr
    left = _job_processes("boom")
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]  # node 0 was stopped
    # Each attempt's "pods" take their /dev/shm with them: nothing left in memory, nor for the
    # second attempt (a group restart resumes from disk, as new pods do).
    shm = re.findall(r"snapshots in (\S+)", proc.stderr)
    assert len(shm) == 2 and not Path(shm[0]).exists(), shm


STOP_CASES = [(signal.SIGTERM, m) for m in MOMENTS] + [(signal.SIGINT, "import"), (signal.SIGINT, "step")]


@pytest.mark.parametrize("sig, moment", STOP_CASES, ids=[f"{s.name}-{m}" for s, m in STOP_CASES])
def test_ctrl_c_or_sigterm_stops_every_process_within_seconds_on_a_loaded_machine(tmp_path, sig, moment):
    """Whatever the nodes are doing when the signal comes, and however busy the machine, the
    runner exits 128 + signal and every process it started is gone within the bound."""
    name = f"stop-{uuid.uuid4().hex[:6]}"  # other runs on this machine must not be mistaken for ours
    job = write_job(tmp_path / "stop.yaml", name=name, trainer={
        "dataset": "digits", "model": "mlp", "epochs": 50, "batchSize": 8,
        "checkpoint": {"dir": "ckpt", "everySteps": 1, "keep": 2}})
    work = tmp_path / "w"
    ports = free_ports(2, consecutive=True)
    with cpu_load():
        proc = subprocess.Popen([*DDPJOB, "run", str(job), "--local", "--no-progress", "--workdir", str(work),
                                 "--metrics-port-base", str(ports[0])],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        marker = f"{work}/"
        try:
            wait_for_moment(moment_reached(moment, marker=marker, ports=ports, ckpt_dir=work / "ckpt"),
                            alive=lambda: proc.poll() is None, timeout=300, what=f"moment {moment!r}")
            proc.send_signal(sig)
            sent = time.monotonic()
            try:
                out, _ = proc.communicate(timeout=STOP_BOUND_SECONDS)
            except subprocess.TimeoutExpired:
                left = describe(run_processes(marker))
                raise AssertionError(f"ddpjob run did not exit within {STOP_BOUND_SECONDS:.0f}s of "
                                     f"{sig.name} at moment {moment!r}; its processes: {left}") from None
            left = wait_gone(marker, until=sent + STOP_BOUND_SECONDS)
        finally:
            kill_run(proc, marker)
    assert proc.returncode == 128 + sig, out[-3000:]
    assert not left, f"still running {STOP_BOUND_SECONDS:.0f}s after {sig.name}: {describe(left)}"
    assert f"stopped by {sig.name}" in out and f"{name}: Interrupted" in out, out[-3000:]


def test_nodes_die_with_a_sigkilled_runner(tmp_path):
    job = write_job(tmp_path / "orphan.yaml", name="orphan", trainer={}, launcher=False,
                    command=["python", "-c", "import time; time.sleep(120)"])
    proc = subprocess.Popen([*DDPJOB, "run", str(job), "--local", "--no-progress"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(_job_processes("orphan")) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_job_processes("orphan")) >= 2
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 15
    while _job_processes("orphan") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _job_processes("orphan")


# A user's own torchrun script (not the built-in trainer) whose rank 1 deadlocks in Python at its
# step 3 in its first start: a lock it already holds. It reports its steps with Telemetry.track,
# so its agent judges it as the built-in trainer's; the exit guard's sitecustomize registered its
# stack dump. Telemetry begins after the process group and DDP are up (the ranks meet there), so a
# short hang timeout cannot take a slow start-up for a stall.
DEADLOCK_SCRIPT = """
import os, threading, time
import torch, torch.distributed as dist
from ddpjob_trainer.telemetry import Telemetry

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
lock = threading.Lock()

def take_the_lock_again():
    with lock:
        with lock:  # not reentrant: this rank waits for itself forever
            pass

def batches():
    for step in range(12):
        if rank == 1 and step == 3 and os.environ.get("DDPJOB_RESTART") == "0":
            take_the_lock_again()
        yield torch.randn(8, 4)

tm = Telemetry.from_env()
tm.set_total_steps(12)
for x in tm.track(batches()):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    time.sleep(0.2)
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
"""
USER_HANG_TIMEOUT = 20


def test_a_users_torchrun_script_that_deadlocks_on_rank_1_is_named_by_its_stacks(tmp_path):
    """The same as the built-in trainer's: rank 1's agent kills its worker for the stall, in place,
    after every rank's stack was captured: rank 1's in the function that took the lock twice,
    rank 0's in the collective it waits in; the runner prints them and the job succeeds."""
    (tmp_path / "deadlock.py").write_text(DEADLOCK_SCRIPT)
    job = write_job(tmp_path / "deadlock.yaml", name="deadlock", trainer={}, max_restarts=2,
                    hangTimeoutSeconds=USER_HANG_TIMEOUT, command=["torchrun", str(tmp_path / "deadlock.py")])
    ports = free_ports(2, consecutive=True)
    proc, s = run_local(job, tmp_path, timeout=420, extra=["--metrics-port-base", str(ports[0])])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and s["phase"] == "Succeeded", out[-4000:]
    logs = [(tmp_path / "work" / "logs" / "attempt-0" / f"node-{n}.log").read_text() for n in (0, 1)]
    assert "[ddpjob-agent] stacks captured (stall" in logs[1] and "take_the_lock_again" in logs[1], logs[1][-3000:]
    assert "==> ddpjob: attempt 0 restart 1 <==" in logs[0], logs[0][-3000:]   # restarted in place
    # Rank 0 in the collective it waits in: its agent's capture at half the hang timeout, while rank 1
    # still holds it there. Its newest capture may be later: once rank 1's worker is killed, rank 0's
    # allreduce fails and its agent can catch it exiting (rehearsal 18, on a loaded machine).
    assert re.search(r"stacks captured \(idle, [^)]*\): rank 0 waiting in \w", logs[0]), logs[0][-3000:]
    # What the runner printed at the stall: rank 1's frame, and a capture of rank 0.
    assert "stacks, each rank's newest:" in out and "in take_the_lock_again" in out, out[-4000:]
    assert re.search(r"=== rank 0 \(node \d\), attempt 0 restart 0: \w+ capture at ", out), out[-4000:]


def test_a_crash_names_the_rank_that_raised_though_its_peers_failure_may_be_seen_first(tmp_path):
    """Rank 1 raises at step 2; rank 0 fails in the collective it waits in once rank 1 is gone.
    Their agents may see rank 0's exit first (rank 1's teardown is bounded, not instant), but each
    failure is dated by its record, written as the exception is raised: rank 1's comes first, and
    the operator's rule (the earliest failure) names it."""
    import datetime as dt

    from ddpjob_operator.decisions import inplace

    job = write_job(tmp_path / "crash.yaml", name="crash", max_restarts=1,
                    trainer={"dataset": "digits", "model": "convnet", "epochs": 1, "maxSteps": 8, "batchSize": 32,
                             "lr": 0.05})
    ports = free_ports(2, consecutive=True)
    proc = subprocess.Popen(
        [*DDPJOB, "run", str(job), "--local", "--no-progress", "--workdir", str(tmp_path / "work"),
         "--metrics-port-base", str(ports[0])],
        env={**os.environ, "DDPJOB_DEBUG_RAISE_RANK": "1:2", "DDPJOB_DEBUG_STEP_SLEEP": "0.5"},
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        samples: dict = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            samples = {**_scrape(ports[0]), **_scrape(ports[1])}
            failed = {r for r, s in samples.items() for f in s.worker_failures}
            # Rank 1's failure, and rank 0's or its next start's first step (it did not fail).
            if 1 in failed and (0 in failed or (samples.get(0) and samples[0].first_step_timestamp and any(
                    samples[0].first_step_timestamp > f["time"] for f in samples[1].worker_failures))):
                break
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    (raised,) = samples[1].worker_failures
    assert raised["restarted"] == "true" and raised["exit_code"] == "1" and raised["signal"] == "", raised
    assert all(f["time"] > raised["time"] for f in samples[0].worker_failures), samples[0].worker_failures
    (entry,) = inplace.update({}, attempt=0, ranks=samples, with_log=True, group=None,
                              now=dt.datetime.now(dt.timezone.utc)).history
    assert entry["rank"] == 1 and "debug: rank 1 raises at step 2" in entry["message"], entry
    print(f"crash: rank 1 named; peers failed after it: {[f['time'] - raised['time'] for f in samples[0].worker_failures]}")
