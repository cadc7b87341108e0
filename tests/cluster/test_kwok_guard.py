"""kwok's fictitious addresses are unreachable by construction while the local cluster is up
(hack/kwok-guard.sh, run by cluster-up): a connection to either range is refused on this machine,
before a packet could leave it. The whole run's count of such attempts is checked at session end
(tests/support/fixtures.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.network import (
    FICTITIOUS_NETWORKS,
    GUARD_CHAIN,
    guard_rejections,
    record_guard_probe,
)

# In a child process: this test process refuses such connects itself (block_in_process_connects),
# which would prove nothing about the machine.
PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""


def _rules(chain: str) -> str:
    return subprocess.run(["iptables", "-w", "10", "-S", chain], capture_output=True, text=True).stdout


@pytest.mark.parametrize("net, port", list(zip(FICTITIOUS_NETWORKS, (9400, 10250))),
                         ids=["kwok-pods", "kwok-nodes"])
def test_a_connection_to_a_kwok_range_is_refused_at_once(cluster, net, port):
    # The guard must be in place before the probe: without it, the probe's SYN would leave.
    rules = _rules(GUARD_CHAIN)
    assert f"-d {net} -p tcp -j REJECT --reject-with tcp-reset" in rules, \
        f"hack/kwok-guard.sh up did not run: chain {GUARD_CHAIN} lacks {net}:\n{rules}"
    for parent in ("OUTPUT", "FORWARD"):
        assert f"-A {parent} -j {GUARD_CHAIN}" in _rules(parent), f"{parent} does not jump to {GUARD_CHAIN}"
    before = guard_rejections()
    address = str(net.broadcast_address - 1)
    record_guard_probe()
    out = subprocess.run([sys.executable, "-c", PROBE, address, str(port)], capture_output=True,
                         text=True, timeout=60).stdout.strip()
    # Refused by the guard itself: a timeout would mean the SYN went out unanswered.
    assert out == "ConnectionRefusedError", f"{address}:{port}: {out}"
    after = guard_rejections()
    assert before is not None and after is not None and after > before
