"""The in-pod launcher stops within seconds of SIGTERM (what a pod deletion sends), whatever its
torchrun agent and workers are doing, on a loaded machine: well inside a pod's default
terminationGracePeriodSeconds (30 s), so the kubelet never has to SIGKILL the pod at its end.

Where the machine allows it (root, `unshare`), the launcher runs as PID 1 of its own PID
namespace, as in a container: PID 1 ignores every signal it has no handler for.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

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


def start_pod_launcher(tmp_path, *, metrics_port: int, as_pid1: bool = True):
    """One node of a 1-node x 2-process job, started exactly as a pod's container command (env
    from the operator's own pod env), as PID 1 of a PID namespace when `as_pid1` and allowed;
    returns (process, pid to signal, work dir)."""
    from ddpjob_cli.local import free_port, node_command, node_env, validate

    work = tmp_path / "w"
    job = validate({"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "podstop"},
                    "spec": {"nodes": 1, "nprocPerNode": 2, "gpusPerNode": 0, "image": "trainer:test",
                             "trainer": {"dataset": "digits", "model": "mlp", "epochs": 50, "batchSize": 8,
                                         "checkpoint": {"dir": "ckpt", "everySteps": 1, "keep": 2}}}})
    env = node_env(job, 0, master_port=free_port(), metrics_port=metrics_port, attempt=0, workdir=work,
                   result_file=work / "result.json")
    env.pop("DDPJOB_LOCAL", None)  # a pod, not `ddpjob run --local`
    prefix = pid1_prefix() if as_pid1 else []
    work.mkdir(parents=True)
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

