"""A per-step job's Lighthouse: torchft's, and beside it the id of this incarnation of it.

    python -m ddpjob_trainer.lighthouse --min_replicas N --quorum_tick_ms MS --join_timeout_ms MS \
        --heartbeat_timeout_ms MS --bind HOST:PORT --id-bind HOST:PORT

A recreated Lighthouse (its pod deleted, its node lost, its process restarted) starts its quorum ids
from 1 again, and torchft 0.2.0 reconfigures a group's process group only when the id changes: a
group that did not notice the loss could keep its old process group while its peers build a new one
under the same id, and the job would go on as two models. Nothing in torchft's quorum tells two
Lighthouses apart, so this one also serves a random id of its own over HTTP (GET any path: the id,
as text); every rank reads it after each quorum and folds it into the quorum id
(faulttolerance.IncarnationClient). The id server starts first: once the Lighthouse's port accepts
connections (the pod's readiness), the id is served too.

The operator's Lighthouse pod runs this (builders/lighthouse.py), and so does `ddpjob run --local`.
"""
from __future__ import annotations

import argparse
import http.server
import signal
import sys
import threading
import uuid
from typing import Sequence


def _host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class _IdServer(http.server.ThreadingHTTPServer):
    daemon_threads = True


def id_server(bind: str, incarnation: str) -> http.server.ThreadingHTTPServer:
    """An HTTP server answering every GET with `incarnation` (not yet serving: serve_forever)."""
    body = incarnation.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive: each rank asks after every quorum

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return _IdServer(_host_port(bind), Handler)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddpjob_trainer.lighthouse", description=__doc__.splitlines()[0])
    ap.add_argument("--min_replicas", type=int, required=True)
    ap.add_argument("--quorum_tick_ms", type=int, required=True)
    ap.add_argument("--join_timeout_ms", type=int, required=True)
    ap.add_argument("--heartbeat_timeout_ms", type=int, required=True)
    ap.add_argument("--bind", required=True, help="the Lighthouse's HOST:PORT")
    ap.add_argument("--id-bind", required=True, help="HOST:PORT of the id of this incarnation")
    args = ap.parse_args(argv)
    incarnation = uuid.uuid4().hex
    ids = id_server(args.id_bind, incarnation)
    threading.Thread(target=ids.serve_forever, name="lighthouse-id", daemon=True).start()
    from torchft.coordination import LighthouseServer   # imports torch: after the cheap part is up

    server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                              quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    print(f"lighthouse {incarnation} serving at {server.address()} (its id at {args.id_bind})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.shutdown()
    ids.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
