"""Install like a user, on the real local control plane: helm template/install/upgrade/uninstall,
`kubectl apply -f manifests/`, and the operator running with nothing but the chart's
ServiceAccount token reconciling an example DDPJob."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.support.cluster import OPERATOR_IMAGE_VALUES, wait_crd_established

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ddpjob-operator"
KUBE_VERSION = re.search(r"^KUBE_VERSION=v?(\S+)", (REPO / "hack" / "versions.env").read_text(), re.M).group(1)
GROUP, VERSION, PLURAL = "ddpjob.dev", "v1alpha1", "ddpjobs"


def template(cluster, namespace: str, *sets: str, include_crds: bool = False) -> str:
    args = ["template", "t", str(CHART), "-n", namespace, "--kube-version", KUBE_VERSION]
    args += ["--include-crds"] if include_crds else []
    for s in (*OPERATOR_IMAGE_VALUES, *sets):
        args += ["--set", s]
    return cluster.helm(*args).stdout


def get_json(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


@pytest.fixture(scope="module")
def crds(cluster):
    """The chart's CRDs on the cluster (what `helm install` puts there first; never deleted,
    like Helm never deletes CRDs). Server-side apply: idempotent beside other tests' copies."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    for crd in ("ddpjobs.ddpjob.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"):
        wait_crd_established(cluster, crd)


# --- rendering checked by the API server -----------------------------------------------------

@pytest.mark.parametrize("sets", [
    (),
    ("ha.enabled=true", "replicaCount=2"),
    ("rbac.namespaced=true", "operator.watchNamespaces={NS}"),
    ("ha.enabled=true", "replicaCount=2", "rbac.namespaced=true", "operator.watchNamespaces={NS}"),
], ids=["defaults", "ha", "namespaced", "ha-namespaced"])
def test_helm_template_passes_server_dry_run(cluster, crds, namespace, sets):
    sets = tuple(s.replace("NS", namespace) for s in sets)
    # Pod Security "restricted" on the namespace: the API server warns about any workload whose
    # pods it would refuse (root, privilege escalation, capabilities, seccomp, host paths).
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/warn=restricted")
    rendered = template(cluster, namespace, *sets)
    proc = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
    assert "(server dry run)" in proc.stdout
    assert "PodSecurity" not in proc.stderr, proc.stderr


# --- helm install / upgrade / uninstall -----------------------------------------------------------

def test_helm_install_wait_upgrade_uninstall(cluster, api, crds, helm_release, kit):
    rel = helm_release()          # helm install --wait: the operator pod must become Ready
    dep = get_json(cluster, "-n", rel.namespace, "get", "deployment", rel.fullname)
    assert dep["status"].get("readyReplicas") == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    status = json.loads(cluster.helm("status", rel.name, "-n", rel.namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed" and status["version"] == 1

    # upgrade: a changed value reaches the running Deployment
    cluster.helm("upgrade", rel.name, str(CHART), "-n", rel.namespace, "--reuse-values",
                 "--set", "operator.logLevel=DEBUG", "--set", "operator.scrapeInterval=30",
                 "--wait", "--timeout", "120s", timeout=180)
    dep = get_json(cluster, "-n", rel.namespace, "get", "deployment", rel.fullname)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--log-level=DEBUG" in args and "--scrape-interval=30" in args
    assert dep["metadata"]["generation"] >= 2

    # upgrade to HA: a StatefulSet whose replicas get distinct pod indexes (= peering priorities)
    cluster.helm("upgrade", rel.name, str(CHART), "-n", rel.namespace, "--reuse-values",
                 "--set", "ha.enabled=true", "--set", "replicaCount=2", "--set", f"peering.name={rel.name}",
                 "--wait", "--timeout", "120s", timeout=180)
    assert cluster.kubectl("-n", rel.namespace, "get", "deployment", rel.fullname,
                           check=False).returncode != 0, "the Deployment must be replaced"
    assert get_json(cluster, "get", "clusterkopfpeering", rel.name)["kind"] == "ClusterKopfPeering"

    def indexes():
        pods = get_json(cluster, "-n", rel.namespace, "get", "pods", "-l",
                        f"app.kubernetes.io/instance={rel.name}")["items"]
        ready = [p for p in pods if p["status"].get("phase") == "Running"
                 and not p["metadata"].get("deletionTimestamp")]
        return sorted(p["metadata"]["labels"].get("apps.kubernetes.io/pod-index", "?") for p in ready)
    assert kit.wait_for(lambda: indexes() == ["0", "1"], timeout=60,
                        desc="two HA replicas with pod-index labels 0 and 1")
    assert kit.can_i(cluster, rel.user, "patch", "clusterkopfpeerings.kopf.dev")

    # uninstall removes everything the release made, cluster-scoped RBAC included; CRDs stay
    cluster.helm("uninstall", rel.name, "-n", rel.namespace, "--wait", "--timeout", "60s", timeout=90)
    for kind, ns in (("statefulset", rel.namespace), ("serviceaccount", rel.namespace),
                     ("service", rel.namespace), ("clusterrole", None), ("clusterrolebinding", None)):
        name = rel.fullname + ("-metrics" if kind == "service" else "")
        args = ["get", kind, name] + (["-n", ns] if ns else [])
        assert cluster.kubectl(*args, check=False).returncode != 0, f"{kind}/{name} survived uninstall"
    assert cluster.kubectl("get", "clusterkopfpeering", rel.name, check=False).returncode != 0
    assert cluster.kubectl("get", "crd", "ddpjobs.ddpjob.dev", check=False).returncode == 0


def test_namespaced_install_creates_rbac_only_in_watched_namespaces(cluster, api, crds, helm_release, kit):
    watched = kit.create_namespace(api, prefix="watched-")
    try:
        rel = helm_release("rbac.namespaced=true", f"operator.watchNamespaces={{{watched}}}")
        roles = get_json(cluster, "get", "roles", "-A", "-l", f"app.kubernetes.io/instance={rel.name}")
        assert [r["metadata"]["namespace"] for r in roles["items"]] == [watched]
        crs = get_json(cluster, "get", "clusterroles", "-l", f"app.kubernetes.io/instance={rel.name}")
        assert crs["items"] == []
        notes = cluster.helm("get", "notes", rel.name, "-n", rel.namespace).stdout
        assert f"It watches DDPJobs in: {watched} (namespaced RBAC" in notes, notes
        assert "image localhost/ddpjob/operator:dev (pullPolicy IfNotPresent)" in notes, notes   # the image it means
    finally:
        kit.delete_namespace(api, watched)


# --- plain manifests -----------------------------------------------------------------------------------

def test_kubectl_apply_manifests(cluster, api, crds, kit):
    """`kubectl apply --server-side -f manifests/` installs the same operator; server dry-run then passes too."""
    ns = "ddpjob-system"
    if cluster.kubectl("get", "namespace", ns, check=False).returncode == 0:
        pytest.skip(f"namespace {ns} already exists on this cluster (another install); not touching it")
    try:
        # A server-side dry run cannot create the namespace it would put objects into, so on a
        # fresh cluster only crd.yaml dry-runs cleanly; after the real apply the whole dir does.
        # Server-side: the CRD is larger than client-side apply's last-applied annotation may be.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f",
                        str(REPO / "manifests" / "crd.yaml"))
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "manifests"))
        cluster.kubectl("-n", ns, "rollout", "status", "deployment/ddpjob-operator", "--timeout=120s",
                        timeout=150)
        proc = cluster.kubectl("apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f",
                               str(REPO / "manifests"))
        assert "error" not in proc.stderr.lower(), proc.stderr
        user = f"system:serviceaccount:{ns}:ddpjob-operator"
        assert kit.can_i(cluster, user, "create", "pods", namespace="default")
        assert not kit.can_i(cluster, user, "get", "secrets", namespace=ns)
    finally:
        cluster.kubectl("delete", "-f", str(REPO / "manifests" / "operator.yaml"), "--wait=true",
                        "--ignore-not-found", "--timeout=90s", check=False, timeout=120)
    assert cluster.kubectl("get", "clusterrole", "ddpjob-operator", check=False).returncode != 0


# --- the operator with the chart's ServiceAccount token ------------------------------------------------

LEGIT_403 = (
    # kopf's discovery fallbacks: the chart deliberately grants no namespace or CRD reads.
    "Not enough permissions to list namespaces",
    "Not enough permissions to watch for namespaces",
    "Not enough permissions to watch for resources",
)


# A log line's own timestamp ("23:13:16,403") is not an HTTP status.
_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d+\s")


def forbidden_lines(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if re.search(r"\b403\b|[Ff]orbidden|Not enough permissions", _TIMESTAMP.sub("", line))
            and not any(ok in line for ok in LEGIT_403)]


def test_a_timestamp_ending_in_403_is_not_a_denial():
    log = ("2026-11-23 23:13:16,403 INFO kopf._core.engines.activities: Initial authentication has finished.\n"
           "2026-11-23 23:13:17,001 ERROR kopf: (403) Forbidden: pods is forbidden\n")
    assert forbidden_lines(log) == ["2026-11-23 23:13:17,001 ERROR kopf: (403) Forbidden: pods is forbidden"]


def diag(op) -> str:
    """What to show when a wait fails: RBAC denials first, then the log's tail."""
    text = op.text()
    return "\n".join(["", *forbidden_lines(text)[:5], "--- log tail:", text[-1500:]])


def example_job(namespace: str) -> dict:
    from ddpjob_cli.local import load_job_file

    job = load_job_file(REPO / "examples" / "digits.yaml")
    job["metadata"]["namespace"] = namespace
    # kwok's pods run nothing and this tier provisions no storage: without the checkpoint claim
    # the pods schedule at once (the real-pod tier applies the example with its claim).
    for key in ("volumes", "volumeMounts"):
        job["spec"].pop(key, None)
    return job


def reconcile_example_with_token(cluster, api, kit, tmp_path, rel, job_ns: str, *operator_args: str):
    """Run `ddpjob operator` on this machine as the release's ServiceAccount; it must create the
    Service and pods of examples/digits.yaml, write status, and finish the job."""
    from kubernetes import client

    kubeconfig = kit.token_kubeconfig(cluster, rel, tmp_path / "sa.kubeconfig")
    who = json.loads(cluster.kubectl("--kubeconfig", str(kubeconfig), "auth", "whoami", "-o", "json").stdout)
    assert who["status"]["userInfo"]["username"] == rel.user
    # A marker identity: the events it posts carry it, so the test knows THIS operator (and not
    # another one running against the same cluster) did the work.
    marker = f"sa-operator-{rel.name}"
    op = kit.start_operator(kubeconfig, tmp_path / "operator.log", *operator_args, "--peering=",
                            pod_name=marker)
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    try:
        kit.wait_for(lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{op.health_port}/healthz", timeout=2).status == 200 or op.proc.poll(),
            timeout=60, desc="operator /healthz")
        assert op.proc.poll() is None, op.text()[-3000:]
        job = example_job(job_ns)
        name = job["metadata"]["name"]
        custom.create_namespaced_custom_object(GROUP, VERSION, job_ns, PLURAL, job)
        nodes = job["spec"]["nodes"]

        def pods():
            return core.list_namespaced_pod(job_ns, label_selector=f"ddpjob.dev/job-name={name}").items
        kit.wait_for(lambda: core.read_namespaced_service(name, job_ns), timeout=60,
                     desc=f"Service {name} made by the token-authenticated operator{diag(op)}")
        kit.wait_for(lambda: len([p for p in pods() if p.status.phase == "Running"]) == nodes,
                     timeout=60, desc=f"{nodes} Running pods{diag(op)}")

        def phase():
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, job_ns, PLURAL, name)
            return (obj.get("status") or {}).get("phase")
        kit.wait_for(lambda: phase() == "Running", timeout=60,
                     desc=f"status.phase Running written by the operator{diag(op)}")
        for p in pods():
            kit.set_pod_exit(api, job_ns, p.metadata.name, 0)
        kit.wait_for(lambda: phase() == "Succeeded", timeout=90,
                     desc=f"status.phase Succeeded{diag(op)}")
        # Its Succeeded event (a job's first come-up posts none) follows the status write just seen.
        def mine():
            events = core.list_namespaced_event(job_ns, field_selector=f"involvedObject.name={name}").items
            return [(e.reason, e.reporting_instance) for e in events if e.reporting_instance == marker]
        kit.wait_for(mine, timeout=30, desc=f"the token-authenticated operator's event on the DDPJob{diag(op)}")
        assert op.proc.poll() is None, "operator exited\n" + op.text()[-3000:]
    finally:
        rc = op.stop()
    log = op.text()
    assert not forbidden_lines(log), "RBAC denied the operator something:\n" + "\n".join(forbidden_lines(log))
    assert rc in (0, -15, 143), f"operator exit code {rc}\n{log[-3000:]}"


def test_operator_reconciles_with_the_cluster_mode_service_account(cluster, api, crds, helm_release, kit,
                                                                   namespace, tmp_path):
    rel = helm_release()
    reconcile_example_with_token(cluster, api, kit, tmp_path, rel, namespace, f"--namespace={namespace}")


def test_operator_reconciles_with_the_namespaced_mode_service_account(cluster, api, crds, helm_release, kit,
                                                                      namespace, tmp_path):
    rel = helm_release("rbac.namespaced=true", f"operator.watchNamespaces={{{namespace}}}")
    reconcile_example_with_token(cluster, api, kit, tmp_path, rel, namespace, f"--namespace={namespace}")


def test_ha_peering_with_the_service_account(cluster, api, crds, helm_release, kit, namespace, tmp_path):
    """Two operators with the HA release's token and distinct priorities: both keep alive in the
    chart's KopfPeering, only the higher one reconciles, the other takes over when it stops."""
    from kubernetes import client

    rel = helm_release("ha.enabled=true", "replicaCount=2", "rbac.namespaced=true",
                       f"operator.watchNamespaces={{{namespace}}}", "peering.name=ddpjob-ha")
    kubeconfig = kit.token_kubeconfig(cluster, rel, tmp_path / "sa.kubeconfig")
    custom = client.CustomObjectsApi(api)
    ops = {}
    try:
        for ident, prio in (("replica-high", 10), ("replica-low", 5)):
            ops[ident] = kit.start_operator(kubeconfig, tmp_path / f"{ident}.log", f"--namespace={namespace}",
                                            "--peering=ddpjob-ha", f"--priority={prio}", pod_name=ident)

        def peers():
            obj = custom.get_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings", "ddpjob-ha")
            return sorted((obj.get("status") or {}).keys())
        kit.wait_for(lambda: peers() == ["replica-high", "replica-low"], timeout=60,
                     desc=f"both replicas' keep-alives in KopfPeering ddpjob-ha{diag(ops['replica-low'])}")

        def created_by() -> dict[str, float]:
            """The pods each running replica says it created here (its own pods_created_total)."""
            counts = {}
            for ident, op in ops.items():
                if op.proc.poll() is None:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5).read().decode()
                    series = f'ddpjob_operator_pods_created_total{{namespace="{namespace}"}} '
                    counts[ident] = next((float(ln[len(series):]) for ln in text.splitlines() if ln.startswith(series)), 0.0)
            return counts

        def run_job(job_name: str) -> int:
            job = example_job(namespace)
            job["metadata"]["name"] = job_name
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
            kit.wait_for(lambda: (custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job_name)
                                  .get("status") or {}).get("phase") == "Running",
                         timeout=60, desc=f"{job_name} Running{diag(ops['replica-high'])}{diag(ops['replica-low'])}")
            return job["spec"]["nodes"]

        # Running is written after the pods' creates returned: each replica's counter is final for the job.
        nodes = run_job("first")
        assert created_by() == {"replica-high": nodes, "replica-low": 0}, "only the highest priority may act"

        ops["replica-high"].stop()                     # a graceful exit removes it from the peering
        kit.wait_for(lambda: peers() == ["replica-low"], timeout=60, desc="replica-high left the peering")
        nodes = run_job("second")
        assert created_by() == {"replica-low": nodes}, "the standby takes over"
    finally:
        for op in ops.values():
            op.stop()
    for ident, op in ops.items():
        assert not forbidden_lines(op.text()), f"{ident}: " + "\n".join(forbidden_lines(op.text()))
