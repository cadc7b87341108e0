"""The in-pod launcher stops on SIGTERM (what a pod deletion sends), whatever its torchrun agent
and workers are doing, on a loaded machine: inside a pod's default terminationGracePeriodSeconds
(30 s), the grace its ranks may spend on a last checkpoint included, so the kubelet never has to
SIGKILL the pod at its end.

Where the machine allows it (root, `unshare`), the launcher runs as PID 1 of its own PID
namespace, as in a container: PID 1 ignores every signal it has no handler for.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.localrun import free_ports
from tests.support.stopping import (
    MOMENTS,
    POD_STOP_BOUND_SECONDS,
    STOP_BOUND_SECONDS,
    agents,
    cpu_load,
    describe,
    first_child,
    kill_run,
    moment_reached,
    pid1_prefix,
    run_processes,
    wait_for_moment,
    wait_gone,
)

pytestmark = pytest.mark.timeout(600)


def start_pod_launcher(tmp_path, *, metrics_port: int, as_pid1: bool = True, every_steps: int = 1,
                       env_extra: dict[str, str] | None = None):
    """One node of a 1-node x 2-process job, started exactly as a pod's container command (env
    from the operator's own pod env, the launcher's grace as the operator derives it), as PID 1
    of a PID namespace when `as_pid1` and allowed; returns (process, pid to signal, work dir)."""
    from ddpjob_cli.local import free_port, node_command, node_env, validate
    from ddpjob_operator.builders.envvars import stop_grace_seconds

    work = tmp_path / "w"
    job = validate({"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "podstop"},
                    "spec": {"nodes": 1, "nprocPerNode": 2, "gpusPerNode": 0, "image": "trainer:test",
                             "trainer": {"dataset": "digits", "model": "mlp", "epochs": 50, "batchSize": 8,
                                         "checkpoint": {"dir": "ckpt", "everySteps": every_steps, "keep": 2}}}})
    env = node_env(job, 0, master_port=free_port(), metrics_port=metrics_port, attempt=0, workdir=work,
                   result_file=work / "result.json")
    env.pop("DDPJOB_LOCAL", None)  # a pod, not `ddpjob run --local`
    env["DDPJOB_STOP_GRACE_SECONDS"] = f"{stop_grace_seconds(job):g}"  # what the pod's env has (render_pod)
    env.update(env_extra or {})
    prefix = pid1_prefix() if as_pid1 else []
    work.mkdir(parents=True, exist_ok=True)
    log = open(tmp_path / "pod.log", "wb")  # noqa: SIM115  (the child's for its lifetime)
    proc = subprocess.Popen([*prefix, *node_command(job, metrics_port=metrics_port)], env=env, cwd=work,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    target = first_child(proc.pid) if prefix else proc.pid
    return proc, target, work


def sigterm_and_wait(proc: subprocess.Popen, target: int, marker: str, *, at: str) -> list[int]:
    """SIGTERM to the launcher (`target`), then its exit within POD_STOP_BOUND_SECONDS, before the
    kubelet's SIGKILL (else an AssertionError naming what still runs); the run's processes still
    there at that bound."""
    os.kill(target, signal.SIGTERM)
    sent = time.monotonic()
    try:
        proc.wait(timeout=POD_STOP_BOUND_SECONDS)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the launcher did not exit within {POD_STOP_BOUND_SECONDS:.0f}s of SIGTERM {at}; "
                             f"its processes: {describe(run_processes(marker))}") from None
    return wait_gone(marker, until=sent + POD_STOP_BOUND_SECONDS)


@pytest.mark.parametrize("moment", MOMENTS)
def test_sigterm_stops_the_pod_launcher_and_everything_below_it(tmp_path, moment):
    port = free_ports(1)[0]
    with cpu_load():
        proc, target, work = start_pod_launcher(tmp_path, metrics_port=port)
        marker = f"{work}/"
        try:
            wait_for_moment(moment_reached(moment, marker=marker, ports=[port], ckpt_dir=work / "ckpt"),
                            alive=lambda: proc.poll() is None, timeout=300, what=f"moment {moment!r}")
            left = sigterm_and_wait(proc, target, marker, at=f"at moment {moment!r}")
        finally:
            kill_run(proc, marker)
    log = (tmp_path / "pod.log").read_text(errors="replace")
    assert proc.returncode == 143, log[-3000:]
    assert not left, f"still running {POD_STOP_BOUND_SECONDS:.0f}s after SIGTERM: {describe(left)}"
    assert "stopped by SIGTERM" in log, log[-3000:]


def test_a_stop_that_lands_while_the_agent_reads_its_ranks_metrics_restarts_nothing(tmp_path):
    """The agent's hooks run in its main thread, where torchrun's stop handler raises its
    SignalException. The watchdog once caught it as a read that failed: the agent lived on while
    the launcher stopped its workers, saw them exit and restarted them into a new rendezvous
    round, which an elastic peer joined at once and then waited in for this pod until its
    collective timeout (CI's elastic job, 600 s). Stopped inside that read (held there by a debug
    knob, as a loaded node's slow read holds it), the agent ends with its workers, starting none."""
    from ddpjob_api import contract
    from ddpjob_trainer import debug

    port = free_ports(1)[0]
    proc, target, work = start_pod_launcher(tmp_path, metrics_port=port,
                                            env_extra={"DDPJOB_DEBUG_WATCHDOG_READ": "120"})
    marker, pod_log = f"{work}/", tmp_path / "pod.log"
    held = debug.WATCHDOG_READ_LINE.format(seconds=120)
    try:
        wait_for_moment(lambda: held in pod_log.read_text(errors="replace"), alive=lambda: proc.poll() is None,
                        timeout=300, what="the agent's held read")
        left = sigterm_and_wait(proc, target, marker, at="in the agent's read")
    finally:
        kill_run(proc, marker)
    log = pod_log.read_text(errors="replace")
    assert proc.returncode == 143 and not left, (describe(left), log[-3000:])
    assert "hang watchdog is blind" not in log, log[-3000:]        # the stop was not taken for a failed read
    assert contract.inplace_marker(0, 1) not in log, log[-3000:]   # and no worker was started after it


def test_the_launcher_reaps_workers_orphaned_by_a_dead_agent(tmp_path):
    """torchrun gives its workers sessions of their own: when the agent dies abruptly, killing
    its process group misses them. The launcher still finds and stops them when it ends. (Not
    as PID 1: there the kernel would kill them with the namespace; `ddpjob run --local` has none.)"""
    port = free_ports(1)[0]
    proc, _, work = start_pod_launcher(tmp_path, metrics_port=port, as_pid1=False)
    marker = f"{work}/"
    try:
        wait_for_moment(moment_reached("step", marker=marker, ports=[port], ckpt_dir=work / "ckpt"),
                        alive=lambda: proc.poll() is None, timeout=300, what="training steps")
        (agent,) = agents(marker)
        os.kill(agent, signal.SIGKILL)
        proc.wait(timeout=120)  # the launcher sees its child die and ends the node
        left = wait_gone(marker, until=time.monotonic() + STOP_BOUND_SECONDS)
    finally:
        kill_run(proc, marker)
    assert proc.returncode != 0
    assert not left, f"workers outlived their launcher: {describe(left)}"



def complete_checkpoints(ckpt: Path) -> list[int]:
    from ddpjob_trainer.checkpointing.checkpoint import MANIFEST
    return sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if (p / MANIFEST).is_file())


def stop_at(tmp_path, step: int, *, after=None, env_extra: dict[str, str] | None = None):
    """A pod's launcher (checkpoints every 5 steps) whose ranks wait for SIGTERM at `step`'s boundary
    (DDPJOB_DEBUG_AWAIT_SIGTERM), before their stop ballot: SIGTERM is sent once rank 0 waits there
    and `after(checkpoint dir)` holds, so the stop lands at a known step, never by a race. Their
    vote, one step behind, decides at the next boundary, `step` + 1. (exit code, log, checkpoint dir)."""
    from ddpjob_trainer.debug import AWAIT_LINE

    port = free_ports(1)[0]
    proc, target, work = start_pod_launcher(tmp_path, metrics_port=port, every_steps=5,
                                            env_extra={"DDPJOB_DEBUG_AWAIT_SIGTERM": str(step), **(env_extra or {})})
    marker, ckpt, log = f"{work}/", work / "ckpt", tmp_path / "pod.log"
    waiting = AWAIT_LINE.format(rank=0, step=step)
    try:
        wait_for_moment(lambda: waiting in log.read_text(errors="replace") and (after is None or after(ckpt)),
                        alive=lambda: proc.poll() is None, timeout=300, what=f"the ranks waiting at step {step}")
        os.kill(target, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        kill_run(proc, marker)
    return proc.returncode, log.read_text(errors="replace"), ckpt


def saved_at(log: str, ckpt: Path, step: int) -> str:
    """Why the stop saved `step` (epoch 0: 2 ranks x 8 samples a step), after asserting it did, into a
    complete checkpoint of that position (what the next attempt loads: tests/realpods/test_pod_stop)."""
    from ddpjob_trainer.checkpointing.checkpoint import load_shared_state, verify

    sample = step * 16
    saving = re.search(rf"stop requested \(SIGTERM\): saving a checkpoint at step {step} \(epoch 0, sample {sample}\): "
                       r"(.*)", log)
    assert saving, log[-3000:]
    assert f"checkpoint {ckpt}/step-{step:08d} saved in" in log, log[-3000:]
    path = ckpt / f"step-{step:08d}"
    assert verify(path) is None
    state = load_shared_state(path)
    assert (state["step"], state["epoch"], state["samples_done"]) == (step, 0, sample)
    return saving.group(1)


def test_a_pod_stopped_before_its_first_checkpoint_saves_by_the_estimate(tmp_path):
    """Nothing saved yet in the attempt (checkpoints every 5 steps, SIGTERM at step 2): the save is
    judged by the state's bytes over the write speed measured at start, fits the grace, and step 3
    is saved rather than everything since the start lost."""
    code, log, ckpt = stop_at(tmp_path, 2)
    assert code == 143, log[-3000:]
    assert re.match(r"a save estimated at [\d.]+s \(.* at .*/s, .*\), [\d.]+s of the stop grace left$",
                    saved_at(log, ckpt, 3))
    assert complete_checkpoints(ckpt) == [3]


def test_a_pod_stopped_just_after_a_save_saves_by_its_measured_time(tmp_path):
    """SIGTERM once step 5's checkpoint is complete on disk, at step 6: its time is already the
    vote's (recorded before its manifest), so step 7, the next boundary, is saved by the measured
    time, whatever the background writer still does after publishing."""
    code, log, ckpt = stop_at(tmp_path, 6, after=lambda ckpt: complete_checkpoints(ckpt) == [5])
    assert code == 143, log[-3000:]
    assert re.match(r"the last save took [\d.]+s \(measured\), [\d.]+s of the stop grace left$", saved_at(log, ckpt, 7))
    assert complete_checkpoints(ckpt) == [5, 7]


def test_a_pod_whose_save_cannot_fit_in_the_grace_does_not_save_and_says_why(tmp_path):
    """Storage far too slow for the grace (DDPJOB_DEBUG_WRITE_BANDWIDTH: 1000 B/s, so the model's
    ~0.7 MB would take minutes): no save is started, the log names the estimate and the time left,
    and the pod still ends 143."""
    code, log, ckpt = stop_at(tmp_path, 2, env_extra={"DDPJOB_DEBUG_WRITE_BANDWIDTH": "1000"})
    assert code == 143, log[-3000:]
    why = re.search(r"stop requested \(SIGTERM\) at step 3 \(epoch 0, sample 48\): no checkpoint saved: a save "
                    r"estimated at ([\d.]+)s \(.* at 0.001 MB/s, .*\) and ([\d.]+)s of the stop grace is left", log)
    assert why, log[-3000:]
    assert float(why.group(1)) * 1.5 > float(why.group(2)) > 0
    assert complete_checkpoints(ckpt) == [] and not list(ckpt.glob(".tmp-*"))
