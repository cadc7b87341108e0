"""Generated docs (hack/gen-docs.py, `make docs`) are current: the chart README from values.yaml's
comments, docs/crd-reference.md from the CRD's schema, and every figure the README and docs/ quote
from its committed result; and no number that looks measured stands there unmarked."""
from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
gen_docs = load_script("gen_docs", "hack/gen-docs.py")


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


# ---- figures: the numbers the README and docs/ quote from bench/results/ --------------------------

DOCS = gen_docs.hand_written_docs()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_marked_figure_is_what_its_result_says(path):
    text = path.read_text()
    want = gen_docs.fill_figures(text)
    stale = [f"fig:{m['key']}: the doc says {m['text']!r}, {gen_docs.FIGURES[m['key']].sources()} says {w['text']!r}"
             for m, w in zip(gen_docs.FIG.finditer(text), gen_docs.FIG.finditer(want)) if m["text"] != w["text"]]
    assert not stale, f"{path.relative_to(REPO)} quotes stale figures (run `make docs`):\n" + "\n".join(stale)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_a_number_that_looks_measured_is_marked_or_a_setting(path):
    found = gen_docs.unmarked_figures(path.read_text())
    assert not found, (f"{path.relative_to(REPO)}: numbers that look measured, neither marked as a figure from "
                       "bench/results/ (hack/gen-docs.py FIGURES) nor a setting (NOT_MEASURED): "
                       + ", ".join(f"line {n}: {t!r}" for n, t in found))


def test_every_figure_and_every_exception_is_used():
    texts = "\n".join(p.read_text() for p in DOCS)
    quoted = {m["key"] for m in gen_docs.FIG.finditer(texts)}
    assert set(gen_docs.FIGURES) - quoted == set(), "figures no doc quotes"
    prose = gen_docs.prose(texts)
    assert [t for t in gen_docs.NOT_MEASURED if t not in prose] == [], "NOT_MEASURED entries no doc needs"


def test_every_figure_renders_from_a_committed_source():
    tracked = set(subprocess.run(["git", "-C", str(REPO), "ls-files", "bench/results", "hack/versions.env"],
                                 capture_output=True, text=True, check=True).stdout.split())
    for key, fig in gen_docs.FIGURES.items():
        assert fig.render(), key
        for source in fig.sources():
            path = source if isinstance(fig, gen_docs.Pin) else f"bench/results/{source}"
            assert path in tracked, f"fig:{key}: {path} is not committed"


def test_an_unknown_figure_is_an_error_naming_it():
    with pytest.raises(KeyError, match="fig:no.such is not in hack/gen-docs.py FIGURES"):
        gen_docs.fill_figures("took <!-- fig:no.such -->4 s<!-- /fig -->")


def test_make_docs_rewrites_a_stale_figure_and_nothing_else():
    key = "recovery.inplace.median"
    text = f"In place: <!-- fig:{key} -->9.9 s<!-- /fig --> (was 9.9 s)."
    out = gen_docs.fill_figures(text)
    assert out == text.replace("-->9.9 s<", f"-->{gen_docs.FIGURES[key].render()}<")


@pytest.mark.parametrize("prose, found", [
    # measured-looking: units of time, size and share, decimal ratios, bare decimals, durations in words
    ("steps again 9.9 s after the kill", ["9.9 s"]),
    ("the build takes 10.5 min and 6 GB", ["10.5 min", "6 GB"]),
    ("cost the loop 21 % (0.785)", ["21 %", "0.785"]),
    ("it creates 2.9x slower; 4.0× with it", ["2.9x", "4.0×"]),
    ("a ratio of 1.037, 0.959-1.123", ["1.037", "0.959"]),       # a range: its first number
    ("about 100 MB of memory, about a minute", ["100 MB", "about a minute"]),
    ("in 27 s, 3-5 ms each", ["27 s", "3-5 ms"]),
    ("took 4.33s", ["4.33s"]),
    # not: versions, code, marked figures, products, quoted messages, counts
    ("torch 2.8 to 2.15 on Kubernetes 1.32 and v0.16", []),
    ("run `sleep 30 s` or\n```sh\nwait 5 s\n```", []),
    ("<!-- fig:recovery.inplace.median -->4.33 s<!-- /fig -->", []),
    ("3 x 7 ms", ["7 ms"]),
    ("20 × the median step time", []),
    ('"no rank advanced for 31s"', []),
    ("8 ranks of 64 samples, 2 pods", []),
])
def test_what_looks_measured(prose, found):
    got = [t for _, t in gen_docs.unmarked_figures(prose)]
    assert [t for t in got if t not in gen_docs.NOT_MEASURED] == found
