"""The operator (`ddpjob operator` subprocess) against the real API server, scheduler and GC.

Pods run on kwok's fake GPU nodes; tests drive their exit codes with the annotations from
tests/support/cluster.py. Every wait has a deadline; the operator's log is printed on failure.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.cluster.conftest import wait_for
from tests.cluster.test_crd import install_crd
from tests.support.cluster import FAKE_NODE_PREFIX, REPO_ROOT, evict_pod, set_pod_exit, wait_crd_established
from ddpjob_cli.local import free_port

DDPJOB = str(Path(sys.executable).parent / "ddpjob")


OPERATOR_START_HANG_S = 300


class Operator:
    """One `ddpjob operator` process watching one namespace."""

    def __init__(self, cluster, namespace: str, log_path: Path, env: dict[str, str] | None = None,
                 extra: list[str] | None = None):
        self.metrics_port, self.health_port = free_port(), free_port()
        self.log_path = log_path
        cmd = [DDPJOB, "operator", "-n", namespace, "--metrics-port", str(self.metrics_port),
               "--health-port", str(self.health_port), "--scrape-interval", "2",
               # Every new scrape's progress is written: tests wait on it, not on the 30 s default.
               "--progress-interval", "1",
               "--unschedulable-timeout", "2", "--log-level", "INFO", *(extra or ["--peering", ""])]
        # kwok pod IPs are fictitious: unless a test points the scraper at its own endpoints,
        # scrape a closed loopback port (fails at once) rather than those addresses.
        env = {"DDPJOB_SCRAPE_URL_TEMPLATE": f"http://127.0.0.1:{free_port()}/metrics", **(env or {})}
        self.log = open(log_path, "a")  # noqa: SIM115  (the child's for its lifetime)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                     env=cluster.env(**env))
        # The event is /healthz (the pod cache synced); the timeout only bounds a hang. 30 s was a
        # margin: rehearsal 20 started one beside two torchrun tiers and a local run (load 9) and
        # its kopf import and first list took longer. An exited operator fails at once.
        up = wait_for(lambda: "exited" if self.proc.poll() is not None else self.healthy(),
                      timeout=OPERATOR_START_HANG_S, desc=f"operator /healthz on :{self.health_port}")
        assert up is True, f"operator exited {self.proc.returncode}:\n{self.tail()}"

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def tail(self, n: int = 60) -> str:
        return "".join(self.log_path.read_text().splitlines(True)[-n:])


@pytest.fixture(scope="module")
def crd(cluster):
    install_crd(cluster)
    return cluster


@pytest.fixture
def start_operator(crd, namespace, tmp_path):
    started: list[Operator] = []

    def start(**env: str) -> Operator:
        op = Operator(crd, namespace, tmp_path / "operator.log", env=env)
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
    if started:  # shown by pytest only when the test failed
        print(f"--- operator log ({started[-1].log_path}) ---\n{started[-1].tail(80)}")


@pytest.fixture
def k8s(api, namespace):
    class K:
        core = client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        ns = namespace

        def apply(self, name, **spec):
            body = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
                    "spec": {"image": "reg/trainer:1", "nodes": 2, **spec}}
            return self.custom.create_namespaced_custom_object("ddpjob.dev", "v1alpha1", self.ns, "ddpjobs", body)

        def job(self, name):
            return self.custom.get_namespaced_custom_object("ddpjob.dev", "v1alpha1", self.ns, "ddpjobs", name)

        def status(self, name):
            return self.job(name).get("status") or {}

        def patch(self, name, spec):
            self.custom.patch_namespaced_custom_object("ddpjob.dev", "v1alpha1", self.ns, "ddpjobs", name,
                                                       {"spec": spec})

        def pods(self, name):
            return self.core.list_namespaced_pod(self.ns, label_selector=f"ddpjob.dev/job-name={name}").items

        def wait_status(self, name, pred, desc, timeout=30):
            return wait_for(lambda: (lambda s: s if pred(s) else None)(self.status(name)),
                            timeout=timeout, desc=f"{name}: {desc} (status {self.status(name)})")

        def events(self, name):
            evs = self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={name}").items
            return [(e.type, e.reason, e.message) for e in evs if e.involved_object.kind == "DDPJob"]

        def gone(self, name):
            try:
                self.job(name)
                return False
            except ApiException as exc:
                return exc.status == 404

    return K()


def running(n):
    return lambda s: s.get("phase") == "Running" and s.get("nodes", {}).get("running") == n


def env_of(pod):
    return {e.name: e.value for e in pod.spec.containers[0].env}


def test_creates_headless_service_and_gpu_pods(start_operator, k8s):
    op = start_operator()
    k8s.apply("resnet", nodes=3, gpusPerNode=4)
    status = k8s.wait_status("resnet", running(3), "Running 3/3")
    assert status["nodes"]["ready"] == "3/3" and status["restarts"] == 0
    assert status["masterAddr"] == f"resnet-0.resnet.{k8s.ns}.svc"
    svc = k8s.core.read_namespaced_service("resnet", k8s.ns)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses is True
    pods = sorted(k8s.pods("resnet"), key=lambda p: p.metadata.name)
    assert [p.metadata.name for p in pods] == [f"resnet-{r}" for r in range(3)]
    uid = k8s.job("resnet")["metadata"]["uid"]
    for rank, pod in enumerate(pods):
        assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "4"
        assert pod.spec.runtime_class_name == "nvidia"
        env = env_of(pod)
        assert env["NODE_RANK"] == pod.metadata.labels["ddpjob.dev/node-rank"] == str(rank)
        assert env["MASTER_ADDR"] == f"{pods[0].spec.hostname}.{pods[0].spec.subdomain}.{k8s.ns}.svc"
        assert env["WORLD_SIZE"] == "12"
        (ref,) = pod.metadata.owner_references
        assert ref.uid == uid and ref.controller is True
    text = op.metrics()
    assert f'ddpjob_operator_pods_created_total{{namespace="{k8s.ns}"}} 3.0' in text
    assert f'ddpjob_operator_jobs{{namespace="{k8s.ns}",phase="Running"}} 1.0' in text
    # The first come-up posts no Event (its conditions say it); a restart's Running does (below).
    assert k8s.events("resnet") == []
    # Watch-only handlers: kopf leaves no finalizers or state annotations on the DDPJob.
    meta = k8s.job("resnet")["metadata"]
    assert not meta.get("finalizers")
    assert not [a for a in (meta.get("annotations") or {}) if "kopf" in a]


def test_example_resnet_gpu_runs_4_nodes_of_8_gpus(start_operator, k8s, crd):
    """`kubectl apply -f examples/resnet-gpu.yaml` (its PVCs bound to test PVs): Running 4/4."""
    pvs = []
    for claim, mode in (("imagenet", "ReadOnlyMany"), ("resnet-checkpoints", "ReadWriteMany")):
        name = f"{k8s.ns}-{claim}"
        k8s.core.create_persistent_volume({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {"capacity": {"storage": "1Ti"}, "accessModes": [mode],
                     "persistentVolumeReclaimPolicy": "Delete", "hostPath": {"path": f"/tmp/{name}"},
                     "claimRef": {"namespace": k8s.ns, "name": claim}}})
        pvs.append(name)
    try:
        start_operator()
        crd.kubectl("apply", "-n", k8s.ns, "-f", str(REPO_ROOT / "examples/resnet-gpu.yaml"))
        status = k8s.wait_status("resnet50", running(4), "Running 4/4", timeout=90)
        printed = crd.kubectl("get", "ddpj", "resnet50", "-n", k8s.ns).stdout
        assert "Running" in printed and "4/4" in printed
        assert crd.kubectl("get", "svc", "resnet50", "-n", k8s.ns, "-o",
                           "jsonpath={.spec.clusterIP}").stdout == "None"
        for pod in k8s.pods("resnet50"):
            assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8"
            assert pod.spec.runtime_class_name == "nvidia"
            env = env_of(pod)
            assert env["NODE_RANK"] == pod.metadata.labels["ddpjob.dev/node-rank"]
            assert env["MASTER_ADDR"] == status["masterAddr"] == f"resnet50-0.resnet50.{k8s.ns}.svc"
            assert {v.name for v in pod.spec.volumes} >= {"dshm", "data", "ckpt"}
    finally:
        crd.kubectl("delete", "ddpj", "--all", "-n", k8s.ns, "--wait=false", check=False)
        for name in pvs:
            crd.kubectl("delete", "pv", name, "--wait=false", check=False)


def api_requests(op) -> dict[str, float]:
    """The operator's own count of its API requests, by "VERB resource"."""
    out = {}
    for line in op.metrics().splitlines():
        if line.startswith("ddpjob_operator_api_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            lab = dict(kv.split("=", 1) for kv in labels[labels.index("{") + 1:-1].split(","))
            out[f"{lab['verb'].strip(chr(34))} {lab['resource'].strip(chr(34))}"] = float(value)
    return out


def test_running_job_at_rest_costs_no_api_requests(start_operator, k8s):
    """Scrape passes (every 2 s here, failing on a closed port) read caches: nothing reaches the API server."""
    op = start_operator()
    k8s.apply("idle", nodes=2)
    k8s.wait_status("idle", running(2), "Running 2/2")
    # Our pods come from one label-selected list+watch, never a LIST per pass.
    wait_for(lambda: api_requests(op).get("PATCH ddpjobs/status", 0) >= 2, timeout=10, desc="status written")
    time.sleep(3)  # let trailing writes (the coalesced node counts, the first scrape's conditions) land
    before = api_requests(op)
    time.sleep(5)  # more than two scrape intervals
    assert api_requests(op) == before
    assert before.get("LIST pods") == 1 and before.get("WATCH pods", 0) >= 1
    assert not [k for k in before if k.startswith("GET ")], before


def test_a_job_coming_up_writes_its_status_twice(start_operator, k8s):
    """The attempt created (written before its pods), then all Running: the node counts of the
    pods that start in between ride along with the second write. The test is the pods' scheduler
    (a schedulerName no scheduler serves): it binds three of the four to fake nodes, lets them start,
    then the fourth. Each status write is one MODIFIED event of the job's watch (replayed from
    before the job existed)."""
    start_operator()
    rv = k8s.custom.list_namespaced_custom_object("ddpjob.dev", "v1alpha1", k8s.ns, "ddpjobs")["metadata"][
        "resourceVersion"]
    k8s.apply("up", nodes=4, scheduling={"onePodPerNode": False},
              template={"spec": {"schedulerName": "test-binds-by-hand"}})

    def bind(*names: str) -> None:
        for i, name in enumerate(names):
            k8s.core.create_namespaced_pod_binding(name, k8s.ns, {
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": f"{FAKE_NODE_PREFIX}{i}"}},
                _preload_content=False)

    wait_for(lambda: len(k8s.pods("up")) == 4, timeout=30, desc="up's 4 pods created")
    bind("up-0", "up-1", "up-2")
    wait_for(lambda: sorted(p.status.phase for p in k8s.pods("up")) == ["Pending", "Running", "Running", "Running"],
             timeout=60, desc="3 of up's pods Running")
    time.sleep(6)  # room for the coalesced node-count write (5 s) the old policy made: it would be the bug
    bind("up-3")
    writes: list[dict] = []
    for ev in watch.Watch().stream(k8s.custom.list_namespaced_custom_object, "ddpjob.dev", "v1alpha1", k8s.ns,
                                   "ddpjobs", resource_version=rv, field_selector="metadata.name=up",
                                   timeout_seconds=90):
        status = ev["object"].get("status") or {}
        if ev["type"] == "MODIFIED":
            writes.append(status)
        if status.get("phase") == "Running":
            break
    assert [w.get("phase") for w in writes] == ["Pending", "Running"], writes
    assert writes[0]["nodes"]["running"] == 0 and writes[1]["nodes"]["running"] == 4
    assert writes[1]["launchedAttempt"] == 0


def pod_table(k8s, name):
    """(pod, attempt, phase) of the job's pods that are not being deleted."""
    return sorted((p.metadata.name, p.metadata.labels["ddpjob.dev/attempt"], p.status.phase)
                  for p in k8s.pods(name) if p.metadata.deletion_timestamp is None)


def endpoint_pods(api, ns, service):
    """The pods the headless Service's EndpointSlices list (what its DNS names resolve to)."""
    slices = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
        ns, label_selector=f"kubernetes.io/service-name={service}").items
    return sorted(e.target_ref.name for s in slices for e in s.endpoints or [] if e.target_ref)


def test_pod_failure_and_deletion_restart_the_group(start_operator, k8s):
    """A group restart keeps the failed attempt's ended pods (spec.failurePolicy.keepFailedAttempts,
    default 1) beside the new attempt's, whose pods carry the attempt in their names; the kept pods
    leave the Service's endpoints, older ones are pruned, and keepFailedAttempts 0 deletes them."""
    op = start_operator()
    k8s.apply("grp", nodes=3)
    k8s.wait_status("grp", running(3), "Running 3/3")
    set_pod_exit(k8s.core.api_client, k8s.ns, "grp-1", 1)
    status = k8s.wait_status("grp", lambda s: s.get("restarts") == 1 and running(3)(s), "restarted once")
    assert status["attempt"] == 1 and status["countedRestarts"] == 1
    new = [(f"grp-{r}-a1", "1", "Running") for r in range(3)]
    wait_for(lambda: pod_table(k8s, "grp") == sorted([("grp-1", "0", "Failed"), *new]), timeout=30,
             desc=f"the failed pod kept beside attempt 1 ({pod_table(k8s, 'grp')})")
    wait_for(lambda: any(r == "Restarting" and "grp-1 failed with exit code 1" in m for _, r, m in k8s.events("grp")),
             timeout=30, desc="the Restarting event")
    # Events follow the status write they announce (a pass writes the status, then posts them); the
    # restarted attempt's Running is one, the first come-up's was not.
    wait_for(lambda: ("Normal", "Running", "all 3 node(s) running") in k8s.events("grp"), timeout=30,
             desc="the Running event of attempt 1")
    assert [r for _, r, _ in k8s.events("grp") if r in ("Created", "Running")] == ["Running"]
    # DNS and MASTER_ADDR stay: the Service lists only the running pods, not the kept one.
    wait_for(lambda: endpoint_pods(k8s.core.api_client, k8s.ns, "grp") == [n for n, _, _ in new], timeout=30,
             desc=f"endpoints of attempt 1 only ({endpoint_pods(k8s.core.api_client, k8s.ns, 'grp')})")
    # Another failure: its failed pod is kept, the one from two attempts back pruned.
    set_pod_exit(k8s.core.api_client, k8s.ns, "grp-2-a1", 1)
    k8s.wait_status("grp", lambda s: s.get("restarts") == 2 and running(3)(s), "restarted twice")
    wait_for(lambda: pod_table(k8s, "grp") == sorted([("grp-2-a1", "1", "Failed"),
                                                     *[(f"grp-{r}-a2", "2", "Running") for r in range(3)]]),
             timeout=30, desc=f"attempt 1's failed pod kept, attempt 0's pruned ({pod_table(k8s, 'grp')})")
    # keepFailedAttempts 0: kept pods go at once.
    k8s.patch("grp", {"failurePolicy": {"keepFailedAttempts": 0}})
    wait_for(lambda: [n for n, _, _ in pod_table(k8s, "grp")] == [f"grp-{r}-a2" for r in range(3)], timeout=30,
             desc=f"no kept pod ({pod_table(k8s, 'grp')})")
    # Deleting pod 0 (as a user would) also restarts the whole group: it hosts the rendezvous.
    k8s.core.delete_namespaced_pod("grp-0-a2", k8s.ns)
    k8s.wait_status("grp", lambda s: s.get("restarts") == 3 and running(3)(s), "restarted three times")
    wait_for(lambda: pod_table(k8s, "grp") == [(f"grp-{r}-a3", "3", "Running") for r in range(3)], timeout=30,
             desc=f"attempt 3 alone ({pod_table(k8s, 'grp')})")
    # Another rank's pod deleted: that pod alone is replaced, in the same attempt, under its own
    # name; the others keep theirs (their workers restart in place: docs/restarts.md).
    k8s.patch("grp", {"failurePolicy": {"keepFailedAttempts": 0, "maxRestarts": 5}})  # 3 of 3 used: room for a 4th
    uids = {p.metadata.name: p.metadata.uid for p in k8s.pods("grp")}
    k8s.core.delete_namespaced_pod("grp-1-a3", k8s.ns)
    status = k8s.wait_status("grp", lambda s: s.get("restarts") == 4 and running(3)(s), "rank 1 replaced")
    assert (status["attempt"], status["countedRestarts"]) == (3, 4), status
    replaced = [e for e in status["restartHistory"] if e["kind"] == "Replace"]
    assert [(e["rank"], e["pod"], e["newPod"], e["reason"]) for e in replaced] == [(1, "grp-1-a3", "grp-1-a3-r1",
                                                                                  "PodDeleted")], replaced
    wait_for(lambda: pod_table(k8s, "grp") == [("grp-0-a3", "3", "Running"), ("grp-1-a3-r1", "3", "Running"),
                                               ("grp-2-a3", "3", "Running")], timeout=30,
             desc=f"rank 1 replaced alone ({pod_table(k8s, 'grp')})")
    now = {p.metadata.name: p.metadata.uid for p in k8s.pods("grp")}
    assert {n: now[n] for n in ("grp-0-a3", "grp-2-a3")} == {n: uids[n] for n in ("grp-0-a3", "grp-2-a3")}
    assert k8s.core.read_namespaced_pod("grp-1-a3-r1", k8s.ns).spec.hostname == "grp-1"
    wait_for(lambda: any(r == "ReplacingPod" and "grp-1-a3-r1" in m for _, r, m in k8s.events("grp")),
             timeout=30, desc="the ReplacingPod event")
    # The Service outlives group restarts: created once, never re-POSTed.
    assert api_requests(op)["POST services"] == 1


def test_a_new_attempt_waits_until_the_old_master_is_gone(start_operator, k8s):
    """A master pod still terminating serves its rendezvous store on the job's DNS name: no pod of
    the next attempt may start beside it, not even a rank whose own name is already free."""
    start_operator()
    k8s.apply("gen", nodes=2)
    k8s.wait_status("gen", running(2), "Running 2/2")
    hold = {"metadata": {"finalizers": ["ddpjob.dev/test-hold"]}}  # keeps gen-0 Terminating
    k8s.core.patch_namespaced_pod("gen-0", k8s.ns, hold)
    try:
        set_pod_exit(k8s.core.api_client, k8s.ns, "gen-1", 1)
        k8s.wait_status("gen", lambda s: s.get("restarts") == 1, "restart 1")
        # Left: the held old master and the failed rank's pod (kept for its logs).
        old = [("gen-0", "0", "Running"), ("gen-1", "0", "Failed")]
        wait_for(lambda: [(p.metadata.name, p.metadata.labels["ddpjob.dev/attempt"], p.status.phase)
                          for p in k8s.pods("gen")] == old, timeout=30, desc="only the held old master left")
        time.sleep(3)  # several operator passes (a pod event each) — still nothing new beside it
        pods = k8s.pods("gen")
        assert [(p.metadata.name, p.metadata.labels["ddpjob.dev/attempt"], p.status.phase) for p in pods] == old
    finally:  # or the namespace could never be deleted
        k8s.core.patch_namespaced_pod("gen-0", k8s.ns, {"metadata": {"finalizers": None}})
    k8s.wait_status("gen", lambda s: s.get("attempt") == 1 and running(2)(s), "attempt 1 Running 2/2")
    assert {p.metadata.labels["ddpjob.dev/attempt"] for p in k8s.pods("gen") if p.status.phase != "Failed"} == {"1"}


def test_restart_budget_exhausted_fails(start_operator, k8s):
    start_operator()
    k8s.apply("budget", nodes=2, failurePolicy={"maxRestarts": 1})
    k8s.wait_status("budget", running(2), "Running")
    set_pod_exit(k8s.core.api_client, k8s.ns, "budget-0", 2)
    k8s.wait_status("budget", lambda s: s.get("restarts") == 1 and running(2)(s), "one restart")
    set_pod_exit(k8s.core.api_client, k8s.ns, "budget-1-a1", 2)
    status = k8s.wait_status("budget", lambda s: s.get("phase") == "Failed", "Failed")
    assert status["reason"] == "RestartLimitExceeded" and status["restarts"] == 1
    assert "completionTime" in status
    # cleanPodPolicy Running: the failed pods stay for their logs (attempt 0's too, kept by the
    # restart), the running one is removed.
    failed = ["budget-0", "budget-1-a1"]
    wait_for(lambda: [p.metadata.name for p in k8s.pods("budget")] == failed, timeout=20,
             desc="only the failed pods left")
    time.sleep(1)
    assert k8s.status("budget")["phase"] == "Failed"  # stays failed: no new pods
    assert [p.metadata.name for p in k8s.pods("budget")] == failed


@pytest.mark.parametrize("budget, pods", [
    # No in-place restarts: the other pods' workers cannot wait for a new peer: the group restarts.
    (0, [("evict-0-a1", "1", "Running"), ("evict-1", "0", "Failed"), ("evict-1-a1", "1", "Running")]),
    # Rank 1 replaced alone; the evicted pod is kept for its logs.
    (3, [("evict-0", "0", "Running"), ("evict-1", "0", "Failed"), ("evict-1-r1", "0", "Running")]),
])
def test_eviction_does_not_count_against_the_budget(start_operator, k8s, budget, pods):
    start_operator()
    k8s.apply("evict", nodes=2, failurePolicy={"maxRestarts": budget})
    k8s.wait_status("evict", running(2), "Running")
    evict_pod(k8s.core.api_client, k8s.ns, "evict-1")
    status = k8s.wait_status("evict", lambda s: s.get("restarts") == 1 and running(2)(s), "free restart")
    assert status["countedRestarts"] == 0 and status["reason"] == "Running"
    wait_for(lambda: pod_table(k8s, "evict") == pods, timeout=30, desc=f"pods {pod_table(k8s, 'evict')}")


def test_bad_configuration_exit_fails_without_restart(start_operator, k8s):
    start_operator()
    k8s.apply("badcfg", nodes=2)
    k8s.wait_status("badcfg", running(2), "Running")
    set_pod_exit(k8s.core.api_client, k8s.ns, "badcfg-0", 78)
    status = k8s.wait_status("badcfg", lambda s: s.get("phase") == "Failed", "Failed")
    assert status["reason"] == "BadConfiguration" and status["restarts"] == 0
    assert {p.metadata.labels["ddpjob.dev/attempt"] for p in k8s.pods("badcfg")} == {"0"}


def test_success_then_ttl_deletes_job_and_gc_removes_children(start_operator, k8s):
    start_operator()
    k8s.apply("done", nodes=2, ttlSecondsAfterFinished=3)
    k8s.wait_status("done", running(2), "Running")
    for rank in range(2):
        set_pod_exit(k8s.core.api_client, k8s.ns, f"done-{rank}", 0)
    status = k8s.wait_status("done", lambda s: s.get("phase") == "Succeeded", "Succeeded")
    assert status["nodes"]["succeeded"] == 2 and status["completionTime"]
    assert len(k8s.pods("done")) == 2  # cleanPodPolicy Running keeps completed pods until the TTL
    wait_for(lambda: k8s.gone("done"), timeout=30, desc="DDPJob deleted by its TTL")
    wait_for(lambda: not k8s.pods("done"), timeout=30, desc="pods garbage-collected")
    wait_for(lambda: not k8s.core.list_namespaced_service(k8s.ns).items, timeout=30, desc="service GC'd")


def test_delete_job_garbage_collects_children(start_operator, k8s):
    start_operator()
    k8s.apply("gc", nodes=2)
    k8s.wait_status("gc", running(2), "Running")
    k8s.custom.delete_namespaced_custom_object("ddpjob.dev", "v1alpha1", k8s.ns, "ddpjobs", "gc")
    wait_for(lambda: not k8s.pods("gc") and not k8s.core.list_namespaced_service(k8s.ns).items,
             timeout=30, desc="pods and service garbage-collected")


def test_suspend_and_resume(start_operator, k8s):
    start_operator()
    k8s.apply("sus", nodes=2)
    k8s.wait_status("sus", running(2), "Running")
    k8s.patch("sus", {"suspend": True})
    k8s.wait_status("sus", lambda s: s.get("phase") == "Suspended", "Suspended")
    wait_for(lambda: not k8s.pods("sus"), timeout=20, desc="pods deleted while suspended")
    k8s.patch("sus", {"suspend": False})
    status = k8s.wait_status("sus", running(2), "Running again")
    assert status["restarts"] == 0 and status["attempt"] == 1
    wait_for(lambda: {"Suspended", "Resumed"} <= {r for _, r, _ in k8s.events("sus")}, timeout=30,
             desc="the Suspended and Resumed events")


def test_active_deadline_fails_the_job(start_operator, k8s):
    start_operator()
    k8s.apply("late", nodes=2, activeDeadlineSeconds=4)
    k8s.wait_status("late", running(2), "Running")
    status = k8s.wait_status("late", lambda s: s.get("phase") == "Failed", "DeadlineExceeded", timeout=30)
    assert status["reason"] == "DeadlineExceeded"
    wait_for(lambda: not k8s.pods("late"), timeout=20, desc="running pods removed")


def test_unschedulable_condition_has_the_scheduler_message(start_operator, k8s):
    start_operator()
    k8s.apply("huge", nodes=1, gpusPerNode=16)  # fake nodes have 8 GPUs each
    status = k8s.wait_status("huge", lambda s: any(c["type"] == "Unschedulable" and c["status"] == "True"
                                                   for c in s.get("conditions", [])), "Unschedulable",
                             timeout=40)
    cond = next(c for c in status["conditions"] if c["type"] == "Unschedulable")
    assert "nvidia.com/gpu" in cond["message"]
    assert status["phase"] == "Pending"


def test_a_pod_field_newer_than_the_api_server_is_refused_naming_it_and_the_servers_version(start_operator, k8s, api):
    """The CRD embeds the newest Kubernetes' pod schema, so a DDPJob may carry a field an older
    cluster lacks (a container's lifecycle.stopSignal: Kubernetes 1.33). The operator creates
    pods with strict field validation: there the job fails naming the field, the DDPJob field and
    the API server's version, where the default would drop the field and run the pod without it.
    On a server that has the field the pods are created (make test-oldest runs both)."""
    version = client.VersionApi(api).get_code().git_version
    minor = int(version.lstrip("v").split(".")[1])
    start_operator()
    k8s.apply("stopsig", nodes=1, gpusPerNode=1, template={"spec": {
        "os": {"name": "linux"},
        "containers": [{"name": "trainer", "lifecycle": {"stopSignal": "SIGUSR1"}}]}})
    if minor >= 33:
        k8s.wait_status("stopsig", lambda s: s.get("phase") == "Running", "Running: its pod created", timeout=60)
        return
    status = k8s.wait_status("stopsig", lambda s: s.get("phase") == "Failed", "Failed", timeout=60)
    cond = next(c for c in status["conditions"] if c["type"] == "FailedCreatePod")
    assert 'unknown field "spec.containers[0].lifecycle.stopSignal' in cond["message"], cond
    assert "(DDPJob spec.template.spec.containers[0].lifecycle.stopSignal)" in cond["message"], cond
    assert f"the API server is Kubernetes {version}, which does not have that field" in cond["message"], cond
    assert k8s.pods("stopsig") == []


def test_operator_killed_mid_creation_leaves_no_duplicates(start_operator, k8s):
    slow = start_operator(DDPJOB_DEBUG_CREATE_DELAY="0.3")
    k8s.apply("big", nodes=16, scheduling={"onePodPerNode": False})  # 16 pods on the 4 fake nodes
    wait_for(lambda: len(k8s.pods("big")) >= 3, timeout=30, desc="some pods created")
    # The group is created in one pass, after the one status write that stores its attempt, and
    # with none between its batches.
    mid = api_requests(slow)
    slow.kill()
    created = len(k8s.pods("big"))
    assert 0 < created < 16, f"the kill came too late ({created} pods)"
    assert mid.get("PATCH ddpjobs/status") == 1 and mid.get("POST pods", 0) >= 3, mid
    start_operator()
    status = k8s.wait_status("big", running(16), "Running 16/16", timeout=60)
    pods = k8s.pods("big")
    assert sorted(p.metadata.name for p in pods) == sorted(f"big-{r}" for r in range(16))
    assert {p.metadata.labels["ddpjob.dev/attempt"] for p in pods} == {"0"}
    assert status["restarts"] == 0


def test_peering_only_the_highest_priority_operator_acts(crd, namespace, tmp_path, k8s):
    """Two operators with kopf peering: the lower-priority one pauses; only the other creates pods."""
    crd.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                str(REPO_ROOT / "charts/ddpjob-operator/crds/kopfpeerings.kopf.dev.yaml"))
    wait_crd_established(crd, "kopfpeerings.kopf.dev")
    crd.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "ddpjob-test"}}))
    ops = []
    try:
        for prio, env in ((0, {"POD_ID": "low"}), (100, {"POD_ID": "high"})):
            op = Operator(crd, namespace, tmp_path / f"op-{prio}.log", env=env,
                          extra=["--peering", "ddpjob-test", "--priority", str(prio)])
            ops.append(op)
        low, high = ops

        def peers():
            obj = k8s.custom.get_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings",
                                                          "ddpjob-test")
            return set(obj.get("status") or {})
        wait_for(lambda: peers() >= {"low", "high"}, timeout=30, desc="both operators in the peering object")
        time.sleep(2)  # the low-priority operator sees the higher peer and pauses
        k8s.apply("peer", nodes=3)
        k8s.wait_status("peer", running(3), "Running 3/3")
        created = f'ddpjob_operator_pods_created_total{{namespace="{namespace}"}}'
        assert f"{created} 3.0" in high.metrics()
        assert f"{created} 3.0" not in low.metrics() and f"{created} 0.0" in low.metrics()
        assert len(k8s.pods("peer")) == 3
    finally:
        for op in ops:
            op.stop()
            print(f"--- {op.log_path.name} ---\n{op.tail(30)}")


def health_codes(port: int, proc: subprocess.Popen, seconds: float) -> list[int]:
    """Every answer of GET /healthz on `port`, once a second for `seconds` (the process must live)."""
    codes: list[int] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"operator exited {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                codes.append(r.status)
        except urllib.error.HTTPError as exc:
            codes.append(exc.code)
        except OSError:
            pass  # not listening yet
        time.sleep(1)
    return codes


def test_not_healthy_until_it_has_listed_its_pods(crd, namespace, tmp_path):
    """An operator that cannot reach the API server (a wrong address, a dead route: stop 21's CI)
    must not pass the chart's readiness probe, or `helm install --wait` reports success."""
    cfg = yaml.safe_load(Path(crd.kubeconfig).read_text())
    for entry in cfg["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{free_port()}"  # nothing listens there
    bad = tmp_path / "kubeconfig"
    bad.write_text(yaml.safe_dump(cfg))
    port = free_port()
    with open(tmp_path / "operator.log", "w") as log:
        proc = subprocess.Popen([DDPJOB, "operator", "-n", namespace, "--metrics-port", str(free_port()),
                                 "--health-port", str(port), "--peering", ""],
                                stdout=log, stderr=subprocess.STDOUT, env=crd.env(KUBECONFIG=str(bad)))
        try:
            codes = health_codes(port, proc, 20)
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    assert codes and set(codes) == {500}, codes
