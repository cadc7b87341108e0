"""`ddpjob run --local` reads its nodes' metrics and stacks: a read that fails is one missed read."""
from __future__ import annotations

import socket
import threading
from pathlib import Path

from ddpjob_cli import local

REPO = Path(__file__).resolve().parents[2]


def cut_short_server() -> tuple[int, socket.socket]:
    """A loopback port whose every answer promises a body it never sends (a launcher exiting
    mid-answer): http.client raises IncompleteRead, neither an OSError nor a ValueError."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 7241\r\n\r\n# HELP")

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], srv


def test_a_node_whose_answer_is_cut_short_is_a_missed_read_not_the_runners_end():
    # A CI failure: the runner exited 1 with http.client.IncompleteRead from Display.update while
    # node 0's launcher ended, and the job's summary was never written.
    job = local.validate(local.load_job_file(str(REPO / "examples/digits.yaml")))
    port, srv = cut_short_server()
    try:
        display = local.Display(enabled=False, job=job)
        assert display.update([port, port]) == {}
        assert local.stall_stacks([port]).startswith("no stack captured")
    finally:
        srv.close()
