"""Releases on the local registry, for the real-pod tier's release and upgrade tests.

The registry is the one the real nodes pull every image from (hack/registry.sh, started by
cluster-up: Debian's docker-registry on a loopback port). `publish_checkout` runs `make release` of
this checkout into it; `publish_previous` builds the previous release (hack/versions.env
PREVIOUS_RELEASE) from its published source, as its tag would build, and pushes its images and its
chart the same way. Both once per session (tests/realpods/conftest.py's fixtures).
"""
from __future__ import annotations

import re
import subprocess
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.cluster import CLUSTER_DIR, REPO_ROOT, Cluster

PINS = dict(re.findall(r"^([A-Z_]+)=(\S+)$", (REPO_ROOT / "hack" / "versions.env").read_text(), re.M))
CHART_NAME = "ddpjob-operator"


def registry_address() -> str:
    """127.0.0.1:PORT of the running local registry."""
    text = (CLUSTER_DIR / "registry.env").read_text()
    return re.search(r"^REGISTRY=(\S+)$", text, re.M).group(1)


@dataclass(frozen=True)
class Release:
    version: str
    repo: str                   # the registry prefix: <registry>/ddpjob
    source: Path = REPO_ROOT    # the tree it was built from

    @property
    def operator(self) -> str:
        return f"{self.repo}/operator:{self.version}"

    @property
    def trainer(self) -> str:
        return f"{self.repo}/trainer:{self.version}"

    @property
    def chart(self) -> str:
        return f"oci://{self.repo}/charts/{CHART_NAME}"


def checkout_version() -> str:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def _run(argv: list[str], *, env: dict[str, str], timeout: float, cwd: Path = REPO_ROOT) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def publish_checkout(cluster: Cluster) -> Release:
    """`make release` of this checkout into the local registry, as a maintainer runs it (a plain-HTTP
    registry; a working tree with uncommitted changes is allowed here because a developer runs
    this tier on one: CI's clone is clean)."""
    release = Release(checkout_version(), f"{registry_address()}/ddpjob")
    env = cluster.env(RELEASE_INSECURE="1", RELEASE_ALLOW_DIRTY="1")
    _run(["make", "--no-print-directory", "release", f"VERSION={release.version}", f"REGISTRY={release.repo}"],
         env=env, timeout=3000)
    return release


def publish_previous(cluster: Cluster, tmp: Path) -> Release:
    """The previous release, built from its source as published (the fixture is `git archive` of
    its tag: tests/unit/test_releases.py) with this checkout's image tooling, its images and its
    own chart pushed to the local registry. Its chart is as it was released: no default image."""
    version = PINS["PREVIOUS_RELEASE"]
    release = Release(version, f"{registry_address()}/ddpjob")
    with tarfile.open(REPO_ROOT / "tests" / "realpods" / "fixtures" / f"ddpjob-{version}-src.tar.gz") as tar:
        tar.extractall(tmp, filter="tar")
    src = tmp / f"ddpjob-{version}"
    release = Release(version, release.repo, src)
    env = cluster.env()
    _run(["bash", str(REPO_ROOT / "hack" / "images.sh"), "release", str(src), version, release.repo, "--insecure"],
         env=env, timeout=3000)
    _run(["helm", "package", str(src / "charts" / CHART_NAME), "-d", str(tmp)], env=env, timeout=120)
    _run(["helm", "push", str(tmp / f"{CHART_NAME}-{version}.tgz"), f"oci://{release.repo}/charts", "--plain-http"],
         env=env, timeout=300)
    return release


def local_cluster_values(tmp: Path, *, keys: tuple[str, ...] = ("nodeSelector", "tolerations", "tenantPolicy")) -> Path:
    """examples/local-cluster/operator-values.yaml without its image (a release installs its own):
    what this cluster's platform sets, the real nodes' label and taint for the operator and, in the
    tenant policy, for the jobs. `keys`: those of its top-level keys an older chart knows."""
    values = yaml.safe_load((REPO_ROOT / "examples" / "local-cluster" / "operator-values.yaml").read_text())
    path = tmp / f"local-cluster-{'-'.join(keys)}.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in values.items() if k in keys}))
    return path


def forget_on_nodes(release: Release) -> None:
    """Remove the release's image names from every real node, so that a pod using them makes its
    kubelet pull them from the registry (a rerun on the same cluster would otherwise find them)."""
    env = dict(re.findall(r"^([A-Za-z_0-9]+)=\"?([^\"\n]*)\"?$", (CLUSTER_DIR / "nodes.env").read_text(), re.M))
    for node in env["REAL_NODE_NAMES"].split():
        sock = env[f"CONTAINERD_SOCK_{node.replace('-', '_')}"]
        for image in (release.operator, release.trainer):
            subprocess.run(["ctr", "-a", sock, "-n", "k8s.io", "images", "rm", image], capture_output=True, timeout=60)


def pulled_images(cluster: Cluster, namespace: str) -> set[tuple[str, str]]:
    """(pod, image) for every image a kubelet pulled for a pod of `namespace` (its `Pulled` events
    that report a pull, not an image already present)."""
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=Pulled", "-o",
                          "jsonpath={range .items[*]}{.involvedObject.name}\t{.message}\n{end}").stdout
    seen = set()
    for line in out.splitlines():
        pod, _, message = line.partition("\t")
        m = re.match(r'Successfully pulled image "([^"]+)"', message)
        if m:
            seen.add((pod, m.group(1)))
    return seen
