"""Telemetry: multiprocess exposition over all local ranks, the user API, no per-step allocation.

Each case runs in a fresh interpreter: prometheus_client's multiprocess mode is process-global.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import types
import urllib.request

import pytest

from ddpjob_operator.decisions.samples import parse_metrics
from ddpjob_trainer.telemetry import DeviceTimer, gpu_uuid


def run_py(code: str, *, metrics_dir=None, extra_env=None, timeout=120) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "DDPJOB_METRICS_DIR")}
    if metrics_dir:
        env["DDPJOB_METRICS_DIR"] = str(metrics_dir)
    env.update(extra_env or {})
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_SCRIPT = """
    import os
    from ddpjob_trainer.telemetry import Telemetry
    t = Telemetry.from_env()
    t.set_total_steps(100)
    for i in range(1, 6):
        t.step(step=i, epoch=0, loss=1.0 / i, samples=8, step_seconds=0.01, data_wait_seconds=0.001,
               timestamp=1e9 + i)
"""


def test_one_endpoint_serves_every_local_rank(tmp_path):
    mp = tmp_path / "mp"
    for local in (0, 1):
        run_py(RANK_SCRIPT, metrics_dir=mp, extra_env={
            "RANK": str(2 + local), "LOCAL_RANK": str(local), "NODE_RANK": "1",
            "DDPJOB_NAME": "demo", "DDPJOB_NAMESPACE": "team"})
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from ddpjob_trainer.telemetry import serve_node_endpoint
        serve_node_endpoint({port}, {str(mp)!r}, addr="127.0.0.1")
        print("ready", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.kill()
        server.wait(timeout=10)
    got = parse_metrics(text)
    assert sorted(got) == [2, 3]
    for s in got.values():
        assert (s.step, s.total_steps, s.node_rank, s.ddpjob, s.namespace) == (5, 100, 1, "demo", "team")
        assert s.loss == 0.2 and s.samples_total == 40 and s.step_seconds_count == 5
    # labels the dashboards select on, and never a label called "job"
    assert 'ddpjob_trainer_step{ddpjob="demo",local_rank="1",namespace="team",node_rank="1",rank="3"} 5.0' in text
    assert ' job="' not in text and '{job="' not in text


def test_disabled_writes_nothing(tmp_path):
    mp = tmp_path / "mp"
    run_py(RANK_SCRIPT, metrics_dir=mp, extra_env={"DDPJOB_TELEMETRY": "0"})
    assert not mp.exists() or not list(mp.iterdir())


def test_env_set_after_prometheus_import_still_reaches_the_dir(tmp_path):
    mp = tmp_path / "mp"
    run_py(f"""
        import os, prometheus_client
        os.environ["DDPJOB_METRICS_DIR"] = {str(mp)!r}
        from ddpjob_trainer.telemetry import Telemetry
        Telemetry.from_env().set_total_steps(3)
    """)
    assert any(p.name.startswith("gauge_mostrecent") for p in mp.iterdir())


def test_step_allocates_nothing_that_stays(tmp_path):
    out = run_py("""
        import tracemalloc, gc
        from ddpjob_trainer.telemetry import Telemetry
        t = Telemetry.from_env()
        def steps(n, start):
            for i in range(start, start + n):
                t.step(step=i, epoch=0, loss=0.5, samples=32, step_seconds=0.01,
                       data_wait_seconds=0.001, timestamp=1e9 + i)
        steps(100, 0)                         # warm-up: the mmap entries and label children exist
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        steps(20000, 100)
        gc.collect()
        after = tracemalloc.take_snapshot()
        grown = sum(s.size_diff for s in after.compare_to(before, "filename") if s.size_diff > 0)
        print(grown)
    """, metrics_dir=tmp_path / "mp")
    # 20 000 steps: anything kept per step would be >= 20 000 x 16 bytes; allow tracemalloc's own noise.
    assert int(out.strip()) < 20_000


def test_track_api_reports_steps_loss_and_samples(tmp_path):
    mp = tmp_path / "mp"
    run_py("""
        from ddpjob_trainer import telemetry
        tm = telemetry.Telemetry.from_env()
        tm.set_total_steps(6)
        data = [([0] * 4, [1] * 4)] * 3
        for epoch in range(2):
            for x, y in tm.track(data, epoch=epoch):
                tm.record_loss(0.5 + epoch)
        with tm.timed_step(epoch=2, samples=10) as s:
            s.loss = 0.25
    """, metrics_dir=mp, extra_env={"RANK": "0"})
    text = run_py("""
        import sys
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        reg = CollectorRegistry(); MultiProcessCollector(reg, path=sys.argv[-1])
        print(generate_latest(reg).decode())
    """.replace("sys.argv[-1]", repr(str(mp))))
    s = parse_metrics(text)[0]
    assert (s.step, s.epoch, s.loss, s.samples_total, s.step_seconds_count) == (7, 2, 0.25, 34, 7)
    assert s.step_started == 7


STAGE_SCRIPT = """
    import sys
    from ddpjob_trainer.telemetry import Telemetry
    labels = {"ddpjob": "demo", "namespace": "team", "rank": "1", "local_rank": "0", "node_rank": "1"}
    t = Telemetry(labels=labels)
    for stage in sys.argv[1:]:
        t.set_stage(stage)
"""


def collect(mp) -> str:
    return run_py(f"""
        import sys
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        reg = CollectorRegistry()
        MultiProcessCollector(reg, path={str(mp)!r})
        sys.stdout.write(generate_latest(reg).decode())
    """)


def run_stages(mp, *stages: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR",)}
    env["DDPJOB_METRICS_DIR"] = str(mp)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(STAGE_SCRIPT), *stages], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_stage_set_last_wins_across_processes(tmp_path):
    """The launcher sets rendezvous for a rank it has not started; the rank (another process, same
    dir) moves on: the endpoint shows the rank's stage, one stage at 1, with its start time."""
    mp = tmp_path / "mp"
    run_stages(mp, "waiting_for_master", "rendezvous")          # the launcher
    s = parse_metrics(collect(mp))[1]
    assert s.stage == "rendezvous" and s.step is None and s.stage_started_at > 1.7e9
    before = s.stage_started_at
    run_stages(mp, "process_group_init", "first_step")          # the rank
    text = collect(mp)
    s = parse_metrics(text)[1]
    assert s.stage == "first_step" and s.stage_started_at >= before
    assert text.count('ddpjob_trainer_stage{') == 7 and text.count("} 1.0") >= 1
    assert ('ddpjob_trainer_stage{ddpjob="demo",local_rank="0",namespace="team",node_rank="1",rank="1",'
            'stage="rendezvous"} 0.0') in text


def test_first_step_ends_start_up_and_unknown_stages_are_refused(tmp_path):
    out = run_py("""
        from ddpjob_trainer.telemetry import Telemetry
        t = Telemetry.from_env()
        for x in t.track([[1, 2]]):
            print("during", t.stage)
        print("after", t.stage)
        try:
            t.set_stage("warmup")
        except ValueError as e:
            print(e)
    """, metrics_dir=tmp_path / "mp")
    assert out.splitlines()[:2] == ["during first_step", "after training"]
    assert "unknown stage 'warmup'" in out


def test_launcher_serves_waiting_for_master_while_it_waits(tmp_path):
    """A worker node whose master never answers: its endpoint already names the stage its ranks
    (not yet started) are stuck in, under the labels they will have (rank = node rank x nproc + local)."""
    port, master = free_port(), free_port()        # nothing listens on `master`
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPJOB_", "PROMETHEUS_"))}
    env.update(NODE_RANK="1", NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
               DDPJOB_NAME="demo", DDPJOB_NAMESPACE="team", DDPJOB_METRICS_DIR=str(tmp_path / "mp"))
    launcher = subprocess.Popen([sys.executable, "-m", "ddpjob_trainer.launch", "--metrics-port", str(port),
                                 "--master-timeout", "60", "--", "true"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        text = ""
        for _ in range(200):
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                break
            except OSError:
                if launcher.poll() is not None:
                    raise AssertionError(launcher.stderr.read()) from None
                time.sleep(0.1)
    finally:
        launcher.terminate()
        launcher.wait(timeout=30)
    got = parse_metrics(text)
    assert sorted(got) == [2, 3], text
    assert {(s.stage, s.node_rank, s.local_rank) for s in got.values()} == {
        ("waiting_for_master", 1, 0), ("waiting_for_master", 1, 1)}
    assert all(s.step is None and s.stage_started_at > 1.7e9 for s in got.values())


# ---- device (GPU) time and identity: the device faked, the code path real -------------------------
class FakeClock:
    """The device's timeline: kernels advance it; an event records where the stream is."""

    def __init__(self):
        self.ms = 0.0
        self.made = 0
        self.synced = []


class FakeEvent:
    """torch.cuda.Event's timing API over FakeClock (elapsed_time in ms, like CUDA's)."""

    def __init__(self, clock):
        self.clock, self.at = clock, None
        clock.made += 1

    def record(self):
        self.at = self.clock.ms

    def synchronize(self):
        self.clock.synced.append(self.at)

    def elapsed_time(self, end):
        assert self.at is not None and end.at is not None, "event read before it was recorded"
        return end.at - self.at


@pytest.mark.parametrize("steps, expected", [
    ([], []),                                           # nothing timed: nothing to report
    ([[5.0]], [0.005]),                                 # one step, one forward of 5 ms
    ([[5.0], [7.0], [9.0]], [0.005, 0.007, 0.009]),     # one value per step of the log interval
    ([[2.0, 3.0, 4.0]], [0.009]),                       # grad accumulation: a step's micro-batches summed
])
def test_device_timer_reports_each_steps_forward_time(steps, expected):
    clock = FakeClock()
    timer = DeviceTimer(lambda: FakeEvent(clock))
    for micro in steps:
        for ms in micro:
            timer.start()
            clock.ms += ms            # the forward's kernels
            timer.stop()
            clock.ms += 100.0         # backward and optimizer: not forward time
        timer.end_step()
    assert timer.read() == pytest.approx(expected)
    assert timer.read() == []         # read once
    assert clock.synced == ([clock.ms - 100.0] if steps else [])   # one wait, on the last event


def test_device_timer_reuses_its_events_across_log_intervals():
    clock = FakeClock()
    timer = DeviceTimer(lambda: FakeEvent(clock))
    for _ in range(50):               # 50 log intervals of 4 steps
        for _ in range(4):
            timer.start(); clock.ms += 1.0; timer.stop(); timer.end_step()
        assert timer.read() == pytest.approx([0.001] * 4)
    assert clock.made == 8            # two per step of one interval, not two per step of the run


def test_cpu_gets_a_timer_that_records_nothing():
    timer = DeviceTimer.for_device(types.SimpleNamespace(type="cpu"))
    timer.start(); timer.stop(); timer.end_step()
    assert timer.read() == []


def test_gpu_uuid_spelled_as_dcgm_labels_it():
    assert gpu_uuid(types.SimpleNamespace(uuid="6ab5c5d2-0f4c-1b2e-9c3d-112233445566")) == \
        "GPU-6ab5c5d2-0f4c-1b2e-9c3d-112233445566"
    assert gpu_uuid(types.SimpleNamespace(uuid="MIG-1f2e")) == "MIG-1f2e"


GPU_SCRIPT = """
    import types
    from ddpjob_trainer.telemetry import Telemetry
    t = Telemetry.from_env()
    props = types.SimpleNamespace(uuid="0a1b2c3d-0000-1111-2222-333344445555", name="NVIDIA H100 80GB HBM3")
    cuda = types.SimpleNamespace(get_device_properties=lambda d: props)   # torch.cuda stand-in
    t.gpu_info(types.SimpleNamespace(cuda=cuda), types.SimpleNamespace(type="cuda"))
    t.gpu_info(types.SimpleNamespace(cuda=cuda), types.SimpleNamespace(type="cpu"))  # CPU: nothing
    for i in range(1, 5):
        t.step(step=i, epoch=0, loss=None, samples=8, step_seconds=0.01, data_wait_seconds=0.0,
               timestamp=1e9 + i)
    t.compute([0.02, 0.03, 0.04, 0.03])     # a log step reads four steps' device time
"""


def test_gpu_identity_and_device_time_reach_the_operator(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    mp = tmp_path / "mp"
    run_py(GPU_SCRIPT, metrics_dir=mp, extra_env={"RANK": "1", "LOCAL_RANK": "1"})
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(mp))
    text = generate_latest(reg).decode()
    assert ('ddpjob_trainer_gpu_info{ddpjob="local",local_rank="1",name="NVIDIA H100 80GB HBM3",'
            'namespace="",node_rank="0",rank="1",uuid="GPU-0a1b2c3d-0000-1111-2222-333344445555"} 1.0') in text
    s = parse_metrics(text)[1]
    assert (s.compute_seconds_count, s.step_seconds_count) == (4, 4)
    assert s.compute_seconds_sum == pytest.approx(0.12)


def test_cpu_run_exports_no_device_series(tmp_path):
    mp = tmp_path / "mp"
    run_py(RANK_SCRIPT, metrics_dir=mp)
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(mp))
    text = generate_latest(reg).decode()
    assert "gpu_info{" not in text and "compute_seconds_count{" not in text


GOODPUT_WORKER = """
    import os
    from ddpjob_trainer.telemetry import Telemetry
    T = 1e9
    t = Telemetry.from_env()
    first, last, base = (1, 5, T) if os.environ.get("DDPJOB_RESTART") != "1" else (4, 6, T + 100)
    t.set_stage("process_group_init", timestamp=base + 2)
    for i in range(first, last + 1):  # 1 s steps, the first ending 10 s after the start
        t.step(step=i, epoch=0, loss=1.0, samples=8, step_seconds=1.0, data_wait_seconds=0.0,
               timestamp=base + 10 + i - first)
    t.set_stage("eval", timestamp=base + 20)
    t.set_stage("training", timestamp=base + 22)
    t.set_stage("checkpoint", timestamp=base + 23)
    t.set_stage("training", timestamp=base + 26)
    if os.environ.get("STALL"):  # the pod's agent killed the worker for a stall
        import types
        from ddpjob_trainer.agent import Hooks
        Hooks().on_failure(None, None, {0: types.SimpleNamespace(exitcode=-9, local_rank=0, signal_name=lambda: "SIGKILL")}, True)
"""


def test_a_ranks_time_by_category_across_its_worker_restarts(tmp_path):
    """A rank's first worker starts (its node's launcher at T), steps 1-5, evaluates and checkpoints;
    the agent kills it for a stall (31 s without progress); the restarted worker, told the failure
    (T+100) and the step reached (5), resumes from 3: steps 4 and 5 are done again, 6 is new."""
    mp = tmp_path / "mp"
    status = tmp_path / "status"
    status.mkdir()
    (status / "failed-rank-0.txt").write_text("stalled: no progress for 31s in training after step 5 (hang timeout 30s)\n")
    env = {"RANK": "0", "LOCAL_RANK": "0", "NODE_RANK": "0", "DDPJOB_NAME": "g"}
    run_py(GOODPUT_WORKER, metrics_dir=mp, extra_env={**env, "DDPJOB_NODE_STARTED": "1000000000", "STALL": "1",
                                                       "DDPJOB_STATUS_DIR": str(status)})
    run_py(GOODPUT_WORKER, metrics_dir=mp, extra_env={**env, "DDPJOB_RESTART": "1", "DDPJOB_FAILED_AT": "1000000100",
                                                       "DDPJOB_STEP_REACHED": "5", "DDPJOB_NODE_STARTED": "1000000000"})
    expected = {"starting": 9.0, "training": 6.0, "recomputing": 2.0, "recovering": 9.0, "evaluating": 4.0,
                "checkpointing": 6.0, "stalled": 31.0}
    from ddpjob_trainer.telemetry import rank_goodput
    assert rank_goodput(str(mp), 0) == expected
    text = run_py("""
        import os, sys
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        reg = CollectorRegistry(); MultiProcessCollector(reg, path=os.environ["DDPJOB_METRICS_DIR"])
        sys.stdout.write(generate_latest(reg).decode())
    """, metrics_dir=mp)
    assert parse_metrics(text)[0].goodput == expected
