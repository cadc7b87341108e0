"""Shared pytest fixtures: for every tier that talks to the local control plane (cluster, e2e), and
the launcher's termination log (unit, trainer)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cluster import Cluster, create_namespace, delete_namespace, ensure_cluster
from tests.support.network import (
    ConnectionWatch,
    block_in_process_connects,
    guard_probes,
    guard_rejections,
)

# What hack/kwok-guard.sh had rejected when the session started, and what the session adds.
_guard: dict[str, object] = {"start": None, "probes": 0, "verdict": ""}


def pytest_configure(config):
    """No test process may connect to a fictitious kwok address (docs/development.md, Network rule)."""
    block_in_process_connects()


def pytest_sessionstart(session):
    _guard["start"] = guard_rejections()
    _guard["probes"] = guard_probes()


def pytest_sessionfinish(session, exitstatus):
    """The whole run made no connection attempt to a kwok range other than the guard test's own
    probes: the guard's counters see every attempt (refused on the spot), sampled or not."""
    end = guard_rejections()
    if end is None:
        return
    start = _guard["start"] if isinstance(_guard["start"], int) else 0  # chain made during the run: 0
    probes = guard_probes() - (_guard["probes"] if isinstance(_guard["probes"], int) else 0)
    stray = end - start - probes
    if stray > 0:
        _guard["verdict"] = (f"FAILED: {stray} packet(s) of this run went to kwok's fictitious addresses "
                             "(refused by hack/kwok-guard.sh; `iptables -L DDPJOB-KWOK-GUARD -v` counts them)")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        _guard["verdict"] = (f"no connection attempt to kwok's addresses ({probes} "
                             "deliberate probe(s) by the guard test, refused)")


def pytest_terminal_summary(terminalreporter):
    if _guard["verdict"]:
        terminalreporter.section("network rule")
        terminalreporter.write_line(str(_guard["verdict"]))


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """The running local control plane; started with hack/cluster-up.sh when none is healthy."""
    return ensure_cluster()


@pytest.fixture
def api(cluster):
    """A kubernetes ApiClient (cluster admin) for the test, closed afterwards."""
    client = cluster.api()
    yield client
    client.close()


@pytest.fixture
def namespace(cluster, api) -> str:
    """A fresh namespace for one test, deleted (without waiting) afterwards."""
    name = create_namespace(api)
    yield name
    delete_namespace(api, name)


@pytest.fixture(scope="session")
def connection_watch():
    """This machine's TCP table, sampled for the whole session (tests/support/network.py)."""
    watch = ConnectionWatch().start()
    yield watch
    watch.stop()


@pytest.fixture
def no_kwok_traffic(connection_watch, request):
    """Fails the test (at teardown) when one of this run's processes, e.g. an operator it
    started, tried to reach a kwok pod's or node's fictitious address meanwhile."""
    yield
    connection_watch.sample()
    connection_watch.check(what=f"{request.node.nodeid}: a process of this test run")


@pytest.fixture
def termination_log(tmp_path, monkeypatch) -> Path:
    """The launcher writes its termination message here instead of /dev/termination-log; its
    scratch files (result, per-rank status) go where it chooses, as in a pod."""
    from ddpjob_trainer.launch import report

    term = tmp_path / "termination-log"
    monkeypatch.setattr(report, "TERMINATION_LOG", str(term))
    from prometheus_client import values

    for var in ("DDPJOB_RESULT_FILE", "DDPJOB_STATUS_DIR", "DDPJOB_METRICS_DIR", "PROMETHEUS_MULTIPROC_DIR"):
        # Set, then deleted, so that monkeypatch restores the absence: the launcher points its own
        # process's metrics at a scratch dir that it removes on exit, which must not leak into
        # later tests (nor must prometheus-client's multiprocess value class).
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    return term
