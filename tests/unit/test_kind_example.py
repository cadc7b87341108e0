"""docs/install.md's kind block, as far as this machine allows (no Docker, no kind): its `helm install`
line rendered as written (the checkout's chart for the OCI one), the images being the release's,
and examples/digits-kind.yaml fitting a stock kind cluster (one node; ReadWriteOnce volumes only)
while staying examples/digits.yaml's job."""
from __future__ import annotations

import shlex

import pytest
import yaml

from tests.support.readme import readme_block, readme_line
from tests.unit.test_chart import CHART, HELM, KUBE_VERSION, helm

REPO = CHART.parents[1]
BLOCK = ("kind create cluster", "examples/digits-kind.yaml")


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((REPO / "examples" / name).read_text()) if d]


def ddpjob(name: str) -> dict:
    (job,) = [d for d in docs(name) if d["kind"] == "DDPJob"]
    return job


@pytest.mark.skipif(HELM is None, reason="no helm binary: `make build-cluster` builds it")
def test_the_kind_blocks_helm_install_renders_the_releases_images():
    """The block installs this checkout's release from its OCI chart: rendered from the checkout's
    chart (the same chart make release packages, its default image the release's), the operator
    and the example's trainer are that release's images, which a kind node pulls."""
    block = readme_block(*BLOCK, doc="docs/install.md")
    argv = shlex.split(readme_line(block, "helm install"))
    assert argv[:4] == ["helm", "install", "ddpjob", "oci://ghcr.io/ddpjob/charts/ddpjob-operator"], argv
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert argv[argv.index("--version") + 1] == chart["version"], argv
    # helm install's flags that template lacks or that need a cluster
    args = [a for a in argv[4:] if a not in ("--create-namespace", "--wait")]
    rendered = [d for d in yaml.safe_load_all(helm("template", "ddpjob", str(CHART), "--kube-version", KUBE_VERSION,
                                                   *args).stdout) if d]
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"ghcr.io/ddpjob/operator:{chart['appVersion']}"
    assert ddpjob("digits-kind.yaml")["spec"]["image"] == f"ghcr.io/ddpjob/trainer:{chart['appVersion']}"
    assert readme_line(block, "kubectl apply") == "kubectl apply -f examples/digits-kind.yaml"


def test_the_kind_example_needs_one_node_and_no_readwritemany_volume():
    from ddpjob_cli.local import validate
    from ddpjob_operator.builders.pods import render_pod

    claims = [d for d in docs("digits-kind.yaml") if d["kind"] == "PersistentVolumeClaim"]
    assert claims and all(c["spec"]["accessModes"] == ["ReadWriteOnce"] for c in claims)
    job = validate(ddpjob("digits-kind.yaml"))
    for rank in range(job.spec.nodes):
        spec = render_pod(job, rank)["spec"]
        hard = [c for c in spec.get("topologySpreadConstraints") or []
                if c["topologyKey"] == "kubernetes.io/hostname" and c["whenUnsatisfiable"] == "DoNotSchedule"]
        assert not hard, hard  # a soft spread (ScheduleAnyway) still packs onto one node
        assert "podAntiAffinity" not in (spec.get("affinity") or {})


def test_the_kind_example_is_digits_with_only_the_claims_mode_and_packing_changed():
    kind, full = ddpjob("digits-kind.yaml"), ddpjob("digits.yaml")
    assert kind["spec"].pop("scheduling") == {"onePodPerNode": False}
    assert kind == full
    (kind_claim,), (claim,) = ([d for d in docs(n) if d["kind"] == "PersistentVolumeClaim"]
                               for n in ("digits-kind.yaml", "digits.yaml"))
    assert kind_claim["spec"].pop("accessModes") == ["ReadWriteOnce"] and claim["spec"].pop("accessModes")
    assert kind_claim == claim
