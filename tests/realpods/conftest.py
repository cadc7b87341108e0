"""Fixtures for the real-pod tier: DDPJobs that really train in pods on the real nodes of the local
cluster (hack/nodes-up.sh: containerd + kubelet per node, CoreDNS), with the project's own images
(hack/images.sh: localhost/ddpjob/{operator,trainer}:dev) and the operator installed by Helm,
in-cluster, from its image. Nothing here points the operator at a URL template: it scrapes the
pods' own addresses, which live on the nodes' bridges (10.248.<node>.0/24) that this run created.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import REPO_ROOT, Cluster, create_namespace, delete_namespace, wait_for
from tests.support.readme import readme_block, readme_line
from tests.support.status import condition

CHART = REPO_ROOT / "charts" / "ddpjob-operator"
EXAMPLES = REPO_ROOT / "examples"
OPERATOR_IMAGE = "localhost/ddpjob/operator:dev"
TRAINER_IMAGE = "localhost/ddpjob/trainer:dev"
REAL_NODE_LABEL = "ddpjob.dev/node-kind"
# The chart's operator pods (part-of is on the chart's objects, not on its pod template).
OPERATOR_PODS = "app.kubernetes.io/name=ddpjob-operator,app.kubernetes.io/component=operator"
REAL_NODE_TAINT = "ddpjob.dev/real-node"
# What a test job needs to land on the real nodes (they are tainted so kwok-tier jobs never do).
REAL_NODE_SCHEDULING = {
    "nodeSelector": {REAL_NODE_LABEL: "real"},
    "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
}


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/realpods/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.realpods)
            # A first test may pay for the image build (make test builds them before pytest, a
            # direct pytest run does it here) and a full training run on a loaded 2-core machine.
            if not item.get_closest_marker("timeout"):
                item.add_marker(pytest.mark.timeout(2400))


# Set on a test item whose call phase failed (pytest_runtest_makereport below).
_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when == "call" and report.failed:
        item.stash[_CALL_FAILED] = True


@pytest.fixture(autouse=True)
def free_the_real_nodes_after_a_failure(request):
    """A failed test's jobs are deleted, and their pods waited out, before the next test starts.
    A job left behind (held by a debug knob the failed test never released, or still retrying)
    keeps its pods' CPU requests on the two real nodes, and every later test's pods stay Pending:
    stop 59's CI, where the restart test failed before its release and the elastic and upgrade
    tests then timed out (600 s each) waiting for their jobs to train."""
    yield
    if not request.node.stash.get(_CALL_FAILED, False) or "namespaces" not in request.fixturenames:
        return
    cluster, made = request.getfixturevalue("real_cluster"), request.getfixturevalue("namespaces")
    for ns in made.values():
        cluster.kubectl("delete", "ddpj", "--all", "-n", ns, "--wait=false", check=False)
    for ns in made.values():
        cluster.kubectl("wait", "--for=delete", "pod", "-l", "ddpjob.dev/job-name", "-n", ns, "--timeout=300s",
                        check=False, timeout=330)


def real_nodes(cluster: Cluster) -> list[str]:
    out = cluster.kubectl("get", "nodes", "-l", f"{REAL_NODE_LABEL}=real", "-o",
                          "jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}")
    return [line.split("=")[0] for line in out.stdout.split() if line.endswith("=True")]


@pytest.fixture(scope="session")
def real_cluster(cluster) -> Cluster:
    """The shared cluster, which must have two Ready real nodes and our images imported into them."""
    if os.environ.get("DDPJOB_REAL_NODES") == "0":
        pytest.skip("DDPJOB_REAL_NODES=0: the cluster was started without real nodes")
    nodes = real_nodes(cluster)
    assert len(nodes) >= 2, (
        f"the real-pod tier needs 2 Ready real nodes (label {REAL_NODE_LABEL}=real), found {nodes}: "
        "start the cluster with DDPJOB_REAL_NODES=2 make cluster-up")
    # Idempotent and cached by a hash of the inputs: builds/imports only what changed.
    proc = subprocess.run(["bash", str(REPO_ROOT / "hack" / "images.sh"), "all"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, f"hack/images.sh all failed:\n{proc.stderr[-4000:]}"
    return cluster


@pytest.fixture(scope="session")
def checkout_release(real_cluster):
    """This checkout released (`make release`) into the local registry, once per session."""
    from tests.realpods.releases import publish_checkout

    return publish_checkout(real_cluster)


@pytest.fixture(scope="session")
def previous_release(real_cluster, tmp_path_factory):
    """The previous release (hack/versions.env PREVIOUS_RELEASE), built from its source and
    published to the local registry, once per session."""
    from tests.realpods.releases import publish_previous

    return publish_previous(real_cluster, tmp_path_factory.mktemp("previous-release"))


# The real-pod walkthrough (docs/development.md, The examples in real pods): the tier installs the
# operator and applies digits with its lines.
README_BLOCK = ("make images", "examples/local-cluster")
WALKTHROUGH = "docs/development.md"


def helm_install_operator(cluster: Cluster, *, namespace: str, watch: list[str], name: str) -> None:
    """The chart installed by the walkthrough's own `helm install` line (the local image, on the real
    nodes: examples/local-cluster/operator-values.yaml); only the release's name and namespace
    differ, and it watches this tier's namespaces, scraping every 3 s and writing each scrape's progress."""
    argv = shlex.split(readme_line(readme_block(*README_BLOCK, doc=WALKTHROUGH), "helm install"))
    assert argv[:4] == ["helm", "install", "ddpjob", "charts/ddpjob-operator"] and "-n" in argv, argv
    argv[2] = name
    argv[argv.index("-n") + 1] = namespace
    sets = ["operator.scrapeInterval=3", "operator.progressInterval=1"] + [f"operator.watchNamespaces[{i}]={ns}" for i, ns in enumerate(watch)]
    args = argv[1:] + ["--wait", "--timeout", "180s"]
    for s in sets:
        args += ["--set", s]
    cluster.helm(*args, timeout=240)


def apply_digits_as_the_readme_does(cluster: Cluster, namespace: str) -> Path:
    """The walkthrough's two lines that put examples/digits.yaml on the real nodes, in `namespace`
    instead of `default`; returns the directory of its checkpoint volume."""
    block = readme_block(*README_BLOCK, doc=WALKTHROUGH)
    volumes = shlex.split(readme_line(block, "hack/local-volumes.sh"))
    assert volumes[1] == "default", volumes
    volumes[1] = namespace
    subprocess.run(volumes, cwd=REPO_ROOT, env=cluster.env(), check=True, capture_output=True, timeout=120)
    apply = readme_line(block, "kubectl kustomize")
    tail = "| kubectl apply -f -"
    assert apply.endswith(tail), apply
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", f"{apply[:-len(tail)]}| kubectl apply -n {shlex.quote(namespace)} -f -"],
                          cwd=REPO_ROOT, env=cluster.env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{apply}:\n{proc.stdout}\n{proc.stderr}"
    return REPO_ROOT / ".cache" / "cluster" / "volumes" / namespace


# One namespace per test that runs a job; one in-cluster operator (session-wide) watches them all.
JOB_NAMESPACES = ("digits", "restart", "elastic", "custom", "nodeloss", "template", "features", "perstep")


class TierNamespaces(dict):
    """{purpose: namespace}, and where the operator that watches them runs (`operator_namespace`)."""

    operator_namespace: str


@pytest.fixture(scope="session")
def namespaces(real_cluster) -> TierNamespaces:
    """{purpose: namespace}, watched by the operator that the chart installs from our image."""
    api = real_cluster.api()
    made = TierNamespaces((k, create_namespace(api, prefix=f"real-{k}-")) for k in JOB_NAMESPACES)
    # Random release name: its ClusterRole and binding are cluster-wide, and another session
    # (a developer's run beside CI's) may have a release of its own.
    op_ns, release = f"ddpjob-op-{uuid.uuid4().hex[:6]}", f"op{uuid.uuid4().hex[:6]}"
    made.operator_namespace = op_ns
    helm_install_operator(real_cluster, namespace=op_ns, watch=list(made.values()), name=release)
    yield made
    if os.environ.get("DDPJOB_KEEP_REALPODS"):  # leave everything for a person to look at
        return
    real_cluster.helm("uninstall", release, "-n", op_ns, "--wait", "--timeout", "60s", check=False, timeout=90)
    for ns in [*made.values(), op_ns]:
        delete_namespace(api, ns)
    # The checkpoint PVs (cluster-scoped, Released once their claims went with the namespaces).
    pvs = real_cluster.kubectl("get", "pv", "-l", "ddpjob.dev/test=true", "-o", "name", check=False).stdout.split()
    pvs += real_cluster.kubectl("get", "pv", "-l", "ddpjob.dev/local-volume=true", "-o", "name",
                                check=False).stdout.split()
    mine = [pv for pv in pvs if any(pv.split("/", 1)[1].startswith((f"{ns}-", f"local-{ns}-"))
                                    for ns in made.values())]
    if mine:
        real_cluster.kubectl("delete", *mine, "--wait=false", check=False)
    api.close()


def example_docs(name: str, *, image: str = TRAINER_IMAGE) -> list[dict]:
    """examples/NAME.yaml as a user applies it; only the DDPJob's image is swapped for the local
    one, its pods are pointed at the real nodes (which carry a taint the example cannot know) and
    a failed rank's traceback is kept in status.failures (logTailInStatus), so a test that fails
    on a restart it did not expect prints why the rank died."""
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    for d in docs:
        if d.get("kind") == "DDPJob":
            spec = d["spec"]
            spec["image"] = image
            sched = spec.setdefault("scheduling", {})
            sched.setdefault("nodeSelector", {}).update(REAL_NODE_SCHEDULING["nodeSelector"])
            sched.setdefault("tolerations", []).extend(REAL_NODE_SCHEDULING["tolerations"])
            spec.setdefault("failurePolicy", {})["logTailInStatus"] = True
    return docs


def apply_docs(cluster: Cluster, docs: list[dict], namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(docs))


def shared_checkpoint_pv(cluster: Cluster, *, claim: str, namespace: str, tmp: Path) -> Path:
    """A hostPath PV pre-bound to CLAIM: both real nodes are this one VM, so the directory is shared
    the way an RWX volume (NFS, CephFS, EFS) is shared on a real cluster."""
    path = tmp / f"pv-{claim}"
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o1777)  # the trainer runs as uid 10001; hostPath volumes ignore fsGroup
    pv = {"apiVersion": "v1", "kind": "PersistentVolume",
          "metadata": {"name": f"{namespace}-{claim}", "labels": {"ddpjob.dev/test": "true"}},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                   "storageClassName": "", "persistentVolumeReclaimPolicy": "Retain",
                   "claimRef": {"namespace": namespace, "name": claim},
                   "hostPath": {"path": str(path), "type": "Directory"}}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pv))
    return path


def job_status(cluster: Cluster, namespace: str, name: str) -> dict:
    out = cluster.kubectl("get", "ddpj", name, "-n", namespace, "-o", "yaml").stdout
    return yaml.safe_load(out).get("status") or {}


def wait_job(cluster: Cluster, namespace: str, name: str, until, *, desc: str, timeout: float,
             give_up=lambda st: False) -> dict:
    """The job's status once until(status) holds; fails at once when give_up(status) does. On
    failure the namespace's pods, events and logs are printed first, so a CI failure says why."""
    started = time.monotonic()
    polls = iter(range(1 << 30))

    def done():
        st = job_status(cluster, namespace, name)
        if until(st):
            return "ok", st
        if give_up(st):
            return f"ended before {desc}", st
        # Without these a broken operator costs every test its whole timeout (stop 21's CI).
        if not st.get("phase") and time.monotonic() - started > NO_STATUS_GRACE_S:
            return f"has no status {NO_STATUS_GRACE_S} s after it was created: the operator is not reconciling", st
        # Every 10th poll: a kubectl per second would take CPU from the training it waits for.
        if next(polls) % 10 == 9 and (crashlooping := operator_crashlooping(cluster)):
            return f"cannot get there: the operator is in CrashLoopBackOff ({crashlooping})", st
        return None
    try:
        outcome, st = wait_for(done, timeout=timeout, desc=f"DDPJob {namespace}/{name}: {desc}", interval=1)
        assert outcome == "ok", f"DDPJob {namespace}/{name} {outcome}: {st}"
        return st
    except AssertionError:
        print(diagnose(cluster, namespace))
        raise


NO_STATUS_GRACE_S = 180


def operator_crashlooping(cluster: Cluster) -> str:
    """The in-cluster operator pods whose container is waiting in CrashLoopBackOff, by name."""
    out = cluster.kubectl("get", "pods", "-A", "-l", OPERATOR_PODS, "-o",
                          "jsonpath={range .items[*]}{.metadata.name}={.status.containerStatuses[*].state.waiting.reason}{\"\\n\"}{end}",
                          check=False).stdout
    return " ".join(line.split("=")[0] for line in out.split() if line.endswith("=CrashLoopBackOff"))


def stalled(st: dict) -> bool:
    return (condition(st, "Stalled") or {}).get("status") == "True"


def wait_phase(cluster: Cluster, namespace: str, name: str, phases: set[str], *, timeout: float) -> dict:
    """The status once the phase is one of `phases`; a job the operator calls Stalled (its hang
    timeout passed) fails the wait at once instead of at `timeout`."""
    return wait_job(cluster, namespace, name, lambda st: st.get("phase") in phases, give_up=stalled,
                    desc=f"phase in {sorted(phases)}", timeout=timeout)


def diagnose(cluster: Cluster, namespace: str) -> str:
    """What a user would look at when a job is stuck: the job, its pods, events, pod logs, the
    jobs' status (conditions, failures with the failed ranks' tracebacks), the operator's log."""
    parts = []
    for args in (("get", "ddpj,pods,svc", "-o", "wide"), ("get", "events", "--sort-by=.lastTimestamp")):
        parts.append(cluster.kubectl(*args, "-n", namespace, check=False).stdout)
    pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "name", check=False).stdout.split()
    for p in pods:
        parts.append(f"--- logs {p}\n" + cluster.kubectl("logs", "-n", namespace, p, "--tail=30",
                                                         check=False).stdout)
    jobs = yaml.safe_load(cluster.kubectl("get", "ddpj", "-n", namespace, "-o", "yaml", check=False).stdout or "{}")
    for job in (jobs or {}).get("items") or []:
        parts.append(f"--- status ddpjob/{job['metadata']['name']}\n" + yaml.safe_dump(job.get("status") or {}))
    ops = cluster.kubectl("get", "pods", "-A", "-l", OPERATOR_PODS, "-o",
                          "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name} {end}", check=False)
    for ref in ops.stdout.split():
        op_ns, op_pod = ref.split("/", 1)
        parts.append(f"--- operator log {ref} (tail)\n" + cluster.kubectl(
            "logs", "-n", op_ns, op_pod, "--tail=60", check=False).stdout)
    return "\n".join(parts)


def pod_nodes(cluster: Cluster, namespace: str, job: str) -> dict[str, str]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"ddpjob.dev/job-name={job}", "-o",
                          "jsonpath={range .items[*]}{.metadata.name}={.spec.nodeName}{\"\\n\"}{end}")
    return dict(line.split("=", 1) for line in out.stdout.split())


def exec_kill_trainer(cluster: Cluster, namespace: str, pod: str, *, agent: bool = False) -> float:
    """SIGKILL the pod's training worker processes (not torchrun's agent, not the launcher): a
    rank dying mid-step the way an OOM kill or a segfault would. `agent`: torchrun's agent
    instead (its pod fails: the launcher ends with it). Returns the Unix time of the kill (the
    pods' clock is this machine's)."""
    which = ("b'ddpjob_trainer.agent' in cmd" if agent else
             "b'ddpjob_trainer' in cmd and b'ddpjob_trainer.agent' not in cmd and b'ddpjob_trainer.launch' not in cmd")
    code = ("import os, signal, time\n"
            "for p in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try: cmd = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')\n"
            "    except OSError: continue\n"
            f"    if {which}:\n"
            "        print('killed', p, 'at', time.time()); os.kill(int(p), signal.SIGKILL)\n")
    out = cluster.kubectl("exec", "-n", namespace, pod, "--", "python", "-c", code, timeout=60)
    killed = [line.split() for line in out.stdout.splitlines() if line.startswith("killed ")]
    assert killed, f"no {'agent' if agent else 'trainer worker'} found in {pod}: {out.stdout} {out.stderr}"
    return min(float(words[-1]) for words in killed)


def operator_metrics(cluster: Cluster, namespace: str) -> str:
    """The /metrics text of the operator pod in `namespace` (the chart's metrics port), read through
    the API server's proxy to the pod's own address on the real nodes' bridges."""
    pods = cluster.kubectl("get", "pods", "-n", namespace, "-l", OPERATOR_PODS, "-o",
                           "jsonpath={.items[*].metadata.name}").stdout.split()
    assert len(pods) == 1, f"expected one operator pod in {namespace}: {pods}"
    port = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]["metricsPort"]
    return cluster.kubectl("get", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pods[0]}:{port}/proxy/metrics",
                           timeout=30).stdout
