"""Least privilege, asked of the real API server (`kubectl auth can-i --as <the chart's SA>`)."""
from __future__ import annotations

import pytest

from tests.support.cluster import create_namespace, delete_namespace


@pytest.fixture(scope="module")
def cluster_mode(cluster, kit):
    """A default (cluster-wide) install, shared by this module's questions."""
    api = cluster.api()
    ns = create_namespace(api, prefix="rbac-", labels={"pod-security.kubernetes.io/enforce": "restricted"})
    rel = kit.install_release(cluster, namespace=ns)
    yield rel
    kit.uninstall_release(cluster, rel)
    delete_namespace(api, ns)
    api.close()


@pytest.fixture(scope="module")
def namespaced_mode(cluster, kit):
    """rbac.namespaced=true watching one namespace; `other` is a namespace it must not touch."""
    api = cluster.api()
    ns = create_namespace(api, prefix="rbacns-")
    watched = create_namespace(api, prefix="watched-")
    other = create_namespace(api, prefix="other-")
    rel = kit.install_release(cluster, "rbac.namespaced=true", f"operator.watchNamespaces={{{watched}}}",
                              namespace=ns)
    yield rel, watched, other
    kit.uninstall_release(cluster, rel)
    for n in (ns, watched, other):
        delete_namespace(api, n)
    api.close()


ALLOWED = [  # (verb, resource, subresource)
    ("create", "pods", None),
    ("delete", "pods", None),
    ("watch", "pods", None),
    ("create", "services", None),
    ("get", "services", None),          # read back: ours, headless, not deleted
    ("get", "pods", None),              # after a 409: whose pod holds our name
    ("list", "ddpjobs.ddpjob.dev", None),
    ("patch", "ddpjobs.ddpjob.dev", "status"),
    ("delete", "ddpjobs.ddpjob.dev", None),
    ("create", "events", None),
    ("get", "configmaps", None),        # <job>-stacks: is one of that name the job's own?
    ("create", "configmaps", None),
    ("patch", "configmaps", None),
]
DENIED = [
    ("get", "secrets", None),
    ("list", "secrets", None),
    ("create", "pods", "exec"),
    ("create", "ddpjobs.ddpjob.dev", None),     # users create jobs, the operator never does
    ("list", "configmaps", None),
    ("delete", "configmaps", None),
    ("create", "deployments.apps", None),
    ("create", "serviceaccounts", "token"),
    ("update", "ddpjobs.ddpjob.dev", None),     # it never edits a user's spec
    ("patch", "pods", None),
]
# Cluster mode reads single nodes (is it simulated by kwok?) and nothing else about them.
NODE_READ = ("get", "nodes", None)
DENIED_CLUSTER = [
    ("delete", "nodes", None),
    ("list", "nodes", None),
    ("patch", "nodes", None),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
    ("create", "rolebindings.rbac.authorization.k8s.io", None),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", None),
    ("create", "namespaces", None),
    ("update", "customresourcedefinitions.apiextensions.k8s.io", None),
]


@pytest.mark.parametrize("verb, resource, sub", ALLOWED)
def test_cluster_mode_may(cluster, kit, cluster_mode, namespace, verb, resource, sub):
    assert kit.can_i(cluster, cluster_mode.user, verb, resource, namespace=namespace, subresource=sub)


@pytest.mark.parametrize("verb, resource", [("list", "pods"), ("watch", "pods"),
                                            ("list", "ddpjobs.ddpjob.dev"), ("watch", "ddpjobs.ddpjob.dev")])
def test_cluster_mode_may_watch_across_all_namespaces(cluster, kit, cluster_mode, verb, resource):
    """`ddpjob operator --all-namespaces` (the chart's default) lists and watches cluster-wide."""
    assert kit.can_i(cluster, cluster_mode.user, verb, resource)


@pytest.mark.parametrize("verb, resource, sub", DENIED)
def test_cluster_mode_may_not(cluster, kit, cluster_mode, verb, resource, sub):
    # asked across all namespaces, the operator's own included
    assert not kit.can_i(cluster, cluster_mode.user, verb, resource, subresource=sub)
    assert not kit.can_i(cluster, cluster_mode.user, verb, resource, namespace=cluster_mode.namespace,
                         subresource=sub)


@pytest.mark.parametrize("verb, resource, sub", DENIED_CLUSTER)
def test_cluster_mode_may_not_touch_cluster_objects(cluster, kit, cluster_mode, verb, resource, sub):
    assert not kit.can_i(cluster, cluster_mode.user, verb, resource, subresource=sub)


@pytest.mark.parametrize("verb, resource, sub", ALLOWED)
def test_namespaced_mode_may_only_in_its_namespace(cluster, kit, namespaced_mode, verb, resource, sub):
    rel, watched, other = namespaced_mode
    assert kit.can_i(cluster, rel.user, verb, resource, namespace=watched, subresource=sub)
    assert not kit.can_i(cluster, rel.user, verb, resource, namespace=other, subresource=sub)
    assert not kit.can_i(cluster, rel.user, verb, resource, subresource=sub), "cluster-wide"


def test_cluster_mode_may_read_a_node(cluster, kit, cluster_mode):
    verb, resource, sub = NODE_READ
    assert kit.can_i(cluster, cluster_mode.user, verb, resource, subresource=sub)


@pytest.mark.parametrize("verb, resource, sub", DENIED + DENIED_CLUSTER + [NODE_READ])
def test_namespaced_mode_may_not(cluster, kit, namespaced_mode, verb, resource, sub):
    rel, watched, _ = namespaced_mode
    assert not kit.can_i(cluster, rel.user, verb, resource, namespace=watched, subresource=sub)


def test_namespaced_mode_token_is_refused_outside(cluster, kit, namespaced_mode, tmp_path):
    """Not just a review: a real request with the token is refused in the other namespace."""
    rel, watched, other = namespaced_mode
    kubeconfig = kit.token_kubeconfig(cluster, rel, tmp_path / "sa.kubeconfig")
    ok = cluster.kubectl("--kubeconfig", str(kubeconfig), "-n", watched, "get", "pods", check=False)
    assert ok.returncode == 0, ok.stderr
    denied = cluster.kubectl("--kubeconfig", str(kubeconfig), "-n", other, "get", "pods", check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
