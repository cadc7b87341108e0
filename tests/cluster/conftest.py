"""Fixtures for tests against the local control plane (see tests/support/cluster.py)."""
from __future__ import annotations

import pytest

from tests.support.cluster import (  # noqa: F401  (wait_for re-exported for test modules)
    Cluster,
    create_namespace,
    delete_namespace,
    ensure_cluster,
    wait_for,
)


def pytest_collection_modifyitems(items):
    """Mark every test in this directory `cluster` (selectable with -m cluster)."""
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """The running local control plane; started with hack/cluster-up.sh when none is healthy."""
    return ensure_cluster()


@pytest.fixture
def api(cluster):
    """A kubernetes ApiClient for the test (closed afterwards)."""
    client = cluster.api()
    yield client
    client.close()


@pytest.fixture
def namespace(cluster, api) -> str:
    """A fresh namespace for one test, deleted (without waiting) afterwards."""
    name = create_namespace(api)
    yield name
    delete_namespace(api, name)
