"""Generated reference docs (hack/gen-docs.py, `make docs`) are current: the chart README from
values.yaml's comments, docs/crd-reference.md from the CRD's schema."""
from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_docs", REPO / "hack" / "gen-docs.py")
assert _spec and _spec.loader
gen_docs = importlib.util.module_from_spec(_spec)
sys.modules["gen_docs"] = gen_docs          # dataclasses look their module up there
_spec.loader.exec_module(gen_docs)


@pytest.mark.parametrize("path", sorted(gen_docs.GENERATED, key=str), ids=lambda p: p.name)
def test_generated_doc_is_current(path):
    assert path.exists(), f"{path.relative_to(REPO)} missing: run `make docs`"
    assert path.read_text() == gen_docs.GENERATED[path](), f"{path.relative_to(REPO)} is stale: run `make docs`"


def test_every_value_is_in_the_chart_readme():
    import yaml

    def leaves(node, prefix=""):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                yield from leaves(v, f"{prefix}{k}.")
        else:
            yield prefix.rstrip(".")

    documented = [v.path for v in gen_docs.parse_values((gen_docs.CHART / "values.yaml").read_text())]
    for leaf in leaves(yaml.safe_load((gen_docs.CHART / "values.yaml").read_text())):
        assert any(leaf == d or leaf.startswith(d + ".") for d in documented), leaf


def test_an_undocumented_value_is_an_error():
    text = textwrap.dedent("""\
        image:
          # -- Where the image is.
          repository: r
          tag: ""
    """)
    with pytest.raises(ValueError, match="image.tag has no `# --` description"):
        gen_docs.parse_values(text)


def test_a_documented_map_covers_its_keys_and_a_plain_comment_is_no_description():
    text = textwrap.dedent("""\
        # A section comment, not a description.
        probe:
          # -- Seconds between checks: one per kubelet sync.
          # Continued here.
          periodSeconds: 10
        # -- Requests and limits.
        resources:
          limits: {memory: 1Gi}
    """)
    got = [(v.path, v.description, v.default) for v in gen_docs.parse_values(text)]
    assert got == [("probe.periodSeconds", "Seconds between checks: one per kubelet sync. Continued here.", 10),
                   ("resources", "Requests and limits.", {"limits": {"memory": "1Gi"}})]


def test_crd_reference_links_kubernetes_types_and_has_every_spec_field():
    import yaml

    text = gen_docs.CRD_REFERENCE.read_text()        # current: test_generated_doc_is_current
    crd = yaml.load(gen_docs.CRD.read_text(), Loader=yaml.CSafeLoader)
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for name in spec:
        assert f"| `{name}`" in text, name
    # The API reference of the Kubernetes the CRD's schemas come from (hack/versions.env KUBE_VERSION).
    minor = gen_docs._kube_minor()
    assert f"[PodTemplateSpec](https://kubernetes.io/docs/reference/generated/kubernetes-api/v{minor}/#podtemplatespec-v1-core)" in text
    assert "## `spec.trainer`" in text and "(#spectrainer)" in text
