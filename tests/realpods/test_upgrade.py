"""Upgrading from the previous release with jobs in flight, on the real nodes, by docs/install.md's own
commands, then rolling back.

Release N-1 (hack/versions.env PREVIOUS_RELEASE) is built from its published source and pushed, with
its own chart, to the local registry (tests/realpods/releases.py); this checkout is released there
with `make release`. N-1's chart is installed from the registry as its users installed it (it had
no default image), watching one namespace (Pod Security `restricted`, like the operator's) with
three jobs: one training on the real nodes (N-1's trainer image), one Pending (it asks for a GPU no
real node has), one Suspended. Then install.md's upgrade block, as written, with the registry's
address and its "From 0.1.0" line: the new operator must take the jobs over with nothing lost (the
training job's pods, attempt, restarts and failures unchanged, its progress written on by the new
operator; the others in their phase), and act on them (the suspended job, resumed, gets its pods).
Then `helm rollback` to N-1, as install.md says for a downgrade: the same again.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import uuid

from tests.realpods.conftest import (
    REAL_NODE_SCHEDULING,
    apply_docs,
    example_docs,
    job_status,
    shared_checkpoint_pv,
    stalled,
    wait_job,
)
from tests.realpods.releases import local_cluster_values
from tests.support.cluster import REPO_ROOT, create_namespace, delete_namespace, wait_crd_established, wait_for
from tests.support.readme import readme_block, readme_line

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}
CRD = "ddpjobs.ddpjob.dev"


def upgrade_commands(release, name: str, namespace: str, workdir) -> list[list[str]]:
    """install.md's upgrade block as written, for this release: the registry instead of ghcr.io, the
    release's name and namespace, the From-0.1.0 values, plain HTTP (a loopback registry), and the
    platform's values the new chart adds (the tenant policy's allowances for the real nodes)."""
    block = readme_block("helm pull oci://", "--reset-then-reuse-values", doc="docs/install.md")
    public = "oci://ghcr.io/ddpjob/charts/ddpjob-operator"
    pull, crd, helm = (shlex.split(readme_line(block, start)) for start in ("helm pull", "kubectl apply", "helm upgrade"))
    assert pull[:3] == ["helm", "pull", public] and crd[:2] == ["kubectl", "apply"] and helm[:4] == [
        "helm", "upgrade", "ddpjob", public], (pull, crd, helm)
    notes = (REPO_ROOT / "docs" / "install.md").read_text()
    from_previous = "--set image.repository=null --set image.tag=null"
    assert from_previous in notes, "install.md's From 0.1.0 note names the values to drop"
    pull[2], helm[2], helm[3] = release.chart, name, release.chart
    for argv in (pull, helm):
        argv[argv.index("--version") + 1] = release.version
        argv.append("--plain-http")
    untar = pull[pull.index("--untardir") + 1]
    assert crd[-1] == f"{untar}/ddpjob-operator/crds/", (crd, untar)
    helm[helm.index("-n") + 1] = namespace
    helm += shlex.split(from_previous) + ["-f", str(local_cluster_values(workdir, keys=("tenantPolicy",))),
                                          "--timeout", "300s"]
    return [pull, crd, helm]


def install_previous_crds(cluster, crds) -> None:
    """Make the previous release's CRDs the installed ones, as its first `helm install` left them:
    exactly its spec, every field owned by manager `helm` (so the upgrade's server-side apply has
    Helm's fields to take over, as a user's has). Replaced whole: a server-side apply would keep the
    fields the current CRD's appliers own."""
    for f in sorted(crds.glob("*.yaml")):
        exists = cluster.kubectl("get", "-f", str(f), "-o", "name", check=False).returncode == 0
        cluster.kubectl("replace" if exists else "create", "--field-manager=helm", "-f", str(f), timeout=120)
    wait_crd_established(cluster, CRD)


def install_previous(cluster, previous, tmp, *, name: str, namespace: str, watch: str) -> None:
    """N-1's chart from the registry, as its users installed it: the image named (its chart had no
    default), on the real nodes (its values knew no tenant allowances), watching `watch`, scraping
    every 3 s, unschedulable after 5 s."""
    sets = [f"image.repository={previous.repo}/operator", f"image.tag={previous.version}",
            f"operator.watchNamespaces[0]={watch}", "operator.scrapeInterval=3", "operator.progressInterval=1",
            "operator.unschedulableTimeout=5"]
    args = ["install", name, previous.chart, "--version", previous.version, "--plain-http", "-n", namespace,
            "-f", str(local_cluster_values(tmp, keys=("nodeSelector", "tolerations"))), "--wait", "--timeout", "300s"]
    for s in sets:
        args += ["--set", s]
    cluster.helm(*args, timeout=360)


def operator_image(cluster, namespace: str) -> str:
    """The image of the operator pod that is running and Ready (one at a time: Recreate)."""
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    ready = [p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
    return ready[0]["spec"]["containers"][0]["image"] if len(ready) == 1 else ""


def pod_uids(cluster, namespace: str, job: str) -> dict[str, str]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"ddpjob.dev/job-name={job}", "-o",
                          "jsonpath={range .items[*]}{.metadata.name}={.metadata.uid}{\"\\n\"}{end}")
    return dict(line.split("=", 1) for line in out.stdout.split())


def kept(st: dict) -> dict:
    """What an operator change must not lose of a job's status."""
    return {k: st.get(k) for k in ("attempt", "restarts", "inPlaceRestarts", "failures", "restartHistory", "startTime",
                                   "masterAddr")}


def test_upgrade_from_the_previous_release_with_jobs_in_flight_then_roll_back(real_cluster, previous_release,
                                                                            checkout_release, tmp_path):
    cluster, previous, current = real_cluster, previous_release, checkout_release
    api = cluster.api()
    op_ns = create_namespace(api, prefix="upg-op-", labels=RESTRICTED)
    ns = create_namespace(api, prefix="upg-job-", labels=RESTRICTED)
    name = f"upg{uuid.uuid4().hex[:6]}"
    try:
        # The previous release's CRD, as its first `helm install` left it: Helm installs crds/ only
        # where there is none, and this cluster has the current one.
        install_previous_crds(cluster, previous.source / "charts" / "ddpjob-operator" / "crds")
        install_previous(cluster, previous, tmp_path, name=name, namespace=op_ns, watch=ns)
        assert operator_image(cluster, op_ns) == previous.operator

        # 1. A job that trains long enough to outlive two operator changes (N-1's trainer image).
        docs = example_docs("digits.yaml", image=previous.trainer)
        job = next(d for d in docs if d["kind"] == "DDPJob")
        job["spec"]["trainer"]["epochs"] = 200
        claim = next(d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim")
        shared_checkpoint_pv(cluster, claim=claim, namespace=ns, tmp=tmp_path)
        # 2. One that stays Pending: a GPU no real node has. 3. One suspended from the start.
        pending = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "pending"},
                   "spec": {"image": previous.trainer, "nodes": 1, "gpusPerNode": 1, "scheduling": REAL_NODE_SCHEDULING}}
        suspended = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "suspended"},
                     "spec": {"image": previous.trainer, "nodes": 1, "suspend": True,
                              "scheduling": {"nodeSelector": {"ddpjob.dev/node-kind": "nowhere"}}}}
        apply_docs(cluster, [*docs, pending, suspended], ns)

        def training_past(step: int):
            return lambda st: st.get("phase") == "Running" and ((st.get("progress") or {}).get("step") or 0) > step
        st = wait_job(cluster, ns, "digits", training_past(0), give_up=stalled, desc="training, step > 0", timeout=600)
        wait_job(cluster, ns, "pending", lambda s: s.get("phase") == "Pending" and any(
            c["type"] == "Unschedulable" and c["status"] == "True" for c in s.get("conditions") or []),
                 desc="Pending and Unschedulable", timeout=120)
        wait_job(cluster, ns, "suspended", lambda s: s.get("phase") == "Suspended", desc="Suspended", timeout=120)
        jobs = ("digits", "pending", "suspended")
        uids = {j: pod_uids(cluster, ns, j) for j in jobs}
        assert [len(uids[j]) for j in jobs] == [2, 1, 0], uids
        before = kept(st)
        phases = {"pending": "Pending", "suspended": "Suspended"}

        def unchanged(after_what: str) -> int:
            """The jobs as they were, the training one still training; its step now."""
            assert {j: pod_uids(cluster, ns, j) for j in jobs} == uids, after_what
            st = job_status(cluster, ns, "digits")
            assert st.get("phase") == "Running" and kept(st) == before, (after_what, st, before)
            assert {j: job_status(cluster, ns, j).get("phase") for j in phases} == phases, after_what
            return (st.get("progress") or {}).get("step") or 0

        # Upgrade, by install.md's commands.
        for argv in upgrade_commands(current, name, op_ns, tmp_path):
            proc = subprocess.run(argv, cwd=tmp_path, env=cluster.env(), capture_output=True, text=True, timeout=400)
            assert proc.returncode == 0, f"{shlex.join(argv)}:\n{proc.stdout}\n{proc.stderr}"
        wait_crd_established(cluster, CRD)
        wait_for(lambda: operator_image(cluster, op_ns) == current.operator, timeout=300,
                 desc=f"the operator of {current.version} running and Ready")
        step = unchanged("after the upgrade")
        # The new operator writes the training job's progress on (its scrapes of the pods N-1 made).
        st = wait_job(cluster, ns, "digits", training_past(step), give_up=stalled,
                      desc=f"progress past step {step} under the new operator", timeout=300)
        assert kept(st) == before, (st, before)
        # ...and acts on them: the suspended job, resumed, gets its pod (Pending: no node matches).
        cluster.kubectl("patch", "ddpj", "suspended", "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": false}}')
        wait_job(cluster, ns, "suspended", lambda s: s.get("phase") == "Pending" and len(pod_uids(cluster, ns, "suspended")) == 1,
                 desc="resumed by the new operator: its pod created", timeout=120)
        uids["suspended"], phases["suspended"] = pod_uids(cluster, ns, "suspended"), "Pending"

        # Rollback (install.md's downgrade): N-1's operator takes the jobs back.
        cluster.helm("rollback", name, "1", "-n", op_ns, "--wait", "--timeout", "300s", timeout=360)
        wait_for(lambda: operator_image(cluster, op_ns) == previous.operator, timeout=300,
                 desc=f"the operator of {previous.version} back, running and Ready")
        step = unchanged("after the rollback")
        wait_job(cluster, ns, "digits", training_past(step), give_up=stalled,
                 desc=f"progress past step {step} under the previous operator again", timeout=300)
    finally:
        cluster.helm("uninstall", name, "-n", op_ns, "--wait", "--timeout", "60s", check=False, timeout=90)
        # Whatever happened, the session's other tests get the current CRDs back.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                        str(REPO_ROOT / "charts" / "ddpjob-operator" / "crds"))
        wait_crd_established(cluster, CRD)
        for n in (ns, op_ns):
            delete_namespace(api, n)
        cluster.kubectl("delete", "pv", f"{ns}-digits-checkpoints", "--wait=false", check=False)
        api.close()
