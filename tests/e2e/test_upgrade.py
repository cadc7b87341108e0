"""Upgrading from the previous chart with a job running, by docs/install.md's own commands (the CRD
by server-side apply, then `helm upgrade --reset-then-reuse-values`), on the real control plane
(kwok pods): the job keeps running (same pods, same attempt) and a fresh operator started after
the upgrade finishes it, the release's second revision is this checkout's chart with the install's
values, and a DDPJob field the previous CRD refused is accepted afterward. The current CRDs are
applied again at the end whatever happened, for the session's later tests.

The previous chart is a packaged fixture (fixtures/ddpjob-operator-0.1.0-28214e9.tgz: `helm package`
of charts/ddpjob-operator at commit 28214e9), not git history or a registry: CI's clone may be
shallow, no registry publishes the chart yet, and a fixture is exactly the file a user who
installed that chart has. Its CRD lacks, among others, spec.trainer.mlflow.required and
spec.rdma. Replace it by the last released chart's .tgz once releases are published.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import tarfile
from pathlib import Path

from tests.e2e.test_helm import CHART, GROUP, PLURAL, VERSION, example_job
from tests.support.cluster import REPO_ROOT, wait_crd_established
from tests.support.readme import readme_block, readme_line

PREVIOUS_CHART = Path(__file__).parent / "fixtures" / "ddpjob-operator-0.1.0-28214e9.tgz"
CRD = "ddpjobs.ddpjob.dev"


def upgrade_commands(release: str, namespace: str) -> list[list[str]]:
    """install.md's upgrade block, as written; only the release's name and namespace differ."""
    block = readme_block("kubectl apply --server-side --force-conflicts", "--reset-then-reuse-values",
                         doc="docs/install.md")
    crd, helm = (shlex.split(readme_line(block, start)) for start in ("kubectl apply", "helm upgrade"))
    assert crd[-2:] == ["-f", "charts/ddpjob-operator/crds/"], crd
    assert helm[:4] == ["helm", "upgrade", "ddpjob", "charts/ddpjob-operator"] and "-n" in helm, helm
    helm[2] = release
    helm[helm.index("-n") + 1] = namespace
    return [crd, helm]


def install_previous_crds(cluster, into: Path) -> None:
    """Make the previous chart's CRDs the installed ones, as its first `helm install` left them:
    exactly its spec, every field owned by manager `helm` (so the upgrade's server-side apply has
    Helm's fields to take over, as a user's has). Created if absent, else replaced whole: a
    server-side apply would keep the fields the current CRD's appliers own (the new schema), and
    `helm show crds` joins the files without `---`, so a YAML parser sees only the last CRD."""
    with tarfile.open(PREVIOUS_CHART) as tgz:
        members = [m for m in tgz.getmembers() if m.isfile() and m.name.startswith("ddpjob-operator/crds/")]
        tgz.extractall(into, members=members, filter="data")
    files = sorted((into / "ddpjob-operator" / "crds").glob("*.yaml"))
    assert CRD in {f.name.removesuffix(".yaml") for f in files}, files
    for f in files:
        exists = cluster.kubectl("get", "-f", str(f), "-o", "name", check=False).returncode == 0
        cluster.kubectl("replace" if exists else "create", "--field-manager=helm", "-f", str(f))


def new_field_job(namespace: str) -> dict:
    job = example_job(namespace)
    job["metadata"]["name"] = "after-upgrade"
    job["spec"]["trainer"]["mlflow"] = {"trackingUri": "http://mlflow.invalid:5000", "required": True}
    return job


def test_upgrade_from_the_previous_chart_with_a_job_running(cluster, api, kit, namespace, tmp_path):
    from kubernetes import client

    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    rel_ns = kit.create_namespace(api, prefix="rel-", labels={"pod-security.kubernetes.io/enforce": "restricted"})
    rel = None
    ops = []

    def start_operator(log: str):
        # The checkout's operator on this machine stands in for each release's (the in-cluster
        # pods are kwok's and run nothing); stopped before `helm upgrade` and started after it,
        # as the chart's Recreate strategy replaces the pod, so the new one takes over mid-job.
        ops.append(kit.start_operator(Path(cluster.kubeconfig), tmp_path / log, f"--namespace={namespace}",
                                      "--peering="))
        return ops[-1]

    def dry_run(job: dict) -> subprocess.CompletedProcess:
        return cluster.kubectl("apply", "--dry-run=server", "-f", "-", check=False, input=json.dumps(job))

    try:
        # A cluster that installed the previous chart: its CRDs, its release.
        install_previous_crds(cluster, tmp_path / "previous")
        wait_crd_established(cluster, CRD)
        # The API server serves a changed schema a moment after the CRD changes: wait for it.
        kit.wait_for(lambda: "required" in dry_run(new_field_job(namespace)).stderr, timeout=30,
                     desc="the previous CRD refuses spec.trainer.mlflow.required")
        rel = kit.install_release(cluster, namespace=rel_ns, chart=PREVIOUS_CHART)

        op = start_operator("operator-before.log")
        job = example_job(namespace)
        name = job["metadata"]["name"]
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)

        def pods():
            return core.list_namespaced_pod(namespace, label_selector=f"ddpjob.dev/job-name={name}").items

        def status() -> dict:
            return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name).get("status") or {}

        nodes = job["spec"]["nodes"]
        kit.wait_for(lambda: len([p for p in pods() if p.status.phase == "Running"]) == nodes
                     and status().get("phase") == "Running", timeout=90,
                     desc=f"{name} Running on {nodes} pods\n{op.text()[-1500:]}")
        before = sorted(p.metadata.uid for p in pods())

        for argv in upgrade_commands(rel.name, rel.namespace):  # as a user runs them, from the checkout
            if argv[0] == "helm":
                op.stop()
            proc = subprocess.run(argv, cwd=REPO_ROOT, env=cluster.env(), capture_output=True, text=True, timeout=240)
            assert proc.returncode == 0, f"{shlex.join(argv)}:\n{proc.stdout}\n{proc.stderr}"
        op = start_operator("operator-after.log")
        wait_crd_established(cluster, CRD)
        kit.check_release_scrapes_loopback(cluster, rel)
        history = json.loads(cluster.helm("history", rel.name, "-n", rel.namespace, "-o", "json").stdout)
        assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"), (2, "deployed")], history
        manifests = [cluster.helm("get", "manifest", rel.name, "-n", rel.namespace, f"--revision={r}").stdout
                     for r in (1, 2)]
        assert manifests[0] != manifests[1], "the upgrade rendered this checkout's chart, not the previous one"
        assert json.loads(cluster.helm("get", "values", rel.name, "-n", rel.namespace, "-o", "json").stdout)[
            "image"]["repository"], "--reset-then-reuse-values kept the image the install set"
        managers = {m["manager"] for m in json.loads(cluster.kubectl("get", "crd", CRD, "-o", "json", "--show-managed-fields").stdout)[
            "metadata"]["managedFields"]}
        assert "kubectl" in managers, managers

        # The new CRD's fields are accepted...
        kit.wait_for(lambda: dry_run(new_field_job(namespace)).returncode == 0, timeout=30,
                     desc=f"the new CRD accepts spec.trainer.mlflow.required: {dry_run(new_field_job(namespace)).stderr}")
        # ...and the job went on through it: the same pods, no restart, finished by the new operator.
        assert sorted(p.metadata.uid for p in pods()) == before
        st = status()
        assert (st.get("phase"), st.get("attempt", 0), st.get("restarts", 0)) == ("Running", 0, 0), st
        for p in pods():
            kit.set_pod_exit(api, namespace, p.metadata.name, 0)
        kit.wait_for(lambda: status().get("phase") == "Succeeded", timeout=90,
                     desc=f"{name} Succeeded after the upgrade\n{op.text()[-1500:]}")
        assert sorted(p.metadata.uid for p in pods()) == before
    finally:
        for op in ops:
            op.stop()
        # Whatever happened, the session's other tests get the current CRDs back.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
        wait_crd_established(cluster, CRD)
        if rel is not None:
            kit.uninstall_release(cluster, rel)
        kit.delete_namespace(api, rel_ns)
