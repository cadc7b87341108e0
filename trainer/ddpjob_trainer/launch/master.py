"""A node other than 0 waits for the master (pod 0, the c10d rendezvous's host) before torchrun."""
from __future__ import annotations

import socket
import time
from typing import Callable, cast


def wait_for_master(addr: str, port: int, *, timeout: float, interval: float = 1.0,
                    check_stop: Callable[[], None] = lambda: None) -> None:
    """Block until addr resolves and addr:port accepts TCP, or raise TimeoutError saying which failed.
    `check_stop` runs between tries (StopSignals.raise_if_stopped: a stop that was lost is seen)."""
    deadline = time.monotonic() + timeout
    last = "not tried"
    resolved = False
    while True:
        try:
            infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
            resolved = True
            sockaddr = cast("tuple[str, int]", infos[0][4][:2])  # an AF_INET(6) address: host, port
            with socket.create_connection(sockaddr, timeout=min(5.0, interval * 5)):
                return
        except socket.gaierror as exc:
            last = f"DNS name {addr} does not resolve ({exc.strerror})"
        except OSError as exc:
            last = f"{addr}:{port} refuses connections ({exc.strerror or exc})"
        if time.monotonic() >= deadline:
            what = "port" if resolved else "DNS name"
            raise TimeoutError(f"master {addr}:{port} not reachable after {timeout:.0f}s "
                               f"(waiting for its {what}): {last}")
        check_stop()
        time.sleep(interval)
