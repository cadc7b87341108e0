"""The in-pod launcher's wait for the master: real sockets and real name resolution."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ddpjob_trainer.launch.node import wait_for_master
from tests.support.stopping import first_child, pid1_prefix


def test_returns_once_the_master_port_accepts():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def listen_later():
        time.sleep(0.5)
        srv.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    try:
        wait_for_master("127.0.0.1", port, timeout=20, interval=0.1)
    finally:
        srv.close()


def test_unresolvable_master_names_the_dns_name():
    with pytest.raises(TimeoutError, match=r"waiting for its DNS name.*job-0\.job\.ns\.svc\.invalid"):
        wait_for_master("job-0.job.ns.svc.invalid", 29500, timeout=0.5, interval=0.1)


def test_closed_port_names_the_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TimeoutError, match=rf"waiting for its port.*127.0.0.1:{port} refuses"):
        wait_for_master("127.0.0.1", port, timeout=0.5, interval=0.1)


# --- stopping: signals, process trees ------------------------------------------------------------

def _run_py(code: str, *, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: stop_tree acts on every descendant of its caller, which
    must not be this test process."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"


def test_stop_tree_kills_a_tree_that_ignores_sigterm_across_sessions():
    proc = _run_py("""
        import json, os, signal, subprocess, sys, time
        from ddpjob_trainer.launch.procs import stop_tree
        # child (own session) -> grandchild (own session again, like torchrun's workers); both ignore SIGTERM
        inner = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
                "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'], start_new_session=True); time.sleep(600)"
        child = subprocess.Popen([sys.executable, "-c", inner], start_new_session=True)
        import psutil
        def descendants(): return [p.pid for p in psutil.Process().children(recursive=True)]
        while len(descendants()) < 2:
            time.sleep(0.05)
        tree = sorted(descendants())
        left = stop_tree([child], grace=0.5)
        print(json.dumps({"tree": tree, "left": left, "rc": child.returncode}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["left"] == [] and out["rc"] == -signal.SIGKILL
    assert not [p for p in out["tree"] if _alive(p)]


def test_orphans_reparented_to_the_subreaper_are_stopped_and_reaped():
    proc = _run_py("""
        import json, os, subprocess, sys, time
        import psutil
        from ddpjob_trainer.launch.procs import become_subreaper, stop_tree
        def descendants(): return [p.pid for p in psutil.Process().children(recursive=True)]
        assert become_subreaper()
        # the middle process starts a grandchild and exits at once: the grandchild is orphaned
        subprocess.run([sys.executable, "-c", "import subprocess, sys; "
                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)"])
        deadline = time.monotonic() + 30
        while not descendants() and time.monotonic() < deadline:
            time.sleep(0.05)
        orphans = sorted(descendants())
        left = stop_tree([], grace=5)
        print(json.dumps({"orphans": orphans, "left": left, "after": descendants()}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["orphans"]) == 1, "the orphan was re-parented to the subreaper"
    assert out["left"] == [] and out["after"] == [], "stopped, and reaped (no zombie left)"


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_first_signal_raises_stop_and_later_ones_only_hurry(sig, code):
    proc = _run_py(f"""
        import os, signal
        from ddpjob_trainer.launch.signals import Stop, StopSignals
        s = StopSignals().install()
        try:
            os.kill(os.getpid(), {int(sig)})
            signal.pause()  # not reached: the handler raises
        except Stop as exc:
            print(exc, s.exit_code, s.hurry())
        s.armed = False
        os.kill(os.getpid(), {int(sig)})  # a second one, during the stop: recorded, not raised
        print(s.exit_code, s.hurry())
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == [f"stopped by {sig.name} {code} False", f"{code} True"]


def test_a_bad_stop_grace_names_the_variable():
    from ddpjob_trainer.errors import ConfigError
    from ddpjob_trainer.launch.signals import stop_grace_from_env

    assert stop_grace_from_env({}) == 5.0 and stop_grace_from_env({"DDPJOB_STOP_GRACE_SECONDS": "2.5"}) == 2.5
    for bad in ("soon", "-1"):
        with pytest.raises(ConfigError, match="DDPJOB_STOP_GRACE_SECONDS"):
            stop_grace_from_env({"DDPJOB_STOP_GRACE_SECONDS": bad})


def test_a_launcher_waiting_for_its_master_stops_at_once_even_as_pid_1(tmp_path):
    """A pod deleted while its worker waits for the master: as a container's PID 1 (simulated
    with a PID namespace where allowed) a launcher without a handler would ignore SIGTERM for
    the whole --master-timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: the master never comes
    # A pod's env: its c10d rendezvous is hosted by the master it waits for.
    env = {**os.environ, "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
           "DDPJOB_TRAINER_CONFIG": '{"dataset": "digits", "model": "mlp"}'}
    env.pop("DDPJOB_LOCAL", None)
    prefix = pid1_prefix()
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "ddpjob_trainer.launch", "--master-timeout", "300"],
                            env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stderr.readline()  # printed after the handlers are installed
        assert "waiting up to 300s for master" in line, line
        target = first_child(proc.pid) if prefix else proc.pid
        os.kill(target, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err


def test_with_owned_the_callers_other_children_are_left_alone():
    proc = _run_py("""
        import json, os, subprocess, sys, time
        from ddpjob_trainer.launch.procs import stop_tree
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        node = subprocess.Popen(sleeper, start_new_session=True)
        bystander = subprocess.Popen(sleeper, start_new_session=True)  # not the run's
        left = stop_tree([node], grace=5, owned=lambda pid: False)
        alive = bystander.poll() is None
        bystander.kill()
        print(json.dumps({"left": left, "node": node.returncode, "bystander_alive": alive}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"left": [], "node": -15, "bystander_alive": True}


@pytest.mark.parametrize("failed, limit, want_start, want_end", [
    (["rank 1 failed:\nTraceback ...\nRuntimeError: boom"], 4000,
     "training exited with code 1\nrank 1 failed:", "RuntimeError: boom"),
    # Too long: the first line and the traceback's end (the error itself) stay, the middle goes.
    (["rank 0 failed:\n" + "  frame\n" * 2000 + "ValueError: last words"], 200,
     "training exited with code 1\n...", "ValueError: last words"),
])
def test_failure_message_keeps_the_exit_code_and_the_end_of_the_traceback(failed, limit, want_start, want_end):
    from ddpjob_trainer.launch.report import failure_message

    msg = failure_message(1, failed, limit=limit)
    assert msg.startswith(want_start) and msg.endswith(want_end), msg
    assert len(msg) <= limit


def test_no_recorded_failure_leaves_the_message_to_the_kubelets_log_tail():
    from ddpjob_trainer.launch.report import failure_message

    assert failure_message(1, []) is None


def test_a_failed_trainer_leaves_its_traceback_as_the_termination_message(termination_log, monkeypatch):
    """The real launcher and a child that fails the way the built-in trainer does (its failure
    recorded under DDPJOB_STATUS_DIR): the pod's termination message — which outlives the pod's log
    once a group restart deletes it — carries the error, not only the exit code."""
    from ddpjob_trainer.launch.node import main

    term = termination_log
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    script = textwrap.dedent("""
        import sys
        from ddpjob_trainer.__main__ import _record
        _record("failed", "rank 1 failed:\\nTraceback (most recent call last):\\nOSError: disk full")
        sys.exit(1)
    """)
    assert main(["--", sys.executable, "-c", script]) == 1
    text = term.read_text()
    assert text.startswith("training exited with code 1\nrank 1 failed:"), text
    assert text.endswith("OSError: disk full"), text


def test_a_failure_nobody_recorded_writes_no_termination_message(termination_log, monkeypatch):
    """The kubelet keeps the log's tail instead (FallbackToLogsOnError): more than 'exit code 3'."""
    from ddpjob_trainer.launch.node import main

    term = termination_log
    monkeypatch.setenv("NODE_RANK", "1")
    assert main(["--", sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert not term.exists()


def test_a_rank_exits_without_teardown_and_loses_no_output():
    """exit_now: the exit code is main's, buffered output is flushed, and no interpreter teardown
    runs (where torch's C++ destructors abort now and then, failing a finished rank)."""
    script = textwrap.dedent("""
        import atexit, sys
        from ddpjob_trainer.__main__ import exit_now
        atexit.register(lambda: print("teardown ran"))
        print("last words", end="")
        print("to stderr", end="", file=sys.stderr)
        exit_now(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "last words", "to stderr")


def _torch_error_file(path, exc: BaseException) -> None:
    """What torch.distributed.elastic's @record writes for `exc`, written by torch itself."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    old = os.environ.get("TORCHELASTIC_ERROR_FILE")
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
    try:
        try:
            raise exc
        except type(exc) as e:
            ErrorHandler().record_exception(e)
    finally:
        if old is None:
            os.environ.pop("TORCHELASTIC_ERROR_FILE")
        else:
            os.environ["TORCHELASTIC_ERROR_FILE"] = old


@pytest.mark.parametrize("content, want", [
    (None, []),                                    # nothing recorded
    ("not json", []),
    ('{"message": "ChildFailedError: rank 3"}', ["ChildFailedError: rank 3"]),
    ('{"message": {"message": "KeyError: x", "extraInfo": {}}}', ["KeyError: x"]),
    ('{"other": 1}', []),
    ('{"message": ""}', []),
])
def test_recorded_error_reads_the_traceback_or_message_or_nothing(tmp_path, content, want):
    from ddpjob_trainer.launch.report import recorded_error

    path = tmp_path / "error.json"
    if content is not None:
        path.write_text(content)
    assert recorded_error(str(path)) == want


@pytest.mark.parametrize("content, want", [
    (None, {"mlflow_run_id": "r1"}),                                  # a user's script: no result
    ('{"steps": 16, "mlflow_run_id": null}', {"steps": 16, "mlflow_run_id": "r1"}),  # opened too late
    ('{"steps": 16}', {"steps": 16, "mlflow_run_id": "r1"}),
    ('{"steps": 16, "mlflow_run_id": "r0"}', {"steps": 16, "mlflow_run_id": "r0"}),  # the tracker's own
    ("not json", "not json"),                                          # left as it is
    ("[1]", [1]),
])
def test_the_result_names_the_launchers_run_where_it_names_none(tmp_path, content, want):
    from ddpjob_trainer.launch.report import name_the_run

    path = tmp_path / "result.json"
    if content is not None:
        path.write_text(content)
    name_the_run(str(path), "r1")
    text = path.read_text()
    assert (text if want == "not json" else json.loads(text)) == want
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no .part left


def test_recorded_error_reads_what_torch_itself_writes(tmp_path):
    from ddpjob_trainer.launch.report import recorded_error

    path = tmp_path / "error.json"
    _torch_error_file(path, ValueError("learning rate is negative"))
    [detail] = recorded_error(str(path))
    assert detail.startswith("Traceback (most recent call last):"), detail
    assert detail.endswith("ValueError: learning rate is negative"), detail


def test_a_users_script_with_record_leaves_its_traceback_as_the_termination_message(termination_log, monkeypatch):
    """`launcher: true` with a user's own command: the launcher points TORCHELASTIC_ERROR_FILE at
    its scratch dir and reads what @record wrote there."""
    from ddpjob_trainer.launch.node import main

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    script = textwrap.dedent("""
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise FileNotFoundError("no such dataset: /data/imagenet")

        main()
    """)
    assert main(["--", sys.executable, "-c", script]) == 1
    text = termination_log.read_text()
    assert text.startswith("training exited with code 1\nTraceback (most recent call last):"), text
    assert text.endswith("FileNotFoundError: no such dataset: /data/imagenet"), text


# The lost Stop is reported by pytest as an unraisable exception: that is the point of these tests.
LOSES_A_STOP = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _lose_a_stop(signals) -> None:
    """Deliver SIGTERM the way it is lost in real life: the handler runs inside a weakref callback
    (as during an import's module-lock cleanup), where Python prints its exception and drops it."""
    import weakref

    class Thing:
        pass

    thing = Thing()
    ref = weakref.ref(thing, lambda _r: signals._on_signal(signal.SIGTERM, None))
    del thing  # the callback runs here; its Stop is "ignored"
    assert ref() is None


@LOSES_A_STOP
def test_a_stop_lost_in_a_weakref_callback_is_raised_again():
    from ddpjob_trainer.launch.signals import Stop, StopSignals

    signals = StopSignals()
    _lose_a_stop(signals)
    assert signals.signum == signal.SIGTERM  # arrived, yet nothing was raised here
    with pytest.raises(Stop):
        signals.raise_if_stopped()
    signals.armed = False  # during cleanup a signal only hurries it
    signals.raise_if_stopped()


@LOSES_A_STOP
def test_waiting_for_the_master_sees_a_lost_stop():
    from ddpjob_trainer.launch.signals import Stop, StopSignals

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    signals = StopSignals()
    _lose_a_stop(signals)
    t0 = time.monotonic()
    with pytest.raises(Stop):
        wait_for_master("127.0.0.1", port, timeout=30, interval=0.05, check_stop=signals.raise_if_stopped)
    assert time.monotonic() - t0 < 10


@LOSES_A_STOP
def test_waiting_for_the_child_sees_a_lost_stop():
    from ddpjob_trainer.launch.node import _wait
    from ddpjob_trainer.launch.signals import Stop, StopSignals

    signals = StopSignals()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _lose_a_stop(signals)
        with pytest.raises(Stop):
            _wait(child, signals, poll=0.05)
    finally:
        child.kill()
        child.wait()


# --- the job's MLflow run, found before torchrun starts ------------------------------------------

TRACKED = {"MLFLOW_TRACKING_URI": "http://u:pw@mlflow:5000", "DDPJOB_UID": "u-1", "DDPJOB_MLFLOW": "optional"}


@pytest.mark.parametrize("env, node_rank, answer, expected", [
    # Node 0 finds or creates it; every rank below gets it; rank 0's series names it.
    (TRACKED, 0, ('{"run_id": "r1", "experiment_id": "3"}', ""), ("r1", None, ["resolve", "--create"])),
    (TRACKED, 1, ('{"run_id": "r1", "experiment_id": "3"}', ""), ("r1", None, ["resolve", "--wait"])),
    # No run: a warning, training goes on without one; required: the attempt fails, naming the server.
    (TRACKED, 0, (None, "ConnectionError: refused"), (None, None, ["resolve", "--create"])),
    ({**TRACKED, "DDPJOB_MLFLOW": "required"}, 1, (None, "no answer within 60s"),
     (None, "spec.trainer.mlflow.required: no MLflow run at http://mlflow:5000: no answer within 60s",
      ["resolve", "--wait"])),
    # Not asked for (a user's own MLFLOW_TRACKING_URI), or given already (spec.env): nothing to do.
    ({k: v for k, v in TRACKED.items() if k != "DDPJOB_MLFLOW"}, 0, None, (None, None, None)),
    ({**TRACKED, "MLFLOW_RUN_ID": "mine"}, 0, None, (None, None, None)),
])
def test_the_launcher_gives_its_ranks_the_jobs_mlflow_run(monkeypatch, env, node_rank, answer, expected):
    from ddpjob_trainer.launch import runs
    from ddpjob_trainer.launch.node import _RankStages
    from ddpjob_trainer.launch.signals import StopSignals

    asked: list[list[str]] = []
    said: list[str] = []

    def run_tracking(args, env, **kw):
        asked.append(args[:2])
        return answer
    monkeypatch.setattr(runs, "run_tracking", run_tracking)
    monkeypatch.setattr(runs, "say", said.append)
    reported: list[tuple] = []
    stages = _RankStages({"DDPJOB_TELEMETRY": "0"})
    stages.telemetry = [type("T", (), {"labels": {"rank": str(node_rank * 2)},
                                       "mlflow_run": lambda self, *ids: reported.append(ids)})()]
    env, given = dict(env), env.get("MLFLOW_RUN_ID")
    run_id, failed = runs.mlflow_run(env, node_rank=node_rank, children=[], signals=StopSignals(),
                                     on_run=stages.mlflow_run)
    assert (run_id, failed, asked[0] if asked else None) == expected
    assert env.get("MLFLOW_RUN_ID") == (run_id or given)
    assert reported == ([("r1", "3")] if run_id and node_rank == 0 else [])
    if answer and answer[0] is None and not failed:
        assert said == ["WARNING MLflow: no run at http://mlflow:5000 (ConnectionError: refused); training goes on "
                        "without MLFLOW_RUN_ID"]
    assert not any("pw" in line for line in said + [failed or ""])


def _bin(tmp_path, venv: str, shebang: str) -> str:
    """A torchrun console script in `venv`/bin whose shebang is `shebang`."""
    d = tmp_path / venv / "bin"
    d.mkdir(parents=True, exist_ok=True)
    script = d / "torchrun"
    script.write_text(f"#!{shebang}\nimport sys\n")
    return str(script)


@pytest.mark.parametrize("cmd, found, runs_as_agent", [
    # torchrun of this launcher's environment (its console script names this interpreter)
    (["torchrun", "train.py", "--lr", "0.1"], "ours", ["train.py", "--lr", "0.1"]),
    (["torchrun", "--nproc-per-node", "2", "-m", "pkg.train"], "ours-env", ["--nproc-per-node", "2", "-m", "pkg.train"]),
    (["python", "-m", "torch.distributed.run", "train.py"], "ours", ["train.py"]),
    # another environment's torchrun or Python: its own packages and torch, as given
    (["/opt/venv/bin/torchrun", "train.py"], "other", None),
    (["python3.12", "-m", "torch.distributed.run", "t.py"], "other", None),
    (["torchrun", "train.py"], "missing", None),
    # not torchrun itself: as given (a shell that calls torchrun cannot be rewritten)
    (["sh", "-c", "pip install x && exec torchrun train.py"], "ours", None),
    (["python", "train.py"], "ours", None),
    (["python", "-m", "torch.distributed.launch", "train.py"], "ours", None),
])
def test_a_users_torchrun_of_this_environment_runs_as_the_counting_agent(tmp_path, cmd, found, runs_as_agent):
    from ddpjob_trainer.launch.node import AGENT, counted
    python = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "python3")
    paths = {"ours": {"torchrun": _bin(tmp_path, "a", sys.executable), "python": python},
             "ours-env": {"torchrun": _bin(tmp_path, "b", "/usr/bin/env python3"), "python3": python},
             "other": {"/opt/venv/bin/torchrun": _bin(tmp_path, "opt/venv", "/opt/venv/bin/python"),
                       "python3.12": "/opt/venv/bin/python3.12"},
             "missing": {}}[found]
    assert counted(cmd, which=paths.get) == ([*AGENT, *runs_as_agent] if runs_as_agent is not None else cmd)
