"""Supported versions are tested versions: every floor or default names what CI runs.

hack/versions.env is the one home of the trainer image's torch and of the control plane's
Kubernetes; the Dockerfile's default base, pyproject's floors, the chart's kubeVersion and the
README derive from it, and this file fails when one of them drifts.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pins() -> dict[str, str]:
    text = (REPO / "hack" / "versions.env").read_text()
    return dict(re.findall(r"^([A-Z_]+)=(\S+)$", text, re.M))


def floors() -> dict[str, str]:
    """pyproject's floors: the core's (the operator's) and the `trainer` extra's (torch's)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["trainer"]
    return {m.group(1): m.group(2) for d in deps if (m := re.match(r"([A-Za-z0-9_.-]+)>=([\w.]+)", d))}


def minor(version: str) -> str:
    return ".".join(version.lstrip("v").split(".")[:2])


def test_the_dockerfiles_default_base_is_the_pinned_torch_image():
    default = re.search(r"^ARG TORCH_IMAGE=(\S+)$", (REPO / "Dockerfile").read_text(), re.M).group(1)
    assert default == pins()["TORCH_IMAGE"]
    assert default.split(":")[1].startswith(pins()["TORCH_VERSION"] + "-")


def test_pyprojects_torch_floors_are_the_images_versions_which_make_test_floor_runs():
    assert minor(floors()["torch"]) == minor(pins()["TORCH_VERSION"])
    assert minor(floors()["torchvision"]) == minor(pins()["TORCHVISION_VERSION"])
    makefile = (REPO / "Makefile").read_text()
    assert "hack/test.sh" in re.search(r"^test:.*$\n(\t.*\n)+", makefile, re.M).group(0)
    assert re.search(r"^\s*make .*test-floor", (REPO / "hack" / "test.sh").read_text(), re.M)


def test_the_trainer_images_mlflow_client_is_the_pin_and_pyprojects_floor_which_make_test_floor_runs():
    pin = pins()["MLFLOW_VERSION"]
    assert floors()["mlflow-skinny"] == pin
    assert re.findall(r"mlflow-skinny==(\S+)", (REPO / "Dockerfile").read_text()) == [pin]
    # make install-floor installs the pinned server too (mlflow requires its own mlflow-skinny).
    assert "mlflow==$$MLFLOW_VERSION" in (REPO / "Makefile").read_text()


def test_the_operators_floors_are_the_versions_its_image_pins():
    pinned = dict(re.findall(r"^([a-z-]+)==(\S+)$", (REPO / "requirements" / "operator.txt").read_text(), re.M))
    for name in ("kopf", "kubernetes"):
        assert floors()[name] == pinned[name], name


def test_the_charts_kubernetes_floor_is_the_oldest_minor_ci_runs():
    chart = (REPO / "charts" / "ddpjob-operator" / "Chart.yaml").read_text()
    floor = re.search(r'^kubeVersion: ">=(\S+?)(-0)?"$', chart, re.M).group(1)
    assert minor(floor) == minor(pins()["KUBE_OLDEST_VERSION"])
    assert pins()["KUBE_OLDEST_STAGING_VERSION"] == "v0." + pins()["KUBE_OLDEST_VERSION"].split(".", 1)[1]
    # make test runs the versioned tests on it: a second control plane at that version.
    test_sh = (REPO / "hack" / "test.sh").read_text()
    assert "hack/test.sh" in re.search(r"^test:.*$\n(\t.*\n)+", (REPO / "Makefile").read_text(), re.M).group(0)
    assert re.search(r"^[^#\n]*DDPJOB_CLUSTER=oldest hack/cluster-up\.sh", test_sh, re.M)
    assert re.search(r"^\s*[^#\n]*\bmake .*test-oldest", test_sh, re.M)


def test_the_readme_states_both_ends_of_the_kubernetes_range_ci_runs():
    readme = (REPO / "README.md").read_text()
    row = f"| Kubernetes | {minor(pins()['KUBE_OLDEST_VERSION'])} to {minor(pins()['KUBE_VERSION'])} "
    assert row in readme, row


def test_the_examples_name_this_releases_trainer_image():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = (REPO / "charts" / "ddpjob-operator" / "Chart.yaml").read_text()
    assert f"\nversion: {version}\n" in chart and f'\nappVersion: "{version}"\n' in chart
    named = {m for f in (REPO / "examples").glob("*.yaml") for m in re.findall(r"ghcr\.io/ddpjob/trainer:(\S+)", f.read_text())}
    assert named == {version}, named


def test_the_readme_states_the_supported_torch_range_from_the_pin():
    readme = (REPO / "README.md").read_text()
    assert f"torch {minor(pins()['TORCH_VERSION'])} (the trainer image, `{pins()['TORCH_IMAGE']}`)" in readme
    assert "make test-floor" in readme
