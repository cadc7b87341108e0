"""Root conftest: fixtures shared by the cluster and e2e tiers live in tests/support/fixtures.py."""
from __future__ import annotations

from collections import defaultdict

import pytest

pytest_plugins = ["tests.support.fixtures", "tests.support.budget", "tests.support.mlflow_server"]

# Wall time per tier (tests/<tier>/), setup and teardown included: session fixtures (cluster,
# images, the Helm-installed operator) are charged to the tier whose first test pays for them.
_tier_seconds: dict[str, float] = defaultdict(float)
_tier_tests: dict[str, int] = defaultdict(int)


def pytest_runtest_logreport(report) -> None:
    parts = report.nodeid.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]
    _tier_seconds[tier] += report.duration
    if report.when == "call":
        _tier_tests[tier] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if not _tier_seconds:
        return
    terminalreporter.section("time per tier")
    for tier, secs in sorted(_tier_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{tier:<10} {_tier_tests[tier]:>4} tests {secs / 60:6.1f} min")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items) -> None:
    """The tests on the real nodes run last, each tier's in its order: make test has the nodes pull
    our images (minutes for the trainer's) in the background while the others run, and their
    fixture (tests/realpods/conftest.py real_cluster) waits for that pull on hack/images.sh's lock."""
    items.sort(key=lambda item: "real_cluster" in item.fixturenames)
