"""Per-step fault tolerance (spec.faultTolerance) in `ddpjob run --local`: real torchrun nodes, a real
torchft Lighthouse, a replica group SIGKILLed mid-training and replaced alone, the Lighthouse lost and back."""
from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from tests.support.stopping import kill_run, wait_for_moment

from .helpers import DDPJOB, REPO, run_local, write_job

# torchft's only wheels: where the trainer extra has it, a missing torchft fails here, never skips.
pytestmark = [pytest.mark.skipif(sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64",
                                 reason="torchft 0.2.0 ships wheels for CPython 3.11 on x86_64 only")]
pytestmark.append(pytest.mark.timeout(600))

KILL_AT, HOLD_AT = 3, 8  # node 1 is killed held at step 3; node 0 steps alone to 8 and holds for the replacement
STEP_RE = re.compile(r"ft: step (\d+) participants (\d+) weights (\w+)")
QUORUM_RE = re.compile(r"ft: step (\d+) participants \d+ weights \w+ quorum (\d+)")
JOINED_RE = re.compile(r"ft: joined at step (\d+) from a peer, weights (\w+)")
SAVED_RE = re.compile(r"checkpoint \S+/step-(\d+): training paused")
RESUMED_RE = re.compile(r"resumed from \S+/step-(\d+) at step (\d+)")


def _node_processes(work: Path, rank: int) -> list[psutil.Process]:
    """Every process of node `rank` of the run in `work` (its launcher, torchrun's agent, its workers)."""
    found = []
    for p in psutil.process_iter(["environ"]):
        env = p.info["environ"] or {}
        if env.get("NODE_RANK") == str(rank) and env.get("DDPJOB_RESULT_FILE", "").startswith(f"{work}{os.sep}"):
            found.append(p)
    return found


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _why(out: str, work: Path) -> str:
    """A failed run's story, its most telling lines last (CI's recap shows a failure's last lines):
    the runner's output, the end of every node's log, then the runner's lines that say which node
    failed with which exit code and what was restarted or replaced."""
    tails = [f"--- {log.relative_to(work)} ends:\n" + "\n".join(_read(log).splitlines()[-3:])
             for log in sorted((work / "logs").glob("attempt-*/node-*.log"))]
    said = [line for line in out.splitlines() if "failed with exit code" in line or "restarting" in line]
    return "\n".join([out[-3000:], *tails, "--- the runner said:", *said])


def test_a_sigkilled_replica_group_is_replaced_alone_and_heals_from_its_peer(tmp_path):
    """Node 1 (replica group 1) is SIGKILLed while both groups train. Node 0 goes on stepping with one
    participant; a new node 1 starts alone, joins the quorum and takes node 0's state (its weights
    hash is node 0's at that step); the run Succeeds with both groups' weights equal at the end.
    Knobs (debug.py), not sleeps, place the events: node 1 holds at step KILL_AT to be killed there;
    node 0 holds at HOLD_AT until the replacement's trainer is up, so it joins mid-training.
    Its checkpoints, for what torchft cannot survive: each step's written by one group alone; a
    second run (every group lost, then started again) resumes every group from the newest one, and
    the quorum's steps go on from there."""
    name = f"ft-{uuid.uuid4().hex[:6]}"
    trainer = {"dataset": "digits", "model": "mlp", "epochs": 1, "batchSize": 16, "lr": 0.1, "logEverySteps": 1,
               "checkpoint": {"dir": "ckpt", "everySteps": 10}}  # under the run's workdir
    job = write_job(tmp_path / "ft.yaml", name=name, max_restarts=1, faultTolerance={"mode": "perStep"},
                    trainer=trainer)
    work = tmp_path / "work"
    logs = work / "logs" / "attempt-0"
    node0, node1, replacement = logs / "node-0.log", logs / "node-1.log", logs / "node-1-replacement-1.log"
    release1, release0 = tmp_path / "release-1", tmp_path / "release-0"
    env = {**os.environ, "DDPJOB_DEBUG_HOLD_RANK": f"1:{KILL_AT}:{release1},0:{HOLD_AT}:{release0}"}
    proc = subprocess.Popen([*DDPJOB, "run", str(job), "--local", "--no-progress", "--workdir", str(work),
                             "--summary-json", str(tmp_path / "summary.json")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    alive = lambda: proc.poll() is None  # noqa: E731
    try:
        wait_for_moment(lambda: f"rank 1 holds at step {KILL_AT}" in _read(node1), alive=alive, timeout=300,
                        what=f"node 1 held at step {KILL_AT}", interval=0.1)
        for p in _node_processes(work, 1):
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        release1.touch()  # the replacement (the same knob) must not hold
        wait_for_moment(lambda: f"rank 0 holds at step {HOLD_AT}" in _read(node0), alive=alive, timeout=300,
                        what=f"node 0 held at step {HOLD_AT}", interval=0.1)
        wait_for_moment(lambda: "training mlp on digits" in _read(replacement), alive=alive, timeout=300,
                        what="the replacement's trainer started", interval=0.1)
        release0.touch()
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_run(proc, f"{work}/")
    assert proc.returncode == 0, _why(out, work)
    assert "replacing it alone" in out, _why(out, work)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["phase"], summary["restarts"], summary["nodes_replaced"]) == ("Succeeded", 0, 1), (
        f"{summary}\n{_why(out, work)}")
    assert summary["eval_accuracy"] >= 0.7, summary  # one epoch of digits (an MLP gets ~0.85)
    steps0 = [(int(s), int(n), h) for s, n, h in STEP_RE.findall(_read(node0))]
    alone = [s for s, n, _ in steps0 if n == 1 and s > KILL_AT]
    assert alone, steps0  # node 0 kept stepping with one participant after the loss
    joined = JOINED_RE.findall(_read(replacement))
    assert len(joined) == 1, _read(replacement)[-3000:]
    at, weights = int(joined[0][0]), joined[0][1]
    assert at > KILL_AT and (at, 1, weights) in steps0, (joined, steps0)  # node 0's weights at that step
    both = [(s, h) for s, n, h in steps0 if n == 2 and s > at]
    assert both, steps0  # then two participants again
    steps1 = {int(s): h for s, _, h in STEP_RE.findall(_read(replacement))}
    last = max(s for s in steps1 if s in dict(both))
    assert steps1[last] == dict(both)[last]  # in sync to the end

    # Each step's checkpoint written by one group (two would tear its directory), the last one too.
    saved = [int(x) for log in (node0, node1, replacement) for x in SAVED_RE.findall(_read(log))]
    assert saved and len(saved) == len(set(saved)), saved
    newest = max(saved)
    assert newest == summary["steps"] and (work / "ckpt" / f"step-{newest:08d}" / "MANIFEST.json").exists(), (
        saved, summary)

    # Every group lost, then the job started again (5 steps more, the same workdir and so the
    # same checkpoints): both resume from the newest, neither takes the other's state, and the
    # quorum's steps go on from it.
    again = write_job(tmp_path / "again.yaml", name=name, max_restarts=0, faultTolerance={"mode": "perStep"},
                      trainer={**trainer, "epochs": 2, "maxSteps": newest + 5})
    proc2, summary2 = run_local(again, tmp_path, timeout=300)
    assert proc2.returncode == 0 and summary2.get("phase") == "Succeeded", (proc2.stderr or proc2.stdout)[-3000:]
    for node in (0, 1):
        log = _read(logs / f"node-{node}.log")
        assert RESUMED_RE.findall(log)[:1] == [(f"{newest:08d}", str(newest))], log[-3000:]
        assert not JOINED_RE.findall(log), log[-3000:]
        steps = [int(st) for st, _n, _h in STEP_RE.findall(log)]
        assert steps == list(range(newest + 1, newest + 6)) and summary2["steps"] == newest + 5, (steps, summary2)


def _lighthouse(run: subprocess.Popen) -> psutil.Process:
    (found,) = [p for p in psutil.Process(run.pid).children(recursive=True) if "ddpjob_trainer.lighthouse" in p.cmdline()]
    return found


def test_a_lighthouse_lost_and_back_on_its_address_restarts_nothing(tmp_path):
    """The Lighthouse is SIGKILLed while group 1 asks it for a quorum (group 0 held at a step
    boundary) and the run starts it again at the same address, as the operator recreates its pod
    behind its Service: group 1's request, lost with it, is asked again (FaultTolerance._quorum)
    until the new one serves it, and the run Succeeds with no restart, both groups in sync at the
    end. Before, the lost request hung for quorumTimeoutSeconds and failed every group's step.
    No quorum of the new Lighthouse has the id of one of the old one's, whose ids it starts again
    from 1: torchft reconfigures a group's process group only when the id changes, and a group that
    did not see the loss would keep its old one while its peer built a new one (two models). Without
    the Lighthouse's id folded into the quorum id (faulttolerance.IncarnationClient), both groups'
    steps after the loss are in quorum 1 again, as before it."""
    trainer = {"dataset": "digits", "model": "mlp", "epochs": 1, "batchSize": 16, "lr": 0.1, "logEverySteps": 1}
    # Group 1 asks for its quorum until the new Lighthouse serves it: the new one imports torch
    # (tens of seconds on a loaded machine) and group 1's connection to it backs off meanwhile.
    job = write_job(tmp_path / "lh.yaml", name=f"lh-{uuid.uuid4().hex[:6]}", max_restarts=0,
                    faultTolerance={"mode": "perStep", "quorumTimeoutSeconds": 600}, trainer=trainer)
    work = tmp_path / "work"
    logs = work / "logs" / "attempt-0"
    node0, node1, release0, release1 = logs / "node-0.log", logs / "node-1.log", tmp_path / "release-0", tmp_path / "release-1"
    # Group 1 holds a few steps later, until group 0 asks the new Lighthouse too: stepping alone in
    # between, it could reach the end of the run before group 0 joined it.
    env = {**os.environ, "DDPJOB_DEBUG_HOLD_RANK": f"0:{HOLD_AT}:{release0},1:{HOLD_AT + 4}:{release1}"}
    proc = subprocess.Popen([*DDPJOB, "run", str(job), "--local", "--no-progress", "--workdir", str(work),
                             "--summary-json", str(tmp_path / "summary.json")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    alive = lambda: proc.poll() is None  # noqa: E731
    again = work / "logs" / "lighthouse-1.log"
    try:
        # Group 0 held after step HOLD_AT: group 1, in step with it, asks for the next quorum and
        # waits there (torchft's Lighthouse forms none with half of the groups it hears from).
        wait_for_moment(lambda: f"rank 0 holds at step {HOLD_AT}" in _read(node0), alive=alive, timeout=300,
                        what=f"group 0 held at step {HOLD_AT}", interval=0.1)
        failed = _read(node1).count("ft: quorum failed")
        _lighthouse(proc).send_signal(signal.SIGKILL)
        # The run starts it again at its address, as the operator recreates its pod; group 1's
        # request, lost with the old one, fails (a quorum try waits at most 10 s) and is asked of
        # the new one.
        wait_for_moment(lambda: _read(node1).count("ft: quorum failed") > failed, alive=alive, timeout=120,
                        what="group 1's quorum failed with the Lighthouse gone", interval=0.1)
        wait_for_moment(lambda: "Received quorum request for replica group1" in _read(again), alive=alive,
                        timeout=240, what="group 1 asking the new Lighthouse", interval=0.1)
        # Group 0 goes on only then: released before, it could step alone to the end of the run
        # while group 1 still reconnected (it would take group 0's state at its next quorum, but
        # the run would be over).
        release0.touch()
        wait_for_moment(lambda: "Received quorum request for replica group0" in _read(again), alive=alive,
                        timeout=240, what="group 0 asking the new Lighthouse", interval=0.1)
        release1.touch()
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_run(proc, f"{work}/")
    assert proc.returncode == 0, out[-3000:]
    assert "the Lighthouse exited with code -9: starting it again" in out, out[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["restarts"] == 0 and not summary.get("nodes_replaced"), summary
    steps = [{int(s): h for s, n, h in STEP_RE.findall(_read(log))} for log in (node0, node1)]
    last = max(set(steps[0]) & set(steps[1]))
    assert last == summary["steps"] and steps[0][last] == steps[1][last], (last, summary)  # in sync at the end
    for log in (node0, node1):
        quorums = {int(s): int(q) for s, q in QUORUM_RE.findall(_read(log))}
        before = {q for s, q in quorums.items() if s <= HOLD_AT}
        after = {q for s, q in quorums.items() if s > HOLD_AT}
        assert before and after and not before & after, (log.name, quorums)
