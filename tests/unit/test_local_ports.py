"""Port choice for `ddpjob run --local` (and the tests that start local runs and operators)."""
from __future__ import annotations

import socket

import pytest

from ddpjob_cli import local


@pytest.fixture
def ephemeral_from(tmp_path, monkeypatch):
    def set_low(low: int):
        f = tmp_path / "ip_local_port_range"
        f.write_text(f"{low}\t60999\n")
        monkeypatch.setattr(local, "_EPHEMERAL_FILE", f)
    return set_low


@pytest.mark.parametrize("count", [1, 2, 8])
def test_ports_come_from_below_the_ephemeral_range(ephemeral_from, count):
    # An outgoing connection's source port comes from the ephemeral range; a metrics port picked
    # there can be taken before the node binds it (a CI failure: one rank never reported).
    ephemeral_from(32768)
    for _ in range(20):
        base = local.free_ports(count)
        assert base >= local._LOWEST_PICK and base + count <= 32768
        assert all(local._bindable(p) for p in range(base, base + count))


def test_a_taken_port_is_never_chosen(ephemeral_from):
    # Room for exactly one pick below the range (_LOWEST_PICK), and that port is held: the picker
    # must fall back to another port, not return the taken one.
    ephemeral_from(local._LOWEST_PICK + 2)
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", local._LOWEST_PICK))
        except OSError:
            pytest.skip(f"port {local._LOWEST_PICK} is already in use here, so it cannot be held")
        assert local.free_ports(1) != local._LOWEST_PICK


def test_no_room_below_the_range_falls_back_to_the_kernels_choice(ephemeral_from):
    ephemeral_from(1024)
    base = local.free_ports(2)
    assert local._bindable(base) and local._bindable(base + 1)
