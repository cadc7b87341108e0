"""A pod's metrics endpoint cannot weaponise the scraper: real aiohttp servers on loopback serving
oversized, non-finite and slow responses (issue 12, item 3)."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiohttp import web

from ddpjob_operator.cluster import monitor as monitor_mod, scrape
from ddpjob_operator.decisions.samples import parse_metrics
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.cluster.monitor import Monitor
from tests.support.builders import make_manifest, make_pod

CAP = 64 * 1024


def _good(rank: int, step: int = 5) -> str:
    lab = f'ddpjob="demo",namespace="ns",rank="{rank}",local_rank="0",node_rank="{rank}"'
    return (f"ddpjob_trainer_step{{{lab}}} {step}\n"
            f"ddpjob_trainer_total_steps{{{lab}}} 100\n"
            f"ddpjob_trainer_loss{{{lab}}} 0.5\n"
            f"ddpjob_trainer_samples_total{{{lab}}} {32 * step}\n"
            f"ddpjob_trainer_step_seconds_sum{{{lab}}} {0.5 * step}\n"
            f"ddpjob_trainer_step_seconds_count{{{lab}}} {step}\n"
            f"ddpjob_trainer_last_step_timestamp_seconds{{{lab}}} 1000\n")


def _poison(rank: int) -> str:
    lab = f'ddpjob="demo",namespace="ns",rank="{rank}",local_rank="0",node_rank="{rank}"'
    return (f"ddpjob_trainer_step{{{lab}}} 7\n"
            f"ddpjob_trainer_total_steps{{{lab}}} +Inf\n"
            f"ddpjob_trainer_epoch{{{lab}}} -3\n"
            f"ddpjob_trainer_loss{{{lab}}} NaN\n"
            f"ddpjob_trainer_eval_loss{{{lab}}} -Inf\n"
            f"ddpjob_trainer_samples_total{{{lab}}} +Inf\n"
            f"ddpjob_trainer_step_seconds_sum{{{lab}}} 1e300\n"
            f"ddpjob_trainer_step_seconds_count{{{lab}}} 1e-300\n"
            f"ddpjob_trainer_gpu_memory_allocated_bytes{{{lab}}} NaN\n"
            f"ddpjob_trainer_last_step_timestamp_seconds{{{lab}}} +Inf\n")


async def _huge(request: web.Request) -> web.StreamResponse:
    # Streamed without Content-Length, so only the chunked cap can stop it; far past the cap.
    resp = web.StreamResponse()
    await resp.prepare(request)
    line = ("# filler " + "x" * 1000 + "\n").encode()
    try:
        for _ in range(CAP // len(line) * 200):
            await resp.write(line)
    except (ConnectionResetError, ConnectionError):
        pass
    return resp


async def _slow(request: web.Request) -> web.Response:
    await asyncio.sleep(3)  # well past the 0.5 s deadline the test gives; short so teardown is quick
    return web.Response(text=_good(9))


def _serving(body):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=body(int(request.match_info["rank"])))
    return handler


PEERS: list[tuple] = []  # the client address of each request to /peer/


async def _peer(request: web.Request) -> web.Response:
    PEERS.append(request.transport.get_extra_info("peername"))
    return web.Response(text=_good(int(request.match_info["rank"])))


@pytest.fixture
def server():
    """Start a loopback aiohttp app on a random port; yields its base URL."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/good/{rank}", _serving(_good))
    app.router.add_get("/poison/{rank}", _serving(_poison))
    app.router.add_get("/huge/{rank}", _huge)
    app.router.add_get("/slow/{rank}", _slow)
    app.router.add_get("/peer/{rank}", _peer)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    yield loop, f"http://127.0.0.1:{port}"
    loop.run_until_complete(runner.cleanup())
    loop.close()


def _job() -> dict:
    return make_manifest("demo", uid="u1", metricsPort=9400)


def _pods(kinds: list[str]) -> list[dict]:
    """Running pods named after the server's routes (`<kind>/<rank>`), so the URL template
    `<base>/{pod}` reaches the route."""
    return [make_pod(i, job="demo", name=f"{kind}/{i}", node_name="n", pod_ip="127.0.0.1")
            for i, kind in enumerate(kinds)]


def test_oversized_body_is_a_failed_scrape_of_that_pod(server, caplog):
    loop, base = server
    results = loop.run_until_complete(scrape.fetch_all(
        [f"{base}/huge/0", f"{base}/good/1"], timeout=20, max_bytes=CAP))
    assert results[0].text is None and results[0].oversized
    assert str(CAP) in results[0].error
    assert results[1].text is not None and 1 in parse_metrics(results[1].text)


def test_monitor_warns_naming_the_url_and_cap(server, caplog):
    loop, base = server
    mon = Monitor(OperatorConfig(scrape_url_template=base + "/{pod}"), timeout=20,
                  max_body_bytes=CAP)
    pods = _pods(["huge", "good"])
    with caplog.at_level(logging.WARNING, logger="ddpjob_operator.cluster.monitor"):
        report = loop.run_until_complete(mon.observe(_job(), pods))
    assert report.progress is not None  # the good pod still counts
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"{base}/huge/0" in m and str(CAP) in m for m in warned), warned


def test_non_finite_and_absurd_values_never_reach_the_report(server):
    loop, base = server
    (res,) = loop.run_until_complete(scrape.fetch_all([f"{base}/poison/0"], timeout=20))
    parsed = parse_metrics(res.text)
    s = parsed[0]
    assert s.step == 7
    assert s.total_steps is None and s.epoch is None and s.loss is None and s.eval_loss is None
    assert s.samples_total == 0.0 and s.step_seconds_sum == 0.0 and s.step_seconds_count == 0.0
    assert s.gpu_memory_allocated_bytes is None and s.last_step_timestamp is None

    mon = Monitor(OperatorConfig(scrape_url_template=base + "/{pod}"), timeout=20)
    pods = _pods(["poison", "good"])
    for _ in range(2):  # the second pass computes rates against the first
        report = loop.run_until_complete(mon.observe(_job(), pods))
        json.dumps({"progress": report.progress, "conditions": report.conditions,
                    "events": report.events}, allow_nan=False)
    assert report.progress


def test_huge_but_finite_values_keep_the_report_within_int64(server):
    """Values inside the bounds can still multiply past int64 (etaSeconds); such fields are dropped."""
    loop, base = server
    lab = 'rank="0",node_rank="0"'
    text = (f"ddpjob_trainer_step{{{lab}}} 0\nddpjob_trainer_total_steps{{{lab}}} 1e12\n"
            f"ddpjob_trainer_step_seconds_sum{{{lab}}} 1e12\n"
            f"ddpjob_trainer_step_seconds_count{{{lab}}} 1\n")
    samples = parse_metrics(text)
    assert samples[0].total_steps == 10**12
    mon = Monitor(OperatorConfig(scrape_url_template=base + "/{pod}"), timeout=20)
    prog = monitor_mod._finite_only(monitor_mod.progress.compute_progress(samples, now=1.0))
    assert "etaSeconds" not in prog and prog["totalSteps"] == 10**12
    assert mon.max_body_bytes == scrape.MAX_BODY_BYTES


def test_slow_endpoint_fails_alone(server):
    loop, base = server
    results = loop.run_until_complete(scrape.fetch_all(
        [f"{base}/slow/0", f"{base}/good/1", f"{base}/good/2"], timeout=0.5))
    assert results[0].text is None and results[0].error
    assert [sorted(parse_metrics(r.text)) for r in results[1:]] == [[1], [2]]


def test_bad_cap_is_a_clear_error():
    with pytest.raises(ValueError, match="max_bytes"):
        asyncio.run(scrape.fetch_all(["http://127.0.0.1:1/"], max_bytes=0))


def test_the_monitor_keeps_one_connection_per_pod_across_scrapes(server):
    """A scrape does not open a connection per pod each time: the monitor's session keeps them."""
    loop, base = server
    PEERS.clear()
    mon = Monitor(OperatorConfig(scrape_url_template=base + "/{pod}"), timeout=20)
    pods = _pods(["peer", "peer"])
    for _ in range(3):
        report = loop.run_until_complete(mon.observe(_job(), pods))
        assert report.progress and report.progress["ranksReporting"] == 2
    loop.run_until_complete(mon.close())
    assert len(PEERS) == 6 and len(set(PEERS)) == 2, PEERS
