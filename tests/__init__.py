"""Test suite of DDPJob; a package so tiers can share `tests.support`."""
