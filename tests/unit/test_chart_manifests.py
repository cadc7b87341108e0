"""manifests/ is generated from the chart (hack/gen-manifests.sh) and must not drift from it."""
from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from tests.unit.test_chart import CHART, HELM, REPO

pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary: `make build-cluster` builds it")
MANIFESTS = REPO / "manifests"


def test_checked_in_manifests_match_the_chart(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "hack" / "gen-manifests.sh"), str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HELM": HELM})
    assert proc.returncode == 0, proc.stderr
    for name in ("crd.yaml", "operator.yaml"):
        fresh, checked_in = (tmp_path / name).read_text(), (MANIFESTS / name).read_text()
        assert fresh == checked_in, f"manifests/{name} drifted from the chart: run `make manifests`"


def test_crd_yaml_holds_every_chart_crd():
    docs = [d for d in yaml.safe_load_all((MANIFESTS / "crd.yaml").read_text()) if d]
    assert {d["kind"] for d in docs} == {"CustomResourceDefinition"}
    names = {d["metadata"]["name"] for d in docs}
    expected = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in (CHART / "crds").glob("*.yaml")}
    assert names == expected


def test_operator_yaml_is_namespace_rbac_deployment_service():
    docs = [d for d in yaml.safe_load_all((MANIFESTS / "operator.yaml").read_text()) if d]
    assert docs[0] == {"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": "ddpjob-system",
                                    "labels": {"app.kubernetes.io/part-of": "ddpjob",
                                               "pod-security.kubernetes.io/enforce": "restricted"}}}
    assert sorted(d["kind"] for d in docs[1:]) == \
        ["ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount",
         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
         "ValidatingAdmissionPolicyBinding"]
    for d in docs[1:]:
        if d["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                             "ValidatingAdmissionPolicyBinding"):
            assert d["metadata"]["namespace"] == "ddpjob-system", d["kind"]
    # kubectl apply -f manifests/ applies files in name order: the CRDs come first.
    assert sorted(p.name for p in MANIFESTS.glob("*.yaml")) == ["crd.yaml", "operator.yaml"]
