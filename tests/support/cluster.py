"""The local control plane (`make cluster-up`) as a small Python library for tests.

What runs (hack/cluster-up.sh; all on 127.0.0.1, free ports, state in .cache/cluster/):
etcd, kube-apiserver (RBAC, default admission plugins incl. RuntimeClass, service-account
tokens), kube-controller-manager (`--controllers '*'`: garbage collector, namespace,
service-account, endpoint-slice, job ... controllers), kube-scheduler, kwok, and a second
scheduler for gang scheduling: scheduler-plugins' kube-scheduler whose only profile,
`scheduler-plugins-scheduler` (SECOND_SCHEDULER), runs the Coscheduling plugin. It schedules only pods
with that schedulerName; those labelled `scheduling.x-k8s.io/pod-group: <name>` wait until the
namespace's PodGroup <name> (scheduling.x-k8s.io/v1alpha1, CRD installed) can place minMember of them.
scheduler-plugins' controller keeps PodGroup status: phase Pending (fewer pods than minMember),
Scheduling, Running (minMember Running or Succeeded), Finished, Failed (both final: never
reconciled again); counts running/succeeded/failed (a count that falls to 0 keeps its last value).

Fake nodes: `kwok-gpu-0` .. `kwok-gpu-3`, each allocatable `nvidia.com/gpu: 8`, `cpu: 64`,
`memory: 512Gi`, `pods: 110`, labels `nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3`,
`nvidia.com/gpu.count=8`, `node.kubernetes.io/instance-type=p5.48xlarge`,
`type=kwok`; annotation `kwok.x-k8s.io/node: fake`; taint none. A `nvidia` RuntimeClass
(handler `nvidia`) exists. Nothing really executes: kwok Stages drive pod status.

Pod behaviour on kwok nodes (Stages in hack/kwok-stages.yaml):
- scheduled pod -> Running and Ready, with a podIP (10.x) and hostIP; containers "running".
- annotation `ddpjob.dev/test-exit-code: "<n>"` (TEST_EXIT_CODE_ANNOTATION) on a Running pod ->
  every container terminated with exitCode n; phase Succeeded when n == 0 (reason Completed),
  Failed otherwise (reason Error). Use `set_pod_exit(api, ns, pod, n)`.
- annotation `ddpjob.dev/test-evict: "true"` (TEST_EVICT_ANNOTATION) on a Running pod ->
  phase Failed, status.reason Evicted, message "The node was low on resource: memory.",
  containers terminated (exitCode 137, reason Error). Use `evict_pod(api, ns, pod)`.
- a pod with a deletionTimestamp is removed at once (kwok's pod-delete stage), so namespace
  deletion, `kubectl delete pod` and owner-reference garbage collection finish in seconds.
- a pod owned by a batch Job completes (kwok's pod/fast completion stage).
- restartPolicy is not simulated: a terminated pod stays terminated whatever its policy (the operator
  creates restartPolicy Never pods and restarts groups itself). Evicted/exited pods keep their podIP.

Usage:
    from tests.support.cluster import ensure_cluster, wait_for
    c = ensure_cluster()            # reuses a healthy running cluster, else runs hack/cluster-up.sh
    c.kubectl("get", "nodes")       # CompletedProcess (text); check=True raises with stderr
    core = kubernetes.client.CoreV1Api(c.api())
    subprocess.run([...], env=c.env())   # KUBECONFIG and .cache/bin on PATH (kubectl, helm)
"""
from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[2]
# DDPJOB_CLUSTER=oldest: the second control plane, at the oldest Kubernetes the chart allows
# (hack/cluster-up.sh; make test-oldest runs the Makefile's VERSIONED_TESTS against it).
CLUSTER_KIND = os.environ.get("DDPJOB_CLUSTER", "")
CLUSTER_DIR = REPO_ROOT / ".cache" / ("cluster" + (f"-{CLUSTER_KIND}" if CLUSTER_KIND else ""))
KUBECONFIG = CLUSTER_DIR / "kubeconfig"
BIN_DIR = REPO_ROOT / ".cache" / "bin"
CLUSTER_UP = REPO_ROOT / "hack" / "cluster-up.sh"
# The operator image every chart render and install of the tests names: this checkout's, which
# `make images` builds (the chart's default is the release's own); kwok's pods never pull it.
OPERATOR_IMAGE_VALUES = ("image.repository=localhost/ddpjob/operator", "image.tag=dev")

TEST_EXIT_CODE_ANNOTATION = "ddpjob.dev/test-exit-code"
TEST_EVICT_ANNOTATION = "ddpjob.dev/test-evict"
GPU_RESOURCE = "nvidia.com/gpu"
RUNTIME_CLASS = "nvidia"
SECOND_SCHEDULER = "scheduler-plugins-scheduler"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
FAKE_NODE_PREFIX = "kwok-gpu-"

T = TypeVar("T")


@dataclass(frozen=True)
class Cluster:
    """A running local control plane: its kubeconfig and the directory of its binaries."""

    kubeconfig: Path = KUBECONFIG
    bin_dir: Path = BIN_DIR

    def env(self, *, allow_pod_scrape: bool = False, **extra: str) -> dict[str, str]:
        """os.environ with KUBECONFIG set and bin_dir first on PATH (for subprocesses).

        An operator started with this env scrapes loopback (NO_SCRAPE_TEMPLATE unless `extra` or
        the environment name another loopback template): this cluster's pods are kwok's, whose
        addresses are fictitious. A non-loopback template raises NetworkRuleError unless
        `allow_pod_scrape` (real pods only; see tests/support/network.py).
        """
        from tests.support.network import check_operator_scrape, with_loopback_scrape

        env = self._tool_env()
        env.update(extra)
        if not allow_pod_scrape:
            env = with_loopback_scrape(env)
        check_operator_scrape([], env, allow_pod_scrape=allow_pod_scrape)
        return env

    def _tool_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def _run(self, tool: str, args: tuple[str, ...], *, check: bool, input: str | None,
             timeout: float) -> subprocess.CompletedProcess:
        exe = self.bin_dir / tool
        cmd = [str(exe) if exe.exists() else tool, *map(str, args)]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True,
                              env=self._tool_env(), timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"`{tool} {' '.join(map(str, args))}` exited {proc.returncode}\n"
                f"stdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-2000:]}")
        return proc

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster; text output; check=True raises AssertionError with stderr."""
        return self._run("kubectl", args, check=check, input=input, timeout=timeout)

    def helm(self, *args: str, check: bool = True, input: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
        """Run the cluster's helm (.cache/bin/helm) against this cluster, like kubectl()."""
        return self._run("helm", args, check=check, input=input, timeout=timeout)

    def api(self):
        """A fresh kubernetes.client.ApiClient for this cluster (admin, system:masters)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def server(self) -> str:
        """The API server URL, e.g. https://127.0.0.1:41234."""
        return self.kubectl("config", "view", "--minify", "-o",
                            "jsonpath={.clusters[0].cluster.server}").stdout.strip()

    def healthy(self) -> bool:
        """True when the API server answers /readyz and at least one fake node is Ready."""
        return cluster_healthy(self.kubeconfig)


def cluster_healthy(kubeconfig: Path = KUBECONFIG, *, timeout: float = 10) -> bool:
    """True when the apiserver behind kubeconfig is ready and has a Ready kwok node."""
    if not Path(kubeconfig).exists():
        return False
    c = Cluster(kubeconfig=Path(kubeconfig))
    try:
        if c.kubectl("get", "--raw", "/readyz", check=False, timeout=timeout).returncode != 0:
            return False
        out = c.kubectl("get", "nodes", "-l", "type=kwok", "-o",
                        "jsonpath={range .items[*]}{.status.conditions[?(@.type=='Ready')].status}{'\\n'}{end}",
                        check=False, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return False
    return "True" in out.split()


def ensure_cluster(*, timeout: float = 1800) -> Cluster:
    """Return the running healthy cluster, or start one with hack/cluster-up.sh (builds when uncached).
    A cluster that exists but answers slowly (a loaded machine) is asked again before cluster-up
    (which waits for it too rather than restarting it)."""
    c = Cluster()
    for _ in range(3):
        if c.healthy():
            return c
        if not c.kubeconfig.exists():
            break
    proc = subprocess.run(["bash", str(CLUSTER_UP)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"hack/cluster-up.sh exited {proc.returncode}:\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if not c.healthy():
        raise RuntimeError("hack/cluster-up.sh succeeded but the cluster is not healthy")
    return c


def wait_for(fn: Callable[[], T], *, timeout: float, desc: str, interval: float = 0.2) -> T:
    """Call fn until it returns a truthy value (returned); on timeout raise AssertionError naming
    desc and the last value or exception seen. Exceptions from fn are retried until the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    last_exc: BaseException | None = None
    while True:
        try:
            last = fn()
            last_exc = None
            if last:
                return last
        except Exception as exc:  # noqa: BLE001  (retry anything until the deadline; reported below)
            last_exc = exc
        if time.monotonic() >= deadline:
            seen = f"last exception: {last_exc!r}" if last_exc is not None else f"last value: {last!r}"
            raise AssertionError(f"timed out after {timeout}s waiting for {desc}; {seen}")
        time.sleep(interval)


def wait_crd_established(cluster: "Cluster", name: str, *, timeout: float = 60) -> None:
    """`kubectl wait --for=condition=Established` fails at once, instead of waiting, while a CRD
    just applied has no status.conditions yet (".status.conditions accessor error"): every time
    with the 700 KB DDPJob CRD, and once before as a whole test module erroring in a rehearsal."""
    def established() -> bool:
        out = cluster.kubectl("get", "crd", name, "-o",
                              'jsonpath={.status.conditions[?(@.type=="Established")].status}', check=False)
        return out.stdout.strip() == "True"
    wait_for(established, timeout=timeout, desc=f"CRD {name} Established", interval=0.5)


def create_namespace(api, name: str | None = None, *, prefix: str = "t-",
                     labels: dict[str, str] | None = None) -> str:
    """Create a namespace (random name `<prefix><8 hex>` unless given) and wait for its default
    ServiceAccount (made by the controller-manager), so pods can be created at once. Returns the name."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    name = name or f"{prefix}{uuid.uuid4().hex[:8]}"
    body = client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={"ddpjob.dev/test": "true", **(labels or {})}))
    core.create_namespace(body)
    wait_for(lambda: core.read_namespaced_service_account("default", name),
             timeout=30, desc=f"ServiceAccount default in namespace {name}")
    return name


def delete_namespace(api, name: str, *, wait: bool = False, timeout: float = 60) -> None:
    """Delete a namespace (absent is fine); with wait=True, until it is gone."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(api)
    try:
        core.delete_namespace(name, propagation_policy="Background")
    except ApiException as exc:
        if exc.status != 404:
            raise
    if wait:
        def gone() -> bool:
            try:
                core.read_namespace(name)
                return False
            except ApiException as exc:
                if exc.status == 404:
                    return True
                raise
        wait_for(gone, timeout=timeout, desc=f"namespace {name} deleted")


def _annotate_pod(api, ns: str, pod: str, annotations: dict[str, str]) -> None:
    from kubernetes import client

    client.CoreV1Api(api).patch_namespaced_pod(pod, ns, {"metadata": {"annotations": annotations}})


def set_pod_exit(api, ns: str, pod: str, code: int) -> None:
    """Make kwok terminate a Running pod with exit code `code` (Succeeded for 0, else Failed)."""
    _annotate_pod(api, ns, pod, {TEST_EXIT_CODE_ANNOTATION: str(int(code))})


def evict_pod(api, ns: str, pod: str) -> None:
    """Make kwok mark a Running pod Failed with reason Evicted (as a kubelet under memory pressure does)."""
    _annotate_pod(api, ns, pod, {TEST_EVICT_ANNOTATION: "true"})
