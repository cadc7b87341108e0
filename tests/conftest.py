"""Root conftest: fixtures shared by the cluster and e2e tiers live in tests/support/fixtures.py."""
pytest_plugins = ["tests.support.fixtures"]
