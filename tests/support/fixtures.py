"""Shared pytest fixtures for every tier that talks to the local control plane (cluster, e2e)."""
from __future__ import annotations

import pytest

from tests.support.cluster import Cluster, create_namespace, delete_namespace, ensure_cluster


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
