"""Tests against the local control plane (make cluster-up)."""
