"""Kubeflow's training-operator (v1.9.4, PyTorchJob) as a peer for bench/operator_scale.py.

Built from its Go module and cached machine-wide beside the control plane's binaries
(${DDPJOB_CACHE:-~/.cache/ddpjob}/bin/training-operator-<version>/), so only the first run
pays for the build. It runs out of cluster against the local control plane, which needs:
its CRD (applied server-side), namespace `kubeflow`, an empty Secret that its cert rotator fills,
the ValidatingWebhookConfiguration the rotator patches, and an ExternalName Service
`kubeflow/training-operator` -> localhost (the API server resolves it and calls the webhook on
loopback); the rotated cert is copied from the Secret into the directory `pkg/cert` serves from.
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

VERSION = "v1.9.4"
MODULE = "github.com/kubeflow/training-operator"
PACKAGE = f"{MODULE}/cmd/training-operator.v1"
CACHE = Path(os.environ.get("DDPJOB_CACHE") or Path.home() / ".cache" / "ddpjob")
BINARY = CACHE / "bin" / f"training-operator-{VERSION}" / "training-operator.v1"
NAMESPACE = "kubeflow"
SECRET = "training-operator-webhook-cert"
SERVICE = "training-operator"
WEBHOOK_CONFIG = "validator.training-operator.kubeflow.org"
CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")  # fixed in its pkg/cert
# Upstream defaults (flags of cmd/training-operator.v1) and the tuning of issue 16's table.
DEFAULT_FLAGS: list[str] = []
TUNED_FLAGS = ["--kube-api-qps", "500", "--kube-api-burst", "500", "--controller-threads", "8"]


def ensure_binary() -> Path:
    """The cached binary; `go install` it when missing (minutes on 2 cores, once per machine)."""
    if BINARY.exists():
        return BINARY
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "training-operator.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not BINARY.exists():
            env = dict(os.environ, GOBIN=str(BINARY.parent), CGO_ENABLED="0",
                       GOFLAGS=(os.environ.get("GOFLAGS", "") + " -trimpath").strip())
            print(f"building {PACKAGE}@{VERSION} (cached in {BINARY.parent})", flush=True)
            subprocess.run(["go", "install", f"{PACKAGE}@{VERSION}"], env=env, check=True, cwd="/tmp")
    return BINARY


def module_dir() -> Path:
    """The module's source (its CRDs), from the Go module cache."""
    out = subprocess.run(["go", "mod", "download", "-json", f"{MODULE}@{VERSION}"], cwd="/tmp",
                         capture_output=True, text=True, check=True).stdout
    return Path(json.loads(out)["Dir"])


def pytorchjob(name: str, nodes: int, placement: dict) -> dict:
    """One Master and nodes-1 Workers: the same pod count as a DDPJob with `nodes`."""
    def replicas(n: int) -> dict:
        return {"replicas": n, "restartPolicy": "Never",
                "template": {"spec": {**placement, "containers": [{"name": "pytorch", "image": "bench/trainer:1"}]}}}
    specs = {"Master": replicas(1)}
    if nodes > 1:
        specs["Worker"] = replicas(nodes - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
            "spec": {"pytorchReplicaSpecs": specs}}


def install(cluster, *, webhook_port: int) -> None:
    """CRD, namespace, Secret, webhook configuration and loopback Service (idempotent)."""
    crd = module_dir() / "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    # (`kubectl wait` fails outright while a brand-new CRD has no conditions yet.)
    jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
    deadline = time.monotonic() + 60
    # (Nor may the jsonpath read them: kubectl exits 1 on the missing list, so check=False.)
    while cluster.kubectl("get", "crd", "pytorchjobs.kubeflow.org", "-o", f"jsonpath={jsonpath}",
                          check=False).stdout != "True":
        if time.monotonic() > deadline:
            raise RuntimeError("CRD pytorchjobs.kubeflow.org not Established after 60 s")
        time.sleep(0.5)
    docs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": NAMESPACE}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE, "namespace": NAMESPACE},
         "spec": {"type": "ExternalName", "externalName": "localhost"}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
         "metadata": {"name": WEBHOOK_CONFIG},
         "webhooks": [{"name": "validator.pytorchjob.training-operator.kubeflow.org",
                       "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
                       "clientConfig": {"service": {"name": SERVICE, "namespace": NAMESPACE, "port": webhook_port,
                                                    "path": "/validate-kubeflow-org-v1-pytorchjob"}},
                       "rules": [{"apiGroups": ["kubeflow.org"], "apiVersions": ["v1"],
                                  "operations": ["CREATE", "UPDATE"], "resources": ["pytorchjobs"]}]}]},
    ]
    # Server-side apply without caBundle: the rotator's patch of it never conflicts with ours.
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input=yaml.safe_dump_all(docs))


def uninstall(cluster) -> None:
    """Remove the webhook (it would refuse PyTorchJobs once no peer serves it) and the namespace."""
    cluster.kubectl("delete", "validatingwebhookconfiguration", WEBHOOK_CONFIG, "--ignore-not-found", check=False)
    cluster.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false", check=False)


class Peer:
    """One training-operator process serving `namespace` (PyTorchJob only)."""

    def __init__(self, cluster, *, namespace: str, tuned: bool, metrics_port: int, probe_port: int,
                 webhook_port: int, log_path: Path) -> None:
        self.cluster = cluster
        self.metrics_port, self.probe_port = metrics_port, probe_port
        cmd = [str(ensure_binary()), "--enable-scheme=pytorchjob", f"--namespace={namespace}",
               f"--metrics-bind-address=127.0.0.1:{metrics_port}",
               f"--health-probe-bind-address=127.0.0.1:{probe_port}",
               f"--webhook-server-port={webhook_port}", *(TUNED_FLAGS if tuned else DEFAULT_FLAGS)]
        self.log = open(log_path, "w")  # noqa: SIM115  (the child's for its lifetime)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=cluster.env())
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 120) -> None:
        """Copy the rotated cert where the webhook server reads it, then wait for /readyz."""
        deadline = time.monotonic() + timeout
        copied = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"training-operator exited {self.proc.returncode}; see {self.log.name}")
            if not copied:
                out = self.cluster.kubectl("get", "secret", "-n", NAMESPACE, SECRET, "-o", "json").stdout
                data = json.loads(out).get("data") or {}
                if data.get("tls.crt") and data.get("tls.key"):
                    CERT_DIR.mkdir(parents=True, exist_ok=True)
                    for key in ("tls.crt", "tls.key", "ca.crt"):
                        if data.get(key):
                            (CERT_DIR / key).write_bytes(base64.b64decode(data[key]))
                    copied = True
            else:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.probe_port}/readyz", timeout=2) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"training-operator not ready after {timeout}s; see {self.log.name}")

    def requests(self) -> dict[str, float]:
        """client-go's own count of the requests it sent (rest_client_requests_total), by method."""
        return counter(f"http://127.0.0.1:{self.metrics_port}/metrics", "rest_client_requests_total", "method")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def counter(url: str, name: str, *keys: str) -> dict[str, float]:
    """A Prometheus counter from `url`, summed by the values of label `keys` ("v1 v2"; "" for a
    series without labels)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            labels, value = line.rsplit(" ", 1)
            lab = dict(kv.split("=", 1) for kv in labels[len(name) + 1:-1].split('",') if "=" in kv)
            key = " ".join(lab.get(k, "").strip('"') for k in keys)
            out[key] = out.get(key, 0.0) + float(value)
    return out


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
