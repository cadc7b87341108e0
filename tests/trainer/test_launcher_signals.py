"""The in-pod launcher stops within seconds of SIGTERM (what a pod deletion sends), whatever its
torchrun agent and workers are doing, on a loaded machine: well inside a pod's default
terminationGracePeriodSeconds (30 s), so the kubelet never has to SIGKILL the pod at its end.

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


@pytest.mark.parametrize("moment", MOMENTS)
def test_sigterm_stops_the_pod_launcher_and_everything_below_it(tmp_path, moment):
    port = free_ports(1)[0]
    with cpu_load():
        proc, target, work = start_pod_launcher(tmp_path, metrics_port=port)
        marker = f"{work}/"
        try:
            wait_for_moment(moment_reached(moment, marker=marker, ports=[port], ckpt_dir=work / "ckpt"),
                            alive=lambda: proc.poll() is None, timeout=300, what=f"moment {moment!r}")
            os.kill(target, signal.SIGTERM)
            sent = time.monotonic()
            try:
                proc.wait(timeout=STOP_BOUND_SECONDS)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the launcher did not exit within {STOP_BOUND_SECONDS:.0f}s of SIGTERM at "
                                     f"moment {moment!r}; its processes: {describe(run_processes(marker))}") from None
            left = wait_gone(marker, until=sent + STOP_BOUND_SECONDS)
        finally:
            kill_run(proc, marker)
    log = (tmp_path / "pod.log").read_text(errors="replace")
    assert proc.returncode == 143, log[-3000:]
    assert not left, f"still running {STOP_BOUND_SECONDS:.0f}s after SIGTERM: {describe(left)}"
    assert "stopped by SIGTERM" in log, log[-3000:]


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


def test_a_stopped_pod_saves_a_checkpoint_mid_epoch(tmp_path):
    """SIGTERM mid-epoch (a pod deleted or preempted): the ranks agree at the next step boundary,
    the save fits in the grace (the epoch-end save measured it), so they save that step, a
    complete checkpoint the next attempt loads (its resume in a pod: tests/realpods/test_pod_stop),
    and end 143. Checkpoints only at epoch ends (everySteps 0), steps slowed a little so the
    signal lands well inside epoch 1."""
    from ddpjob_trainer.checkpointing.checkpoint import load_shared_state, verify

    port = free_ports(1)[0]
    proc, target, work = start_pod_launcher(tmp_path, metrics_port=port, every_steps=0,
                                            env_extra={"DDPJOB_DEBUG_STEP_SLEEP": "0.05"})
    marker, ckpt = f"{work}/", work / "ckpt"
    try:
        wait_for_moment(lambda: bool(complete_checkpoints(ckpt)), alive=lambda: proc.poll() is None,
                        timeout=300, what="the first epoch's checkpoint")
        (epoch_end,) = complete_checkpoints(ckpt)
        os.kill(target, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        kill_run(proc, marker)
    log = (tmp_path / "pod.log").read_text(errors="replace")
    assert proc.returncode == 143, log[-3000:]
    saved = re.search(r"stop requested \(SIGTERM\): saving a checkpoint at step (\d+) \(epoch 1, sample (\d+)\)", log)
    assert saved, log[-3000:]
    step, sample = int(saved.group(1)), int(saved.group(2))
    # Mid-epoch 1: each step of epoch 1 took 2 ranks x 8 samples off the front of its order.
    assert step > epoch_end and sample == (step - epoch_end) * 16 < 1438, (epoch_end, step, sample)
    assert complete_checkpoints(ckpt) == [epoch_end, step], log[-3000:]
    assert f"checkpoint {ckpt}/step-{step:08d} saved in" in log
    path = ckpt / f"step-{step:08d}"
    assert verify(path) is None
    state = load_shared_state(path)
    assert (state["step"], state["epoch"], state["samples_done"]) == (step, 1, sample)
