"""The in-pod launcher's wait for the master: real sockets and real name resolution."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from ddpjob_trainer.launch import wait_for_master


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
