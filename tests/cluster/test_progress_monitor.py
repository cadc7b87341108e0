"""Monitor.observe against real HTTP endpoints on loopback (no control plane needed): bounded
scraping where one hung pod does not hold up the others, and conditions/events on transitions."""
from __future__ import annotations

import asyncio
import http.server
import threading

import pytest

from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.cluster.monitor import Monitor, scrape_url


def exposition(step: int, rank: int) -> bytes:
    labels = f'ddpjob="j",namespace="ns",rank="{rank}",local_rank="0",node_rank="{rank}"'
    return (f"# TYPE ddpjob_trainer_step gauge\nddpjob_trainer_step{{{labels}}} {step}\n"
            f"# TYPE ddpjob_trainer_step_started gauge\nddpjob_trainer_step_started{{{labels}}} {step + 1}\n"
            f"# TYPE ddpjob_trainer_total_steps gauge\nddpjob_trainer_total_steps{{{labels}}} 100\n"
            f"# TYPE ddpjob_trainer_loss gauge\nddpjob_trainer_loss{{{labels}}} 0.5\n").encode()


class Endpoint:
    """A loopback /metrics server whose body (or a hang) the test controls."""

    def __init__(self, rank: int):
        self.rank, self.step, self.hang = rank, 10, threading.Event()
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if outer.hang.is_set():
                    outer.release.wait(60)      # a pod that accepts and never answers
                body = exposition(outer.step, outer.rank)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.release = threading.Event()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoints():
    eps = [Endpoint(0), Endpoint(1)]
    yield eps
    for e in eps:
        e.close()


def pod(rank: int, *, phase="Running", attempt=0, deleting=False) -> dict:
    meta = {"name": f"j-{rank}", "labels": {"ddpjob.dev/node-rank": str(rank), "ddpjob.dev/attempt": str(attempt)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": f"node-{rank}"}, "status": {"phase": phase, "podIP": "10.0.0.1"}}


def job(hang: int = 30) -> dict:
    return {"metadata": {"name": "j", "namespace": "ns", "uid": "u1"},
            "spec": {"image": "trainer:dev", "metricsPort": 9400, "hangTimeoutSeconds": hang}}


@pytest.mark.parametrize("template,expected", [
    ("", "http://10.1.2.3:9400/metrics"),
    ("http://127.0.0.1:{rank_port}/metrics", "http://127.0.0.1:9403/metrics"),
    ("http://{pod}.{job}.{namespace}.svc:{port}/m?r={rank}", "http://j-3.j.ns.svc:9400/m?r=3"),
])
def test_scrape_url(template, expected):
    p = pod(3)
    p["status"]["podIP"] = "10.1.2.3"
    p["metadata"]["name"] = "j-3"
    assert scrape_url(template, pod=p, port=9400, job_name="j", namespace="ns") == expected


def test_no_ip_yet_means_no_url():
    p = pod(0)
    p["status"].pop("podIP")
    assert scrape_url("", pod=p, port=9400, job_name="j", namespace="ns") is None


def run(coro, timeout=20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_hung_pod_does_not_hold_up_the_others_and_stall_events_are_transitions(endpoints, monkeypatch):
    now = [1000.0]
    ports = {f"j-{e.rank}": e.port for e in endpoints}
    monkeypatch.setattr("ddpjob_operator.cluster.monitor.scrape_url",
                        lambda template, *, pod, **kw: f"http://127.0.0.1:{ports[pod['metadata']['name']]}/metrics")
    m = Monitor(OperatorConfig(), timeout=1.0, clock=lambda: now[0])
    pods = [pod(0), pod(1), pod(2, phase="Pending"), pod(0, attempt=0, deleting=True)]

    endpoints[1].hang.set()                                   # rank 1's pod never answers
    rep = run(m.observe(job(), pods))                         # bounded by the per-request timeout
    assert rep.progress["step"] == 10 and rep.progress["ranksReporting"] == 1
    assert {c["type"]: c["status"] for c in rep.conditions} == {"Straggler": "False", "Stalled": "False"}
    assert rep.events == [] and not rep.stalled

    endpoints[1].hang.clear()
    endpoints[1].release.set()
    now[0] += 5
    assert run(m.observe(job(), pods)).progress["ranksReporting"] == 2
    now[0] += 31                                              # nothing advanced for > hangTimeoutSeconds
    rep = run(m.observe(job(), pods))
    assert rep.stalled
    stalled = next(c for c in rep.conditions if c["type"] == "Stalled")
    assert stalled["status"] == "True" and stalled["reason"] == "NoProgress"
    assert [(t, r) for t, r, _ in rep.events] == [("Warning", "Stalled")]
    since = stalled["lastTransitionTime"]

    now[0] += 10                                              # still stalled: no new event
    body = {**job(), "status": {"conditions": rep.conditions}}
    rep = run(m.observe(body, pods))
    assert rep.events == [] and rep.stalled
    assert next(c for c in rep.conditions if c["type"] == "Stalled")["lastTransitionTime"] == since

    for e in endpoints:                                       # training moves again
        e.step = 11
    now[0] += 10
    rep = run(m.observe(body, pods))
    assert not rep.stalled and [(t, r) for t, r, _ in rep.events] == [("Normal", "Resumed")]

    m.forget("u1")
    assert "u1" not in m._jobs


def test_restart_of_the_operator_keeps_a_reported_stall(endpoints, monkeypatch):
    ports = {f"j-{e.rank}": e.port for e in endpoints}
    monkeypatch.setattr("ddpjob_operator.cluster.monitor.scrape_url",
                        lambda template, *, pod, **kw: f"http://127.0.0.1:{ports[pod['metadata']['name']]}/metrics")
    body = {**job(), "status": {"conditions": [{"type": "Stalled", "status": "True", "reason": "NoProgress",
                                                "message": "old", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    rep = run(Monitor(OperatorConfig(), timeout=1.0).observe(body, [pod(0), pod(1)]))
    assert rep.stalled and rep.events == []
    assert next(c for c in rep.conditions if c["type"] == "Stalled")["lastTransitionTime"] == "2026-01-01T00:00:00Z"


def test_group_restart_starts_the_hang_clock_afresh(endpoints, monkeypatch):
    ports = {f"j-{e.rank}": e.port for e in endpoints}
    monkeypatch.setattr("ddpjob_operator.cluster.monitor.scrape_url",
                        lambda template, *, pod, **kw: f"http://127.0.0.1:{ports[pod['metadata']['name']]}/metrics")
    now = [0.0]
    m = Monitor(OperatorConfig(), timeout=1.0, clock=lambda: now[0])
    run(m.observe(job(hang=30), [pod(0), pod(1)]))
    now[0] = 40
    assert run(m.observe(job(hang=30), [pod(0), pod(1)])).stalled
    now[0] = 45                                    # restartOnHang: the operator made attempt 1
    rep = run(m.observe(job(hang=30), [pod(0, attempt=1), pod(1, attempt=1)]))
    assert not rep.stalled and next(c for c in rep.conditions if c["type"] == "Stalled")["status"] == "False"
    now[0] = 80                                    # the new attempt gets its own full timeout
    assert run(m.observe(job(hang=30), [pod(0, attempt=1), pod(1, attempt=1)])).stalled


def test_unreachable_endpoints_claim_no_health_and_cost_no_status_write():
    import socket

    with socket.socket() as s:            # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    m = Monitor(OperatorConfig(scrape_url_template=f"http://127.0.0.1:{closed}/metrics"), timeout=1.0)
    for _ in range(2):
        rep = run(m.observe(job(), [pod(0), pod(1)]))
        assert rep.progress is None and rep.conditions == [] and rep.events == [] and not rep.stalled


def test_a_pods_new_stack_captures_are_fetched_once_from_its_endpoint(tmp_path, monkeypatch):
    """A real agent's capture of a real worker, served by the launcher's endpoint: the scrape that
    shows its series fetches the capture (contract.STACKS_PATH) for the operator to keep; the next
    scrape, with nothing new, fetches nothing."""
    import os
    import subprocess
    import sys

    from ddpjob_api import contract
    from ddpjob_trainer.telemetry import serve_node_endpoint
    from tests.unit.test_stacks import _worker

    folder, metrics = tmp_path / "stacks", tmp_path / "metrics"
    worker = _worker(folder)
    env = {contract.ENV_STACKS_DIR: str(folder), contract.ENV_METRICS_DIR: str(metrics), contract.ENV_ATTEMPT: "0",
           contract.ENV_JOB_NAME: "j", contract.ENV_JOB_NAMESPACE: "ns", "NODE_RANK": "1"}
    try:
        subprocess.run([sys.executable, "-c", f"from ddpjob_trainer.agent import Hooks\nh = Hooks({env!r})\n"
                        f"h.capture({{1: {worker.pid}}}, 'stall')\n"], check=True, env={**os.environ, **env})
    finally:
        worker.kill()
    server = serve_node_endpoint(0, str(metrics), addr="127.0.0.1", stacks_dir=str(folder))
    port = server.server_address[1]
    monkeypatch.setattr("ddpjob_operator.cluster.monitor.scrape_url",
                        lambda template, *, pod, **kw: f"http://127.0.0.1:{port}/metrics")
    try:
        m = Monitor(OperatorConfig(), timeout=2.0)
        rep = run(m.observe(job(), [pod(1)]))
        ((record, pod_name, node),) = rep.stacks
        assert (record["rank"], record["trigger"], pod_name, node) == (1, "stall", "j-1", "node-1")
        assert "wait_for_the_loader" in record["text"]
        assert rep.ranks[1].stack_captures[0]["time"] == record["time"]
        assert run(m.observe(job(), [pod(1)])).stacks == []       # nothing new: not fetched again
        m.fetch_stacks_again("u1")                                # the ConfigMap write failed
        assert len(run(m.observe(job(), [pod(1)])).stacks) == 1
    finally:
        server.shutdown()
        server.server_close()
