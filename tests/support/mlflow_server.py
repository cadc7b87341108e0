"""A real MLflow tracking server for tests: `mlflow server` from the test extra, a sqlite backend
and artifacts in a temp dir, on a free loopback port; one per session (`mlflow_server` fixture).

`freeze()` stops its whole process group with SIGSTOP (a server that hangs: connections are
accepted by the kernel, never answered) until the block exits; `client()` is MLflow's own client
with short timeouts, for the tests to read runs back.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

MLFLOW = Path(sys.executable).parent / "mlflow"
START_SECONDS = 120.0  # a cold start runs the sqlite migrations: seconds, on a loaded 2-core machine


class MlflowServer:
    """One `mlflow server` process group on `host` (127.0.0.1; the real-pod tier binds it to an
    address of this machine that the pods route to). Artifacts go to root/artifacts: through the
    server (mlflow-artifacts:/) for clients elsewhere, else straight to that directory."""

    def __init__(self, root: Path, *, host: str = "127.0.0.1", proxy_artifacts: bool = False) -> None:
        from tests.support.localrun import free_ports

        self.root = root
        self.port = free_ports(1)[0]
        self.uri = f"http://{host}:{self.port}"
        self.log = root / "mlflow-server.log"
        (root / "artifacts").mkdir(parents=True, exist_ok=True)
        artifacts = (["--artifacts-destination", str(root / "artifacts")] if proxy_artifacts
                     else ["--default-artifact-root", str(root / "artifacts")])
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [str(MLFLOW), "server", "--host", host, "--port", str(self.port), "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", *artifacts],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
                # No job runner (its huey consumers are processes that tracking never uses).
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_healthy(self, timeout: float = START_SECONDS) -> None:
        from tests.support.cluster import wait_for

        def check():
            return "exited" if self.proc.poll() is not None else self.healthy()
        got = wait_for(check, timeout=timeout, interval=0.25, desc="mlflow server /health")
        assert got is True, f"mlflow server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}"

    @contextmanager
    def freeze(self) -> Iterator[None]:
        """SIGSTOP every process of the server until the block ends (then SIGCONT)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def client(self) -> Any:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def runs(self, experiment: str) -> list[Any]:
        """Every run of `experiment` (none when it does not exist)."""
        client = self.client()
        exp = client.get_experiment_by_name(experiment)
        return [] if exp is None else client.search_runs([exp.experiment_id], max_results=100)

    def metric_history(self, run_id: str, key: str) -> list[Any]:
        return sorted(self.client().get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))

    def wait_run(self, experiment: str, pred: Callable[[Any], bool], desc: str, *, timeout: float = 240,
                 proc: subprocess.Popen | None = None) -> Any:
        """The experiment's one run once `pred(run)` holds (gives up when `proc` ends first)."""
        from tests.support.cluster import wait_for

        def check():
            ended = proc is not None and proc.poll() is not None  # read before the runs: a last look
            runs = self.runs(experiment)
            if runs and pred(runs[0]):
                return ("ok", runs[0])
            return ("ended", runs and runs[0]) if ended else None
        how, run = wait_for(check, timeout=timeout, interval=0.25, desc=desc)
        assert how == "ok", f"training ended before {desc}: {run}"
        return run

    def stop(self) -> None:
        """SIGCONT (a frozen server cannot exit), SIGTERM, and SIGKILL when 20 s did not do."""
        for sig, grace in ((signal.SIGCONT, 0.0), (signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                return
            os.killpg(self.proc.pid, sig)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)


@contextmanager
def running_server(root: Path, **how: Any) -> Iterator[MlflowServer]:
    """A healthy MlflowServer (MlflowServer's keywords) until the block ends."""
    if not MLFLOW.exists():
        pytest.fail(f"{MLFLOW} is missing: the test extra installs mlflow (make install)")
    server = MlflowServer(root, **how)
    t0 = time.monotonic()
    try:
        server.wait_healthy()
        # The first API call imports the server's tracking store (seconds on a loaded machine): made
        # here, so that no test's trainer waits for it.
        server.runs("warm-up")
        print(f"mlflow server at {server.uri} healthy after {time.monotonic() - t0:.1f}s")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    """A real tracking server for the session (tests use experiments of their own)."""
    with running_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server
