"""Fixtures for tests against the local control plane (see tests/support/cluster.py)."""
from __future__ import annotations

import pytest

# The cluster, api and namespace fixtures come from tests/support/fixtures.py (root conftest).
from tests.support.cluster import wait_for  # noqa: F401  (re-exported for test modules)


def pytest_collection_modifyitems(items):
    """Mark every test in this directory `cluster` (selectable with -m cluster)."""
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(autouse=True)
def _network_rule(no_kwok_traffic):
    """Every cluster test runs under the network rule's watch (tests/support/fixtures.py)."""
