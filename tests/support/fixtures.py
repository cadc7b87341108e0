"""Shared pytest fixtures for every tier that talks to the local control plane (cluster, e2e)."""
from __future__ import annotations

import pytest

from tests.support.cluster import Cluster, create_namespace, delete_namespace, ensure_cluster
from tests.support.network import ConnectionWatch, block_in_process_connects


def pytest_configure(config):
    """No test process may connect to a fictitious kwok address (docs/development.md, Network rule)."""
    block_in_process_connects()


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
