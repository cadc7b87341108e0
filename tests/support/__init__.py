"""Shared helpers for the cluster and e2e tiers (see tests/support/cluster.py)."""
from tests.support.cluster import (  # noqa: F401  (re-exported API)
    BIN_DIR,
    KUBECONFIG,
    REPO_ROOT,
    TEST_EVICT_ANNOTATION,
    TEST_EXIT_CODE_ANNOTATION,
    Cluster,
    create_namespace,
    delete_namespace,
    ensure_cluster,
    evict_pod,
    set_pod_exit,
    wait_for,
)
