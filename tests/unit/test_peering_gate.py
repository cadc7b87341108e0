"""A replica with a live higher-priority peer runs no reconcile pass, whatever triggered it."""
from __future__ import annotations

import asyncio
import datetime as dt

from ddpjob_operator.config import OperatorConfig
from ddpjob_operator.controller import Reconciler
from prometheus_client import CollectorRegistry

from ddpjob_operator.operator_metrics import OperatorMetrics


class PeeringOnly:
    """The I/O boundary, reduced to the one call the gate makes."""

    def __init__(self, peers: dict):
        self.peers = peers
        self.calls = 0

    async def get_peering(self, name, namespace):
        self.calls += 1
        return {"status": self.peers}


def peer(priority: int, *, seconds_ago: float) -> dict:
    seen = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds_ago)
    return {"priority": priority, "lifetime": 60, "lastseen": seen.isoformat()}


def run_pass(peers: dict) -> list:
    cfg = OperatorConfig(namespaces=("ns",), peering="ddpjob", priority=5)
    rec = Reconciler(cfg, PeeringOnly(peers), OperatorMetrics(CollectorRegistry()), monitor=None)
    passes = []

    async def fake_reconcile(namespace, name, *, scrape=False):
        passes.append((namespace, name))

    rec.reconcile = fake_reconcile

    async def main():
        rec.kick("ns", "job")  # as a watch event would
        await asyncio.sleep(0.5)

    asyncio.run(main())
    return passes


def test_live_higher_priority_peer_blocks_event_triggered_passes():
    assert run_pass({"other": peer(10, seconds_ago=1)}) == []


def test_lower_priority_or_dead_peers_do_not_block():
    assert run_pass({"low": peer(1, seconds_ago=1), "dead": peer(10, seconds_ago=3600)}) == [("ns", "job")]
