"""Fixtures for the e2e tier (Helm install, RBAC, Prometheus): the same local control plane as
tests/cluster (see tests/support/cluster.py), plus helm."""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from ddpjob_cli.local import free_port
from tests.support.cluster import (  # noqa: F401  (re-exported for test modules)
    OPERATOR_IMAGE_VALUES,
    REPO_ROOT,
    Cluster,
    create_namespace,
    delete_namespace,
    ensure_cluster,
    set_pod_exit,
    wait_for,
)
from tests.support.network import (
    check_operator_container,
    check_operator_scrape,
    helm_loopback_values,
    with_loopback_scrape,
)

CHART = REPO_ROOT / "charts" / "ddpjob-operator"
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}


def pytest_collection_modifyitems(items):
    """Mark every test in this directory `e2e` (selectable with -m e2e)."""
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def _network_rule(no_kwok_traffic):
    """Every e2e test runs under the network rule's watch (tests/support/fixtures.py)."""


@pytest.fixture(scope="session")
def cluster(cluster) -> Cluster:
    """The shared control plane (tests/support/fixtures.py), which must also have helm linked."""
    assert (cluster.bin_dir / "helm").exists(), f"cluster-up links helm into {cluster.bin_dir}; it is missing"
    return cluster


# --- Helm releases of the chart, ServiceAccount kubeconfigs, an operator process -------------------



@dataclass(frozen=True)
class Release:
    """One installed release of the chart."""

    name: str
    namespace: str

    @property
    def fullname(self) -> str:
        return f"{self.name}-ddpjob-operator"

    @property
    def service_account(self) -> str:
        return self.fullname

    @property
    def user(self) -> str:
        """The operator's identity for `kubectl auth can-i --as`."""
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


def install_release(cluster: Cluster, *sets: str, name: str | None = None, namespace: str,
                    wait: bool = True, allow_pod_scrape: bool = False, chart: Path = CHART) -> Release:
    """`helm install` the chart (release name random unless given) into namespace (created).

    The in-cluster operator scrapes loopback (helm_loopback_values, which `sets` may extend but
    not undo: the installed workload is checked) unless `allow_pod_scrape` (real pods only)."""
    name = name or f"d{uuid.uuid4().hex[:6]}"
    args = ["install", name, str(chart), "-n", namespace, "--create-namespace"]
    if wait:
        args += ["--wait", "--timeout", "120s"]
    for s in (*OPERATOR_IMAGE_VALUES, *sets):       # the image first: a test's own sets may replace it
        args += ["--set", s]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="loopback-scrape-") as values:
        if not allow_pod_scrape:
            yaml.safe_dump(helm_loopback_values(), values)
            values.flush()
            args[3:3] = ["-f", values.name]  # before every --set, which takes precedence
        cluster.helm(*args, timeout=180)
    rel = Release(name, namespace)
    if not allow_pod_scrape:
        check_release_scrapes_loopback(cluster, rel)
    return rel


def check_release_scrapes_loopback(cluster: Cluster, rel: Release) -> None:
    """NetworkRuleError unless every operator container of the release scrapes loopback."""
    for kind in ("deployment", "statefulset"):
        out = cluster.kubectl("get", kind, "-n", rel.namespace, "-l", f"app.kubernetes.io/instance={rel.name}",
                              "-o", "json").stdout
        for obj in json.loads(out)["items"]:
            for c in obj["spec"]["template"]["spec"]["containers"]:
                check_operator_container(c, where=f"release {rel.name}: {kind}/{obj['metadata']['name']}")


def uninstall_release(cluster: Cluster, rel: Release) -> None:
    cluster.helm("uninstall", rel.name, "-n", rel.namespace, "--wait", "--timeout", "60s",
                 check=False, timeout=90)


@pytest.fixture
def helm_release(cluster, api):
    """Factory: helm_release(*sets, watch=[...]) installs the chart into a fresh namespace; every
    release (and the namespaces made for it) is uninstalled/deleted after the test."""
    made: list[tuple[Release, list[str]]] = []

    def install(*sets: str, name: str | None = None, wait: bool = True) -> Release:
        # Pod Security "restricted": the operator pod must be admitted under the strictest profile.
        ns = create_namespace(api, prefix="rel-", labels=RESTRICTED)
        rel = install_release(cluster, *sets, name=name, namespace=ns, wait=wait)
        made.append((rel, [ns]))
        return rel

    yield install
    for rel, namespaces in reversed(made):
        uninstall_release(cluster, rel)
        for ns in namespaces:
            delete_namespace(api, ns)


def can_i(cluster: Cluster, user: str, verb: str, resource: str, *, namespace: str | None = None,
          subresource: str | None = None) -> bool:
    """`kubectl auth can-i VERB RESOURCE --as USER`: a real SubjectAccessReview."""
    args = ["auth", "can-i", verb, resource, f"--as={user}"]
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    if subresource:
        args.append(f"--subresource={subresource}")
    proc = cluster.kubectl(*args, check=False)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl {' '.join(args)}: {proc.stdout} {proc.stderr}"
    return answer == "yes"


def token_kubeconfig(cluster: Cluster, rel: Release, path: Path) -> Path:
    """A kubeconfig that authenticates as the release's ServiceAccount (`kubectl create token`)."""
    token = cluster.kubectl("create", "token", rel.service_account, "-n", rel.namespace,
                            "--duration=1h").stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    ctx_name = admin["current-context"]
    ctx = next(c["context"] for c in admin["contexts"] if c["name"] == ctx_name)
    cl = dict(next(c["cluster"] for c in admin["clusters"] if c["name"] == ctx["cluster"]))
    if "certificate-authority" in cl:          # inline the CA so the file stands alone
        ca = Path(cl.pop("certificate-authority"))
        ca = ca if ca.is_absolute() else Path(cluster.kubeconfig).parent / ca
        cl["certificate-authority-data"] = base64.b64encode(ca.read_bytes()).decode()
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": cl}],
        "users": [{"name": rel.service_account, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "local", "user": rel.service_account,
                                                      "namespace": rel.namespace}}],
        "current-context": "operator",
    }))
    path.chmod(0o600)
    return path


@dataclass
class OperatorProcess:
    """`ddpjob operator` running on this machine; its log in a file."""

    proc: subprocess.Popen
    log: Path
    health_port: int
    metrics_port: int

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def operator_command(kubeconfig: Path, *args: str, health: int, metrics: int, pod_name: str | None = None,
                     allow_pod_scrape: bool = False) -> tuple[list[str], dict[str, str]]:
    """(command, env) of `ddpjob operator ARGS` with only the given kubeconfig's identity; it
    scrapes loopback (kwok pods' addresses are fictitious) unless `allow_pod_scrape` (real pods
    only). NetworkRuleError when ARGS point the scraper elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KUBERNETES_", "DDPJOB_")) and k not in ("POD_NAME", "POD_ID")}
    env["KUBECONFIG"] = str(kubeconfig)
    if pod_name:
        env["POD_NAME"] = env["POD_ID"] = pod_name
    if not allow_pod_scrape:
        env = with_loopback_scrape(env)
    check_operator_scrape(list(args), env, allow_pod_scrape=allow_pod_scrape)
    cmd = [sys.executable, "-m", "ddpjob_cli", "operator", *args,
           f"--health-port={health}", f"--metrics-port={metrics}"]
    return cmd, env


def start_operator(kubeconfig: Path, log: Path, *args: str, pod_name: str | None = None,
                   allow_pod_scrape: bool = False) -> OperatorProcess:
    """Start `ddpjob operator ARGS` (see operator_command); pod_name is what the chart's POD_NAME
    would be (the reportingInstance of the operator's events)."""
    health, metrics = free_port(), free_port()
    cmd, env = operator_command(kubeconfig, *args, health=health, metrics=metrics, pod_name=pod_name,
                                allow_pod_scrape=allow_pod_scrape)
    fh = open(log, "w")  # noqa: SIM115  (owned by the child for its lifetime)
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    fh.close()
    return OperatorProcess(proc, log, health, metrics)


@pytest.fixture(scope="session")
def kit():
    """The helpers above, for test modules (a conftest is not importable by a stable name)."""
    import types

    return types.SimpleNamespace(
        Release=Release, install_release=install_release, uninstall_release=uninstall_release,
        check_release_scrapes_loopback=check_release_scrapes_loopback,
        can_i=can_i, token_kubeconfig=token_kubeconfig, start_operator=start_operator,
        free_port=free_port, create_namespace=create_namespace, delete_namespace=delete_namespace,
        set_pod_exit=set_pod_exit, wait_for=wait_for, chart=CHART, repo=REPO_ROOT)
