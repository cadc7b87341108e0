"""The agent's watchdog (ddpjob_trainer.agent): which ranks it kills for a stall, read from the
pod's real multiprocess metrics directory, and what it leaves as the failure's record."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from ddpjob_api import contract
from ddpjob_trainer.agent import Progress, StepWindow, Watchdog, read_progress, stalled, steps_reached

NOW = 10_000.0


@pytest.mark.parametrize("ranks,configured,started_at,killed", [
    # stepping: 30 s timeout; rank 1's last step 31 s ago, rank 0's 29 s ago
    ({0: Progress("training", NOW - 29, step=7), 1: Progress("training", NOW - 31, step=6)}, 30, 0.0, {1}),
    # the workers started 10 s ago: what ranks reported before is an earlier worker's
    ({1: Progress("training", NOW - 100, step=6)}, 30, NOW - 10, set()),
    # ... and 100 s ago, a worker that reported nothing since is still importing: not the agent's to judge
    ({1: Progress("training", NOW - 200, step=6)}, 30, NOW - 100, set()),
    ({1: Progress("process_group_init", NOW - 31)}, 30, NOW - 40, {1}),
    # before the first step, a stage's start is its progress (any stage, the launcher's included)
    ({0: Progress("first_step", NOW - 31), 1: Progress(None, NOW - 31)}, 30, 0.0, {0, 1}),
    ({0: Progress("process_group_init", NOW - 29)}, 30, 0.0, set()),
    # derived timeouts (no hangTimeoutSeconds): 600 s before the first step, max(300, 20 x step) after
    ({0: Progress("first_step", NOW - 599)}, None, 0.0, set()),
    ({0: Progress("first_step", NOW - 601)}, None, 0.0, {0}),
    ({0: Progress("training", NOW - 301, step=3, step_seconds=1.0)}, None, 0.0, {0}),
    ({0: Progress("training", NOW - 301, step=3, step_seconds=20.0)}, None, 0.0, set()),   # 400 s
    ({0: Progress("eval", NOW - 301, step=3, step_seconds=1.0)}, None, 0.0, set()),        # a pause: 600 s
    # a worker an in-place restart started, restoring: the rank stepped before (an earlier worker's
    # step), yet a start-up stage gets the start-up timeout
    ({0: Progress("process_group_init", NOW - 301, step=6, step_seconds=1.0)}, None, NOW - 400, set()),
    ({0: Progress("first_step", NOW - 599, step=6, step_seconds=1.0)}, None, NOW - 700, set()),
    ({0: Progress("first_step", NOW - 601, step=6, step_seconds=1.0)}, None, NOW - 700, {0}),
])
def test_a_rank_without_progress_for_its_hang_timeout_is_stalled(ranks, configured, started_at, killed):
    assert set(stalled(ranks, configured=configured, started_at=started_at, now=NOW)) == killed


def test_the_record_names_the_stall_in_the_form_the_operator_recognizes():
    (why,) = stalled({1: Progress("training", NOW - 31.4, step=6)}, configured=30, started_at=0.0, now=NOW).values()
    assert why == "stalled: no progress for 31s in training after step 6 (hang timeout 30s)"
    assert contract.STALL_ERROR_RE.match(why)
    (early,) = stalled({0: Progress(None, NOW - 40)}, configured=30, started_at=0.0, now=NOW).values()
    assert early == "stalled: no progress for 40s in rendezvous (hang timeout 30s)"
    assert contract.STALL_ERROR_RE.match(early)


def _telemetry_writes(metrics_dir: str, script: str, rank: int = 1) -> None:
    """Run `script` with a Telemetry `tm` of `rank` in a process of its own (as a worker does)."""
    code = ("from ddpjob_trainer.telemetry import Telemetry\n"
            f"tm = Telemetry(labels={{'ddpjob': 'j', 'namespace': 'n', 'rank': '{rank}', 'local_rank': '0', "
            "'node_rank': '1'})\n" + script)
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, contract.ENV_METRICS_DIR: metrics_dir})


def test_progress_is_read_from_the_ranks_metrics_directory(tmp_path):
    _telemetry_writes(str(tmp_path), "tm.set_stage('first_step', timestamp=100.0)\n"
                      "tm.step(step=5, epoch=0, loss=1.0, samples=8, step_seconds=0.5, data_wait_seconds=0.0, "
                      "timestamp=200.0)\n"
                      "tm.step(step=6, epoch=0, loss=1.0, samples=8, step_seconds=1.5, data_wait_seconds=0.0, "
                      "timestamp=210.0)\n")
    (rank, p), = read_progress(str(tmp_path)).items()
    assert rank == 1 and p.stage == "training" and p.step == 6 and p.step_seconds == pytest.approx(1.0)
    assert p.since >= 210.0  # the last step (training began, at the first step, on its own clock)
    assert p.stepped_at == 210.0
    # The step at a failure is the workers' own: a worker started after the last step (restarted
    # in place, failed before stepping) reached none, and its predecessor's would be lost twice.
    assert steps_reached(str(tmp_path), since=205.0) == {"1": 6}
    assert steps_reached(str(tmp_path), since=211.0) == {}


def test_a_renewed_stage_is_progress_to_the_watchdog(tmp_path):
    """A rank a test holds (debug.Knobs.hold) renews its stage's start: read as progress after its
    last step, in the same stage."""
    _telemetry_writes(str(tmp_path), "tm.set_stage('first_step', timestamp=100.0)\n"
                      "tm.step(step=6, epoch=0, loss=1.0, samples=8, step_seconds=1.5, data_wait_seconds=0.0, "
                      "timestamp=210.0)\n"
                      "tm.renew_stage()\n")
    (_, p), = read_progress(str(tmp_path)).items()
    assert p.stage == "training" and p.stepped_at == 210.0 and p.since > 210.0 + 1e6, p
    assert stalled({1: p}, configured=30, started_at=0.0, now=p.since + 29) == {}


def test_the_watchdog_kills_the_stalled_rank_once_and_leaves_its_record(tmp_path):
    metrics, status = tmp_path / "metrics", tmp_path / "status"
    for rank in (0, 1):
        _telemetry_writes(str(metrics), "tm.set_stage('first_step', timestamp=100.0)\n", rank=rank)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])  # a rank that finished: never signalled
    done.wait()
    try:
        now = [100.0 + 14]
        captured = []  # (pids, trigger, was the victim alive then)
        dog = Watchdog({contract.ENV_METRICS_DIR: str(metrics), contract.ENV_STATUS_DIR: str(status),
                        contract.ENV_RESTART_ON_HANG: "1", contract.ENV_HANG_TIMEOUT: "30"}, clock=lambda: now[0],
                       capture=lambda pids, trigger: captured.append((dict(pids), trigger, victim.poll() is None)))
        group = types.SimpleNamespace(workers=[types.SimpleNamespace(global_rank=1, id=victim.pid),
                                               types.SimpleNamespace(global_rank=0, id=done.pid)])
        dog.on_monitor(None, group)
        assert captured == []                              # 14 s: not half its hang timeout
        for seconds in (15, 16, 29):
            now[0] = 100.0 + seconds
            dog.on_monitor(None, group)
        # Half its timeout idle: its pod's workers' stacks, once in the spell (a peer waiting for
        # it would die with it, its stack with it).
        assert captured == [({1: victim.pid}, contract.STACK_IDLE, True)]
        assert victim.poll() is None                       # 29 s < 30 s
        now[0] += 2
        dog.on_monitor(None, group)
        assert victim.wait(timeout=10) == -9
        assert captured[1:] == [({1: victim.pid}, contract.STACK_STALL, True)]  # taken before the kill
        assert (status / "failed-rank-1.txt").read_text() == (
            "stalled: no progress for 31s in first_step (hang timeout 30s)\n")
        assert dog.killed == {victim.pid} and not (status / "failed-rank-0.txt").exists()
    finally:
        victim.kill()


def test_a_file_a_worker_is_creating_is_read_as_empty_not_as_a_failure(tmp_path):
    """prometheus_client opens a process's new metric file empty, then sizes it: a read in that
    moment (a worker starting, a gauge mode first used) sees the rest of the directory. Merged
    as it was, the empty file failed the whole read, and the watchdog stopped for good."""
    _telemetry_writes(str(tmp_path), "tm.step(step=6, epoch=0, loss=1.0, samples=8, step_seconds=1.5, "
                      "data_wait_seconds=0.0, timestamp=210.0)\n")
    (tmp_path / "gauge_all_4242.db").write_bytes(b"")  # created, not yet sized
    assert read_progress(str(tmp_path))[1].step == 6
    assert steps_reached(str(tmp_path)) == {"1": 6}


def test_a_watchdog_that_cannot_read_the_metrics_says_so_once_and_reads_again_when_it_can(tmp_path, capsys):
    """A read that fails skips that look (the agent and its workers go on); the next look reads
    again, and a stall after it is judged as ever."""
    _telemetry_writes(str(tmp_path), "tm.set_stage('first_step', timestamp=100.0)\n", rank=0)
    torn = tmp_path / "gauge_mostrecent_1.db"
    torn.write_bytes(b"not an mmap of prometheus_client's")
    now = [100.0 + 10]
    captured = []
    dog = Watchdog({contract.ENV_METRICS_DIR: str(tmp_path), contract.ENV_HANG_TIMEOUT: "30"}, clock=lambda: now[0],
                   capture=lambda pids, trigger: captured.append(trigger))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        group = types.SimpleNamespace(workers=[types.SimpleNamespace(global_rank=0, id=worker.pid)])
        for seconds in (10, 16, 20):  # idle for half its timeout, unread
            now[0] = 100.0 + seconds
            dog.on_monitor(None, group)
        assert captured == [] and dog.enabled
        assert capsys.readouterr().err.count("the hang watchdog is blind") == 1
        torn.unlink()
        now[0] += 1
        dog.on_monitor(None, group)
        assert captured == [contract.STACK_IDLE] and "reads the ranks' metrics again" in capsys.readouterr().err
    finally:
        worker.kill()


@pytest.mark.parametrize("env", [{contract.ENV_TELEMETRY: "0"}, {}])
def test_the_watchdog_is_off_without_metrics(tmp_path, env):
    base = {contract.ENV_METRICS_DIR: str(tmp_path), contract.ENV_RESTART_ON_HANG: "1"}
    assert Watchdog(base).enabled and Watchdog(base).kills
    assert not Watchdog({**base, **env} if env else {contract.ENV_RESTART_ON_HANG: "1"}).enabled


def test_without_restart_on_hang_the_watchdog_takes_the_stacks_and_kills_nothing(tmp_path):
    metrics = tmp_path / "metrics"
    _telemetry_writes(str(metrics), "tm.set_stage('first_step', timestamp=100.0)\n", rank=1)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        now, captured = [116.0], []
        dog = Watchdog({contract.ENV_METRICS_DIR: str(metrics), contract.ENV_RESTART_ON_HANG: "0",
                        contract.ENV_HANG_TIMEOUT: "30"}, clock=lambda: now[0],
                       capture=lambda pids, trigger: captured.append(trigger))
        assert dog.enabled and not dog.kills
        group = types.SimpleNamespace(workers=[types.SimpleNamespace(global_rank=1, id=victim.pid)])
        for seconds in (16, 31, 32, 60):
            now[0] = 100.0 + seconds
            dog.on_monitor(None, group)
        assert captured == [contract.STACK_IDLE, contract.STACK_STALL]   # each once in the spell
        assert victim.poll() is None and not dog.killed
    finally:
        victim.kill()


def test_the_watchdog_gives_a_start_up_the_trainer_still_waits_for_its_own_limit():
    """spec.trainer.timeoutSeconds past 600 s (a slow dataset load): the watchdog must not kill
    the start-up the trainer's own process group still waits for."""
    base = {contract.ENV_RESTART_ON_HANG: "1", contract.ENV_METRICS_DIR: "/nonexistent"}
    slow = Watchdog({**base, contract.ENV_TRAINER_CONFIG: json.dumps({"timeoutSeconds": 1800})})
    assert (slow.startup, Watchdog(base).startup) == (1800, 600)
    loading = {0: Progress("process_group_init", NOW - 900)}
    assert stalled(loading, configured=None, started_at=0.0, now=NOW, startup=slow.startup) == {}
    assert set(stalled(loading, configured=None, started_at=0.0, now=NOW)) == {0}


def test_the_watchdog_judges_the_step_time_by_the_recent_steps_not_a_slow_first_one():
    """A 600 s first step (compilation) then 20 s steps: the cumulative mean keeps the timeout
    above the monitor's (median of recent steps) for hundreds of steps; the window forgets it."""
    window, seen = StepWindow(), None
    for count in range(1, 121):
        seen = window.recent(0, Progress("training", NOW, step=count, steps_timed=count,
                                         seconds_timed=600.0 + 20.0 * (count - 1)))
    assert seen is not None and seen.step_seconds == pytest.approx(20.0)
    assert contract.hang_timeout(None, stage="training", step_seconds=seen.step_seconds) == 400
    # One look, or a first look that already spans more than the window: the cumulative mean.
    fresh = Progress("training", NOW, step=3, step_seconds=2.0, steps_timed=3, seconds_timed=6.0)
    assert StepWindow().recent(0, fresh).step_seconds == 2.0
    # Looks that saw no new step keep the window; another rank has its own.
    w = StepWindow()
    for count, total in ((10, 10.0), (10, 10.0), (20, 30.0)):
        last = w.recent(1, Progress("training", NOW, step=count, steps_timed=count, seconds_timed=total))
    assert last.step_seconds == 2.0 and w.recent(2, fresh).step_seconds == 2.0


def test_torchruns_stop_passes_every_hook_that_forgives_a_failed_read(tmp_path, monkeypatch):
    """The agent's stop handler raises SignalException (an Exception) in the hooks' thread: a hook
    that forgives a torn read or a failed capture must let it through (test_launcher_signals
    stops a real agent inside its read), and still forgive the rest."""
    import signal

    from torch.distributed.elastic.multiprocessing import SignalException

    import ddpjob_trainer.agent as agent
    from ddpjob_trainer import stacks

    def stopped(*_args, **_kwargs):
        raise SignalException("Process 1 got signal: 15", signal.SIGTERM)

    monkeypatch.setattr(agent, "read_progress", stopped)
    monkeypatch.setattr(stacks, "capture", stopped)
    with pytest.raises(SignalException):
        agent.steps_reached(str(tmp_path))
    with pytest.raises(SignalException):
        Watchdog({contract.ENV_METRICS_DIR: str(tmp_path)}).on_monitor(None, types.SimpleNamespace(workers=[]))
    with pytest.raises(SignalException):
        agent.Hooks({contract.ENV_STACKS_DIR: str(tmp_path)}).capture({0: os.getpid()}, contract.STACK_STALL)

    def torn(*_args, **_kwargs):
        raise ValueError("a torn file")

    monkeypatch.setattr(agent, "read_progress", torn)
    monkeypatch.setattr(stacks, "capture", torn)
    assert agent.steps_reached(str(tmp_path)) == {}
    Watchdog({contract.ENV_METRICS_DIR: str(tmp_path)}).on_monitor(None, types.SimpleNamespace(workers=[]))
    agent.Hooks({contract.ENV_STACKS_DIR: str(tmp_path)}).capture({0: os.getpid()}, contract.STACK_STALL)
