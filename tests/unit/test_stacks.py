"""Every rank's stack at a hang or a failure (issue 47): the dump a worker registers, what the
agent captures and exports, which rank the operator blames, and what it keeps (bounded, redacted)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from ddpjob_trainer import stacks
from ddpjob_api import contract
from ddpjob_trainer.agent import Hooks, failed_at

from ddpjob_operator.decisions import inplace, stacks as blame
from ddpjob_operator.decisions.health import HealthTracker
from ddpjob_api.phases import Signal
from ddpjob_operator.decisions.samples import RankSample, parse_metrics
from tests.support.localrun import free_ports

# A worker, as the exit guard's sitecustomize starts one: its dump registered, blocked in a function.
WORKER = """
import os, sys, threading, time
from ddpjob_trainer import stacks
assert stacks.install()
def wait_for_the_loader():
    print("ready", flush=True)  # from here: a capture cannot come before the call
    time.sleep(600)
threading.Thread(target=lambda: time.sleep(600), daemon=True).start()
wait_for_the_loader()
"""


def _worker(folder, *, rank: int = 1, register: bool = True) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), contract.ENV_STACKS_DIR: str(folder) if register else ""}
    proc = subprocess.Popen([sys.executable, "-c", WORKER if register else WORKER.replace("assert stacks.install()", "")],
                            env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_registered_worker_dumps_every_thread_and_its_main_threads_frames_are_found(tmp_path):
    proc = _worker(tmp_path)
    try:
        # A bound no loaded machine reaches: this test is about what is captured, not how fast.
        (text,) = stacks.capture({1: proc.pid}, str(tmp_path), seconds=60).values()
        assert len(stacks.threads(text)) == 2, text          # the main thread and the other one
        frames = stacks.main_frames(text)
        assert [f.func for f in frames[:2]] == ["wait_for_the_loader", "<module>"], text
        waiting, shown = stacks.summary(text)  # in the function, at its print or its sleep
        assert waiting == "" and re.fullmatch(r"<string>:[67] wait_for_the_loader < <string>:9 <module>", shown), shown
        # Captured again: only the new dump (the file keeps the older ones after the header).
        (again,) = stacks.capture({1: proc.pid}, str(tmp_path), seconds=60).values()
        assert again.count("wait_for_the_loader") == 1 and again.startswith("ddpjob stacks: rank 1 ")
        assert proc.poll() is None
    finally:
        proc.kill()


def test_a_process_without_the_dump_is_never_signalled(tmp_path):
    """The signal's default action would end it: a worker that did not register (or replaced the
    handler) is named, not killed."""
    proc = _worker(tmp_path, register=False)
    try:
        (tmp_path / f"{proc.pid}.txt").write_text("")
        assert not stacks.handles(proc.pid)
        (text,) = stacks.capture({1: proc.pid}, str(tmp_path)).values()
        assert text.startswith(f"(no stack: pid {proc.pid} has no dump registered on SIGUSR2)")
        time.sleep(0.2)
        assert proc.poll() is None
    finally:
        proc.kill()


FRAMES = {
    "backward": [("/usr/lib/python3/site-packages/torch/autograd/graph.py", "_engine_run_backward"),
                 ("/usr/lib/python3/site-packages/torch/autograd/__init__.py", "backward"),
                 ("/usr/lib/python3/site-packages/torch/_tensor.py", "backward"),
                 ("/app/ddpjob_trainer/loop.py", "train_step")],
    "all_reduce": [("/x/torch/distributed/distributed_c10d.py", "all_reduce"),
                   ("/x/torch/distributed/c10d_logger.py", "wrapper"),
                   ("/app/ddpjob_trainer/collectives.py", "mean")],
    "DistributedDataParallel.forward": [("/x/torch/nn/parallel/distributed.py", "_pre_forward"),
                                        ("/x/torch/nn/parallel/distributed.py", "forward"),
                                        ("/x/torch/nn/modules/module.py", "_call_impl"),
                                        ("/app/ddpjob_trainer/loop.py", "forward")],
    "": [("/app/ddpjob_trainer/debug.py", "_block_in_fetch"), ("/app/ddpjob_trainer/debug.py", "before_fetch"),
         ("/x/torch/distributed/distributed_c10d.py", "barrier")],   # a collective further out is not waited in
}


@pytest.mark.parametrize("expected", list(FRAMES))
def test_which_collective_a_stack_waits_in(expected):
    frames = [stacks.Frame(file, i + 10, func) for i, (file, func) in enumerate(FRAMES[expected])]
    assert stacks.waiting_in(frames) == expected


def test_a_captures_frames_are_bounded():
    deep = "ddpjob stacks: rank 0 pid 1 main thread 0x0000000000000001\nCurrent thread 0x0000000000000001 (most recent call first):\n" + \
        "".join(f'  File "/{"d" * 200}/f.py", line {i} in {"g" * 100}\n' for i in range(50))
    waiting, frames = stacks.summary(deep)
    assert waiting == "" and len(frames) == contract.STACK_FRAMES_CHARS


# ---- the agent ---------------------------------------------------------------------------------

def test_a_failure_is_dated_by_its_record_not_by_when_its_agent_saw_it(tmp_path):
    """A crashing rank records its error as it raises; its peer fails in the collective only after
    it, whichever exit its agent saw first."""
    (tmp_path / "failed-rank-1.txt").write_text("rank 1 failed:\nRuntimeError: boom\n")
    os.utime(tmp_path / "failed-rank-1.txt", (1000.0, 1000.0))
    assert failed_at(str(tmp_path), 1, seen=1004.0) == 1000.0
    assert failed_at(str(tmp_path), 0, seen=1003.0) == 1003.0      # no record: when it was seen
    assert failed_at(None, 1, seen=1003.0) == 1003.0


def test_the_agent_keeps_each_capture_exports_it_and_the_pods_endpoint_serves_it(tmp_path):
    from ddpjob_trainer.telemetry import serve_node_endpoint

    folder, metrics = tmp_path / "stacks", tmp_path / "metrics"
    proc = _worker(folder)
    env = {contract.ENV_STACKS_DIR: str(folder), contract.ENV_METRICS_DIR: str(metrics), contract.ENV_ATTEMPT: "2",
           contract.ENV_JOB_NAME: "j", "NODE_RANK": "1",
           contract.ENV_TRAINER_CONFIG: json.dumps({"checkpoint": {"dir": str(tmp_path / "ckpt")}})}
    code = ("import json, os, sys\nfrom ddpjob_trainer.agent import Hooks\n"
            f"h = Hooks({env!r})\nh.starts = 1\nh.capture({{1: {proc.pid}}}, 'stall')\n")
    try:
        # The agent's own process (prometheus_client's multiprocess mode is chosen per process).
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **env})
    finally:
        proc.kill()
    # A worker creating its metric file as the pod is scraped (telemetry.metric_files): served all
    # the same, not an error.
    (metrics / "counter_4242.db").write_bytes(b"")
    port = free_ports(1)[0]
    server = serve_node_endpoint(port, str(metrics), addr="127.0.0.1", stacks_dir=str(folder))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            (sample,) = parse_metrics(r.read().decode()).values()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{contract.STACKS_PATH}", timeout=5) as r:
            (record,) = json.loads(r.read())
    finally:
        server.shutdown()
        server.server_close()
    (series,) = sample.stack_captures
    assert (sample.rank, series["restart"], series["trigger"], series["waiting"]) == (1, "0", "stall", "")
    assert re.match(r"<string>:[67] wait_for_the_loader", series["frames"]), series
    assert (record["attempt"], record["rank"], record["trigger"], record["time"]) == ("2", 1, "stall", series["time"])
    assert "wait_for_the_loader" in record["text"]
    # Beside the checkpoints too, where the NCCL flight recorder dumps (contract.debug_dir).
    (beside,) = (tmp_path / "ckpt" / "debug" / "attempt-2").glob("stacks-restart-0-rank-1-stall-*.txt")
    assert beside.read_text().startswith("=== rank 1 (node rank 1), attempt 2 restart 0: stall capture at ")


def test_hooks_without_a_stacks_folder_capture_nothing():
    Hooks({}).capture({1: os.getpid()}, "stall")  # no folder: no signal to anyone (this test lives)


# ---- the operator: who is blamed ---------------------------------------------------------------

def capture(t: float, *, waiting: str = "", frames: str = "f.py:1 g", restart: int = 0, trigger: str = "idle") -> dict:
    return {"restart": str(restart), "trigger": trigger, "waiting": waiting, "frames": frames, "time": t}


def rank(r: int, *captures: dict, step_at: float = 100.0, **kw) -> RankSample:
    return RankSample(rank=r, step=5, last_step_timestamp=step_at, pod=f"j-{r}", node=f"n{r}",
                      stack_captures=list(captures), **kw)


@pytest.mark.parametrize("waits, blamed, collective", [
    ({0: "backward", 1: ""}, (1,), "backward"),                        # the case
    ({0: "backward", 1: "backward", 2: "", 3: "backward"}, (2,), "backward"),
    ({0: "all_reduce", 1: "all_reduce", 2: "barrier", 3: ""}, (3,), "all_reduce"),
    ({0: "backward", 1: "backward"}, None, None),                      # all in one: a hang inside it, no one blamed
    ({0: "", 1: ""}, None, None),                                      # none in one: nothing to compare
    ({1: ""}, None, None),                                             # one rank tells nothing
])
def test_the_culprit_is_the_rank_not_in_the_collective_the_others_wait_in(waits, blamed, collective):
    found = blame.culprit({r: capture(1.0, waiting=w) for r, w in waits.items()})
    assert (found.ranks, found.waiting_in) == (blamed, collective) if blamed else found is None


def test_a_stall_is_judged_by_the_captures_since_the_jobs_last_progress():
    old = capture(50.0, waiting="backward")   # before the last step: another spell
    ranks = {0: rank(0, capture(150.0, waiting="backward")), 1: rank(1, old, capture(160.0, frames="debug.py:9 _block"))}
    found = blame.of_stall(ranks)
    assert found.ranks == (1,) and found.frames == "debug.py:9 _block"
    assert blame.of_stall({0: rank(0, capture(150.0, waiting="backward")), 1: rank(1, old)}) is None


def test_a_restarts_culprit_is_read_from_the_captures_of_the_start_that_failed():
    ranks = {0: rank(0, capture(150.0, waiting="backward", restart=0), capture(400.0, restart=1)),
             1: rank(1, capture(170.0, restart=0, trigger="stall"))}
    assert blame.of_restart(ranks, restart=0, failed_at=171.0, window=60).ranks == (1,)
    assert blame.of_restart(ranks, restart=0, failed_at=500.0, window=60) is None   # too old to tell


def test_a_restart_entry_names_the_stacks_culprit_and_its_frames():
    stall = "stalled: no progress for 61s in training after step 5 (hang timeout 60s)"
    ranks = {0: rank(0, capture(150.0, waiting="backward")),
             1: rank(1, capture(170.0, frames="debug.py:129 _block_in_fetch", trigger="stall"),
                     worker_failures=[{"restart": "0", "exit_code": "-9", "signal": "SIGKILL", "error": stall,
                                       "restarted": "true", "time": 171.0, "step": "5"}])}
    import datetime as dt
    up = inplace.update({}, attempt=0, ranks=ranks, with_log=False, group=None,
                        now=dt.datetime.now(dt.timezone.utc), window=60)
    (entry,) = up.history
    assert entry["culprit"] == {"rank": 1, "pod": "j-1", "node": "n1", "frames": "debug.py:129 _block_in_fetch",
                                "waitingIn": "backward"}
    assert inplace.describe(entry).endswith(
        "; stacks: rank 1 (pod j-1 on node n1) is not in the backward its peers wait in: at debug.py:129 _block_in_fetch")


def test_a_restart_seen_with_its_recovery_in_one_scrape_still_names_the_culprit():
    """A fast in-place restart: the failure, the captures before it and every rank's next step
    all arrive in the first scrape after it (stop 56's rehearsal: the entry closed uncharged by
    its culprit)."""
    stall = "stalled: no progress for 61s in training after step 5 (hang timeout 60s)"
    ranks = {0: rank(0, capture(150.0, waiting="backward"), first_step_timestamp=175.0, resumed_from_step=4),
             1: rank(1, capture(170.0, frames="debug.py:129 _block_in_fetch", trigger="stall"),
                     first_step_timestamp=174.0, resumed_from_step=4,
                     worker_failures=[{"restart": "0", "exit_code": "-9", "signal": "SIGKILL", "error": stall,
                                       "restarted": "true", "time": 171.0, "step": "5"}])}
    import datetime as dt
    up = inplace.update({}, attempt=0, ranks=ranks, with_log=False, group=None,
                        now=dt.datetime.now(dt.timezone.utc), window=60)
    (entry,) = up.history
    assert entry["recoverySeconds"] == 4.0 and entry["culprit"]["rank"] == 1, entry


def test_a_stall_its_agent_killed_is_stalled_naming_the_culprit_and_its_frame():
    """The agent kills at its own timeout, usually before the operator's, and the restart is
    progress: the kill itself says the job stalled, and who was at fault."""
    stall = "stalled: no progress for 61s in training after step 5 (hang timeout 60s)"
    h = HealthTracker(hang_timeout=60)
    assert h.update({0: rank(0), 1: rank(1)}, now=100.0) == []
    killed = {0: rank(0, capture(120.0, waiting="backward")),
              1: rank(1, capture(130.0, frames="debug.py:129 _block_in_fetch", trigger="stall"),
                      worker_failures=[{"restart": "0", "exit_code": "-9", "signal": "SIGKILL", "error": stall,
                                        "restarted": "true", "time": 131.0, "step": "5"}])}
    (found,) = h.update(killed, now=162.0 - 30)   # the operator's own timeout (from its first sight) not reached
    assert (found.kind, found.active, found.reason, found.ranks) == (Signal.STALLED, True, "StalledRankRestarted", (1,))
    assert found.message.startswith(f"rank 1 (pod j-1 on node n1) {stall}: its agent killed the worker")
    assert found.message.endswith("stacks: rank 1 (pod j-1 on node n1) is not in the backward its peers wait in: "
                                  "at debug.py:129 _block_in_fetch")
    assert h.update(killed, now=163.0 - 30) == []               # said once
    moved = {0: rank(0, step_at=170.0), 1: rank(1, step_at=170.0)}
    moved[0].step = moved[1].step = 6
    assert [(f.kind, f.active) for f in h.update(moved, now=171.0 - 30)] == [(Signal.STALLED, False)]


def test_a_rank_short_of_the_checkpoint_the_others_wait_in_is_named_first():
    """The issue's run: rank 1 frozen in training, rank 0 waiting in the checkpoint's collective."""
    h = HealthTracker(hang_timeout=30)
    ranks = {0: RankSample(rank=0, step=30, last_step_timestamp=995.0, stage="checkpoint", stage_started_at=1000.0,
                           pod="j-0", node="n0"),
             1: RankSample(rank=1, step=30, last_step_timestamp=995.0, stage="training", stage_started_at=900.0,
                           pod="j-1", node="n1")}
    h.update(ranks, now=1000.0)
    (found,) = h.update(ranks, now=1031.0)
    assert found.ranks == (1,), found
    assert found.message == ("stuck in checkpoint after step 30 for 31s (hangTimeoutSeconds 30): rank 1 (pod j-1 on "
                             "node n1) in training; other ranks: rank 0 (pod j-0 on node n0) in checkpoint")


@pytest.mark.parametrize("labels", [
    'trigger="idle",waiting="backward; rm -rf",frames="x",restart="0"',       # not a function's name
    'trigger="whenever",waiting="",frames="x",restart="0"',                 # not a trigger
    f'trigger="idle",waiting="",frames="{"x" * 301}",restart="0"',          # past the bound
    'trigger="idle",waiting="",frames="x",restart="-1"',
])
def test_a_capture_series_that_is_not_an_agents_is_dropped(labels):
    text = f'ddpjob_trainer_{contract.STACK_CAPTURE}{{rank="1",{labels}}} 1.7e9\n'
    assert not parse_metrics(text).get(1, RankSample(rank=1)).stack_captures


# ---- the operator: what is kept ----------------------------------------------------------------

def record(rank: int, t: float, text: str = "Thread 0x1 (most recent call first):\n  File \"a.py\", line 1 in f\n",
           **kw) -> dict:
    return {"attempt": "0", "restart": "0", "rank": rank, "trigger": "stall", "time": t, "waiting": "", "text": text, **kw}


def test_kept_captures_are_redacted_bounded_and_the_oldest_go_first():
    secret = 'File "https://user:hunter2@host/x.py", line 1 in f  token=ghp_' + "a" * 30
    data = blame.merged({"unrelated": "x"}, [(record(1, 100.0, text=secret), "j-1", "n1"),
                                             (record(0, 101.0, text="y" * 40000), "j-0", None)])
    assert "unrelated" not in data and len(data) == 2
    (one,) = [v for k, v in data.items() if ".rank-1." in k]
    assert "hunter2" not in one and "ghp_" not in one and one.startswith("=== rank 1 (pod j-1 on node n1), attempt 0 ")
    (big,) = [v for k, v in data.items() if ".rank-0." in k]
    assert len(big.encode()) < contract.STACK_TEXT_BYTES + 100 and big.endswith("(cut at 16384 bytes)\n")
    assert blame.merged(data, [(record(1, 100.0, text="changed"), "j-1", "n1")]) == data   # the same capture once
    many = blame.merged({}, [(record(r % 4, float(r), text="z" * 15000), "p", None) for r in range(60)])
    assert sum(len(k) + len(v.encode()) for k, v in many.items()) <= blame.KEPT_BYTES
    kept_times = sorted(int(k.rsplit(".", 1)[1]) for k in many)
    assert kept_times[-1] == 59000 and kept_times[0] > 0          # the newest kept, the oldest dropped


def test_an_attempts_captures_are_read_back_in_order():
    data = blame.merged({}, [(record(1, 200.0), "j-1", None), (record(0, 100.0), "j-0", None),
                             (record(0, 300.0, attempt="1"), "j-0-a1", None)])
    assert [k for k, _ in blame.of_attempt(data, 0)] == [(0, 0, 100000, 0), (0, 0, 200000, 1)]
    assert [k[0] for k, _ in blame.of_attempt(data, None)] == [0, 0, 1]
