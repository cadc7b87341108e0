"""Pods on nodes that kwok simulates are not scraped by their address (their IPs are fictitious:
a request could only fail, or leave the machine); the status says progress is unavailable. An
explicit template (the tests' loopback stand-ins) still applies to them. Real aiohttp metrics
endpoints on loopback play the real nodes' pods."""
from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from ddpjob_operator.base.group import Group
from ddpjob_operator.cluster import scrape
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.cluster.monitor import Monitor, SimulatedNodes
from ddpjob_operator.base.podinfo import SIMULATED_NODE_ANNOTATION
from ddpjob_operator.decisions.status import progress_display
from tests.support.builders import make_manifest, make_pod
from tests.support.passes import pass_status

KWOK_IP = "10.244.0.7"   # never dialled: the in-process hook would refuse it anyway
NODES = {"kwok-gpu-0": {"metadata": {"name": "kwok-gpu-0", "annotations": {SIMULATED_NODE_ANNOTATION: "fake"}}},
         "real-0": {"metadata": {"name": "real-0", "annotations": {"other": "x"}}}}


def _metrics(rank: int) -> str:
    lab = f'rank="{rank}",node_rank="{rank}"'
    return (f"ddpjob_trainer_step{{{lab}}} 5\nddpjob_trainer_total_steps{{{lab}}} 100\n"
            f"ddpjob_trainer_loss{{{lab}}} 0.5\n")


@pytest.fixture
def endpoint():
    """A loopback metrics endpoint: (loop, port)."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/metrics", _respond)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    yield loop, site._server.sockets[0].getsockname()[1]
    loop.run_until_complete(runner.cleanup())
    loop.close()


async def _respond(request: web.Request) -> web.Response:
    return web.Response(text=_metrics(0))


class Forbidden(Exception):
    """What the client raises for a 403 (an ApiException's status and reason)."""

    status, reason = 403, "Forbidden"


class Nodes:
    """The API server's answer to GET /api/v1/nodes/NAME, counted."""

    def __init__(self, error: Exception | None = None) -> None:
        self.asked: list[str] = []
        self.error = error

    async def get(self, name: str) -> dict | None:
        self.asked.append(name)
        if self.error is not None:
            raise self.error
        return NODES.get(name)


@pytest.fixture
def fetched(monkeypatch):
    """Every URL the monitor scrapes (the real fetch still runs)."""
    urls: list[str] = []
    real = scrape.fetch_all

    async def spy(batch, **kw):
        urls.extend(batch)
        return await real(batch, **kw)

    monkeypatch.setattr(scrape, "fetch_all", spy)
    return urls


def _observe(loop, mon, pods, port):
    return loop.run_until_complete(mon.observe(make_manifest("demo", uid="u1", metricsPort=port), pods))


@pytest.mark.parametrize("template, node, scraped, unavailable", [
    ("", "kwok-gpu-0", False, True),                                    # default: by the pod's address
    ("http://{ip}:{port}/metrics", "kwok-gpu-0", False, True),          # spelled out: still by address
    ("http://127.0.0.1:{port}/metrics", "kwok-gpu-0", True, False),     # a stand-in the user chose
    ("", "real-0", True, False),                                        # a real node's pod
])
def test_which_pods_are_scraped(endpoint, fetched, template, node, scraped, unavailable):
    loop, port = endpoint
    ip = KWOK_IP if node.startswith("kwok") else "127.0.0.1"
    pods = [make_pod(r, job="demo", node_name=node, pod_ip=ip) for r in range(2)]
    nodes = Nodes()
    mon = Monitor(OperatorConfig(scrape_url_template=template), timeout=10, simulated=SimulatedNodes(nodes.get))
    report = _observe(loop, mon, pods, port)
    assert bool(fetched) == scraped, fetched
    assert not any(KWOK_IP in u for u in fetched)
    if unavailable:
        assert report.progress == {"unavailable": report.progress["unavailable"]}
        assert "2 pod(s) on simulated (kwok) nodes" in report.progress["unavailable"]
        assert progress_display(report.progress) == "n/a (not scraped)"
        assert not report.unreachable  # nothing was tried, so nothing backs off
    else:
        assert report.progress and report.progress.get("step") == 5


def test_a_node_is_asked_about_once(endpoint, fetched):
    loop, port = endpoint
    nodes = Nodes()
    mon = Monitor(OperatorConfig(), timeout=10, simulated=SimulatedNodes(nodes.get))
    pods = [make_pod(r, job="demo", node_name="kwok-gpu-0", pod_ip=KWOK_IP) for r in range(3)]
    for _ in range(3):
        _observe(loop, mon, pods, port)
    assert nodes.asked == ["kwok-gpu-0"] and fetched == []


def test_without_permission_to_read_nodes_every_node_is_real_said_once(caplog):
    nodes = Nodes(error=Forbidden())
    simulated = SimulatedNodes(nodes.get)
    with caplog.at_level(logging.WARNING, logger="ddpjob_operator.cluster.monitor"):
        answers = [asyncio.run(simulated(n)) for n in ("kwok-gpu-0", "real-0", "kwok-gpu-0")]
    assert answers == [False, False, False]
    assert nodes.asked == ["kwok-gpu-0"]  # not asked again: the answer cannot change
    assert len([r for r in caplog.records if "may not read nodes" in r.getMessage()]) == 1


def test_a_failed_lookup_is_asked_again():
    nodes = Nodes(error=ConnectionResetError("reset"))
    simulated = SimulatedNodes(nodes.get)
    assert asyncio.run(simulated("kwok-gpu-0")) is False
    nodes.error = None
    assert asyncio.run(simulated("kwok-gpu-0")) is True
    assert nodes.asked == ["kwok-gpu-0", "kwok-gpu-0"]


def test_the_status_says_why_and_forgets_it_once_progress_returns():
    from ddpjob_operator.decisions.samples import MonitorReport
    from ddpjob_operator.decisions.status import UNAVAILABLE
    from tests.support.builders import NOW, make_job, running_status

    pods = [make_pod(0), make_pod(1)]
    note = {UNAVAILABLE: "2 pod(s) on simulated (kwok) nodes: ..."}
    status, _ = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=running_status(),
                            report=MonitorReport(progress=note, conditions=[], events=[], stalled=False))
    assert status["progress"] == {**note, "display": "n/a (not scraped)"}
    status, _ = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=status,
                            report=MonitorReport(progress={"step": 3}, conditions=[], events=[], stalled=False))
    assert status["progress"] == {"step": 3, "display": "step 3"}
