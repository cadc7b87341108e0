"""parse_metrics against exposition text produced by the real telemetry + multiprocess collector."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ddpjob_operator.decisions.samples import RankSample, parse_metrics

# Runs in a subprocess: multiprocess mode is process-global in prometheus_client.
_PRODUCER = textwrap.dedent("""
    import json, os, sys
    from ddpjob_trainer.telemetry import Telemetry
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    ranks = json.loads(sys.argv[1])
    for r in ranks:
        t = Telemetry(labels={"ddpjob": "demo", "namespace": "ns1", "rank": str(r["rank"]),
                              "local_rank": str(r["rank"] % 2), "node_rank": str(r["rank"] // 2)})
        t.set_total_steps(r["total"])
        t.set_restart_count(1)
        for i in range(r["steps"]):
            t.step_started(step=i + 1)
            t.step(step=i + 1, epoch=0, loss=r["loss"], samples=32, step_seconds=0.5,
                   data_wait_seconds=0.1, timestamp=1000.0 + i)
        if r.get("acc") is not None:
            t.eval(accuracy=r["acc"], loss=0.25)
        t.checkpoint(1.5)
        if r.get("gpu"):  # no GPU here: a stand-in for torch.cuda's three memory counters
            import types
            cuda = types.SimpleNamespace(memory_allocated=lambda d: 1e9, max_memory_allocated=lambda d: 2e9,
                                         memory_reserved=lambda d: 3e9)
            t.gpu_memory(types.SimpleNamespace(cuda=cuda), types.SimpleNamespace(type="cuda"))
            t.compute([0.2] * r["steps"])   # DeviceTimer.read() at a log step
        t.set_stage("training")
        t.resumed_from(r.get("resumed", 0))
        if r.get("failure"):  # the pod's torchrun agent (ddpjob_trainer.agent) saw this rank's worker die
            import types
            from ddpjob_trainer.agent import Hooks
            code, sig = r["failure"]
            Hooks().on_failure(None, None, {r["rank"]: types.SimpleNamespace(
                exitcode=code, local_rank=r["rank"] % 2, signal_name=lambda: sig)}, True)
        if r.get("mlflow"):
            t.mlflow_run(*r["mlflow"])
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=os.environ["DDPJOB_METRICS_DIR"])
    sys.stdout.write(generate_latest(reg).decode())
""")


def exposition(tmp_path, ranks: list[dict]) -> str:
    """Exposition text of a node endpoint whose ranks recorded `ranks` (real prometheus_client)."""
    env = dict(os.environ, DDPJOB_METRICS_DIR=str(tmp_path / "mp"))
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    out = subprocess.run([sys.executable, "-c", _PRODUCER, json.dumps(ranks)], env=env,
                         check=True, capture_output=True, text=True, timeout=120)
    return out.stdout


def test_parse_two_ranks_from_real_exposition(tmp_path):
    text = exposition(tmp_path, [
        {"rank": 0, "steps": 3, "total": 10, "loss": 1.5, "acc": 0.9, "mlflow": ["0a1b2c3d4e5f60718293a4b5c6d7e8f9", "7"]},
        {"rank": 1, "steps": 4, "total": 10, "loss": 0.5},
    ])
    got = parse_metrics(text)
    assert sorted(got) == [0, 1]
    r0, r1 = got[0], got[1]
    assert (r0.step, r1.step) == (3, 4)
    assert r1.step_started == 4
    assert r0.total_steps == 10 and r0.epoch == 0
    assert r0.loss == 1.5 and r1.loss == 0.5
    assert r0.samples_total == 96 and r1.samples_total == 128
    assert r0.step_seconds_count == 3 and r0.step_seconds_sum == pytest.approx(1.5)
    assert r1.data_wait_seconds_total == pytest.approx(0.4)
    assert r1.last_step_timestamp == 1003.0
    assert r0.eval_accuracy == 0.9 and r0.eval_loss == 0.25 and r1.eval_accuracy is None
    assert r0.checkpoint_seconds == 1.5 and r0.restart_count == 1
    assert (r1.local_rank, r1.node_rank, r1.ddpjob, r1.namespace) == (1, 0, "demo", "ns1")
    assert (r0.mlflow_run_id, r0.mlflow_experiment_id) == ("0a1b2c3d4e5f60718293a4b5c6d7e8f9", "7")
    assert r1.mlflow_run_id is None


def test_a_worker_failure_the_agent_exports_is_read_with_its_rank_and_time(tmp_path):
    text = exposition(tmp_path, [{"rank": 0, "steps": 3, "total": 4, "loss": 1.0},
                                 {"rank": 1, "steps": 2, "total": 4, "loss": 1.0, "failure": [-9, "SIGKILL"],
                                  "resumed": 10}])
    got = parse_metrics(text)
    assert got[0].worker_failures == [] and got[1].resumed_from_step == 10
    (f,) = got[1].worker_failures
    assert {k: f[k] for k in ("restart", "exit_code", "signal", "error", "restarted", "step")} == {
        "restart": "0", "exit_code": "-9", "signal": "SIGKILL", "error": "killed by SIGKILL", "restarted": "true",
        "step": "2"}  # the failed rank's last step, not its peer's (3)
    assert f["time"] > 1.7e9  # a Unix time: the operator measures recovery from it


def test_every_metric_the_scraper_reads_is_one_a_rank_writes(tmp_path):
    """The scraper's names and the telemetry's are spelled in two modules: a rename on one side
    would leave a status field empty for good, with no error anywhere."""
    from ddpjob_operator.decisions.samples import _GAUGES, METRIC_PREFIX as PREFIX

    text = exposition(tmp_path, [{"rank": 0, "steps": 2, "total": 4, "loss": 1.0, "acc": 0.5, "gpu": True}])
    written = {line.split("{")[0].split(" ")[0][len(PREFIX):] for line in text.splitlines()
               if line.startswith(PREFIX)}
    assert set(_GAUGES) <= written, set(_GAUGES) - written
    assert "stage" in written
    r0 = parse_metrics(text)[0]
    assert all(getattr(r0, attr) is not None for attr in _GAUGES.values())


@pytest.mark.parametrize("text,expected", [
    ("", {}),
    ("# HELP other_metric x\n# TYPE other_metric gauge\nother_metric 1\n", {}),
    # no rank label -> not a rank's sample
    ('# TYPE ddpjob_trainer_step gauge\nddpjob_trainer_step{ddpjob="a"} 5\n', {}),
    ('# TYPE ddpjob_trainer_step gauge\nddpjob_trainer_step{rank="7",node_rank="3"} 5\n',
     {7: (5, 3)}),
])
def test_parse_edge_cases(text, expected):
    got = parse_metrics(text)
    assert {r: (s.step, s.node_rank) for r, s in got.items()} == expected


@pytest.mark.parametrize("lines,expected", [
    (['stage{rank="0",stage="rendezvous"} 1', 'stage{rank="0",stage="training"} 0',
      'stage_start_timestamp_seconds{rank="0"} 1.7e9'], ("rendezvous", 1.7e9)),
    # only the stage at 1 is the rank's; a name the trainer never uses is dropped (it would reach a
    # condition message), and so is an absurd start time
    (['stage{rank="0",stage="rendezvous"} 0', 'stage{rank="0",stage="<script>"} 1',
      'stage_start_timestamp_seconds{rank="0"} 1e300'], (None, None)),
])
def test_parse_stage(lines, expected):
    text = "".join(f"ddpjob_trainer_{line}\n" for line in lines)
    s = parse_metrics(text)[0]
    assert (s.stage, s.stage_started_at) == expected


@pytest.mark.parametrize("line,expected", [
    ('mlflow_run_info{rank="0",run_id="abc123",experiment_id="4"} 1', ("abc123", "4")),
    ('mlflow_run_info{rank="0",run_id="abc123",experiment_id="4"} 0', (None, None)),
    # The ids reach status and a URL: anything but an id's characters is dropped.
    ('mlflow_run_info{rank="0",run_id="../../evil",experiment_id="4"} 1', (None, None)),
    ('mlflow_run_info{rank="0",run_id="abc",experiment_id="4 <b>"} 1', (None, None)),
    ('mlflow_run_info{rank="0",run_id="",experiment_id="4"} 1', (None, None)),
])
def test_parse_mlflow_run(line, expected):
    s = parse_metrics(f"ddpjob_trainer_{line}\n").get(0) or RankSample(rank=0)
    assert (s.mlflow_run_id, s.mlflow_experiment_id) == expected


# Text-format corners a pod may serve: escapes, braces and commas in values, spaces, a trailing
# comma, a timestamp, non-finite values, no labels, other metrics.
_CORNERS = "\n".join([
    '# HELP ddpjob_trainer_step x',
    'other_metric{rank="0"} 7',
    'ddpjob_trainer_step{rank="0", node_rank="1",} 5 1700000000000',
    'ddpjob_trainer_loss{rank="0",ddpjob="a\\"b\\\\c\\nd{e},f"} NaN',
    'ddpjob_trainer_epoch{rank="1"}\t+Inf',
    'ddpjob_trainer_epoch 3',
    'ddpjob_trainer_worker_failure_timestamp_seconds{rank="1",error="RuntimeError: \\"x\\" } {",step="2"} 1.7e9',
    'ddpjob_trainer_stage{rank="1",stage="training"} 1.0',
    '',
])


def test_the_scrapers_reading_is_prometheus_clients(tmp_path):
    """The scraper reads its samples itself (prometheus_client's parser costs ~15x more): it reads
    what prometheus_client reads (but a stage or MLflow line at 0, which says nothing), on a real
    endpoint and on the corners."""
    from prometheus_client.parser import text_string_to_metric_families

    from ddpjob_operator.decisions.samples import _ONLY_AT_ONE, _READ, METRIC_PREFIX as PREFIX, _samples

    real = exposition(tmp_path, [{"rank": 0, "steps": 2, "total": 4, "loss": 1.0, "acc": 0.5, "gpu": True,
                                  "mlflow": ["abc", "1"]},
                                 {"rank": 1, "steps": 2, "total": 4, "loss": 1.0, "failure": [1, ""]}])
    for text in (real, _CORNERS):
        theirs = [(s.name[len(PREFIX):], s.labels, float(s.value)) for f in text_string_to_metric_families(text)
                  for s in f.samples if s.name.startswith(PREFIX) and s.name[len(PREFIX):] in _READ
                  and (s.value == 1 or s.name[len(PREFIX):] not in _ONLY_AT_ONE)]
        assert len(theirs) >= 6
        assert sorted(map(repr, _samples(text))) == sorted(map(repr, theirs))


@pytest.mark.parametrize("line", ['ddpjob_trainer_step{rank="0"} five', 'ddpjob_trainer_step{rank="0" 5',
                                  'ddpjob_trainer_step{rank=0} 5', 'ddpjob_trainer_step{rank="0"}'])
def test_an_unreadable_trainer_line_is_a_bad_exposition(line):
    with pytest.raises(ValueError):
        parse_metrics(line + "\n")
