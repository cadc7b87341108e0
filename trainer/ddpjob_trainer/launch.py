"""In-pod launcher: `python -m ddpjob_trainer.launch [opts] -- [CMD ...]`.

What Kubeflow users otherwise bolt on with init containers, done in-process:
1. non-zero node ranks wait (with a deadline) until the master's DNS name resolves and
   its port accepts, so a worker never dies because pod 0 is a second late;
2. one Prometheus endpoint per pod serves every local rank (a shared multiprocess dir);
3. CMD (default: `torchrun -m ddpjob_trainer`, configured by the PET_* env) runs with
   signals forwarded; the exit code is 78 when any rank failed on bad configuration.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .errors import EXIT_BAD_CONFIG, EXIT_TRAINING_FAILED, ConfigError

TERMINATION_LOG = "/dev/termination-log"


def _say(msg: str) -> None:
    print(f"[ddpjob-launch node {os.environ.get('NODE_RANK', '?')}] {msg}", file=sys.stderr, flush=True)


def wait_for_master(addr: str, port: int, *, timeout: float, interval: float = 1.0) -> None:
    """Block until addr resolves and addr:port accepts TCP, or raise TimeoutError saying which failed."""
    deadline = time.monotonic() + timeout
    last = "not tried"
    resolved = False
    while True:
        try:
            infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
            resolved = True
            with socket.create_connection(infos[0][4][:2], timeout=min(5.0, interval * 5)):
                return
        except socket.gaierror as exc:
            last = f"DNS name {addr} does not resolve ({exc.strerror})"
        except OSError as exc:
            last = f"{addr}:{port} refuses connections ({exc.strerror or exc})"
        if time.monotonic() >= deadline:
            what = "port" if resolved else "DNS name"
            raise TimeoutError(f"master {addr}:{port} not reachable after {timeout:.0f}s "
                               f"(waiting for its {what}): {last}")
        time.sleep(interval)


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: Ctrl-C and SIGTERM still stop the group, a SIGKILLed parent may not


def _write_termination(msg: str) -> None:
    try:
        with open(TERMINATION_LOG, "w") as f:
            f.write(msg[-4000:])
    except OSError:
        pass  # not in a pod, or no termination log mounted


def default_command() -> list[str]:
    """torchrun with the built-in trainer; torchrun reads PET_NNODES, PET_NODE_RANK, ... itself."""
    return [sys.executable, "-m", "torch.distributed.run", "-m", "ddpjob_trainer"]


def _bad_config_messages(status_dir: str) -> list[str]:
    if not os.path.isdir(status_dir):
        return []
    out = []
    for name in sorted(os.listdir(status_dir)):
        if name.startswith("bad-config-"):
            with open(os.path.join(status_dir, name)) as f:
                out.append(f.read().strip())
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the pod's part of the job and return its exit code."""
    p = argparse.ArgumentParser(prog="python -m ddpjob_trainer.launch")
    p.add_argument("--master-timeout", type=float,
                   default=float(os.environ.get("DDPJOB_MASTER_TIMEOUT", "600")),
                   help="seconds a worker waits for the master's DNS name and port")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("DDPJOB_METRICS_PORT", "0")),
                   help="serve this pod's metrics here (0: don't)")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    builtin = not cmd
    cmd = cmd or default_command()

    if builtin:  # fail in a second, before any rendezvous, when the config is wrong
        from .config import config_from_env
        try:
            config_from_env()
        except ConfigError as exc:
            msg = f"bad configuration: {exc}"
            _say(msg)
            _write_termination(msg)
            return EXIT_BAD_CONFIG

    env = dict(os.environ)
    node_rank = int(env.get("NODE_RANK", "0"))
    addr, port = env.get("MASTER_ADDR"), int(env.get("MASTER_PORT", "29500"))
    if node_rank != 0 and addr and "PET_RDZV_ENDPOINT" not in env:
        _say(f"waiting up to {args.master_timeout:.0f}s for master {addr}:{port}")
        try:
            wait_for_master(addr, port, timeout=args.master_timeout)
        except TimeoutError as exc:
            _say(str(exc))
            _write_termination(str(exc))
            return EXIT_TRAINING_FAILED

    scratch = tempfile.mkdtemp(prefix="ddpjob-")
    metrics_dir = env.setdefault("DDPJOB_METRICS_DIR", os.path.join(scratch, "metrics"))
    status_dir = env.setdefault("DDPJOB_STATUS_DIR", os.path.join(scratch, "status"))
    server = None
    if args.metrics_port:
        from .telemetry import serve_node_endpoint
        try:
            server = serve_node_endpoint(args.metrics_port, metrics_dir)
        except OSError as exc:  # training matters more than its metrics
            _say(f"WARNING metrics port {args.metrics_port} unavailable ({exc}); continuing without metrics")

    child = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)

    def forward(signum, _frame):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    try:
        os.killpg(child.pid, signal.SIGKILL)  # no orphaned workers survive their agent
    except ProcessLookupError:
        pass
    bad = _bad_config_messages(status_dir)
    if server is not None:
        server.shutdown()
    shutil.rmtree(scratch, ignore_errors=True)
    if bad:
        _write_termination(bad[0])
        return EXIT_BAD_CONFIG
    if code != 0:
        _write_termination(f"training exited with code {code}")
        return code if code > 0 else EXIT_TRAINING_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
