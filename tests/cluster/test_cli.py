"""The cluster commands (`ddpjob list/get/describe/wait/top/submit/delete/suspend/resume/logs`)
against the real API server, one operator for the module, pods on kwok's fake nodes.

Each command runs in this process through click's runner (a subprocess for the terminal test);
the tests check its output and exit code. A kwok pod has no log and no metrics to read (its node
and address are fictitious, and the network rule keeps every process away from them), so `logs`
and `top --live` are tested on the cluster's two real nodes (test_logs_and_top_live_on_real_pods).
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from kubernetes import client

from tests.cluster.conftest import wait_for
from tests.cluster.test_crd import install_crd
from tests.cluster.test_operator import Operator, endpoint_pods
from tests.realpods.conftest import real_cluster  # noqa: F401  (a fixture: our images on both real nodes)
from tests.support.cluster import create_namespace, delete_namespace, set_pod_exit
from ddpjob_cli.main import main

DDPJOB = str(Path(sys.executable).parent / "ddpjob")


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    """(namespace, operator, api) for the module: the CRD, a namespace, an operator watching it."""
    install_crd(cluster)
    api = cluster.api()
    ns = create_namespace(api, prefix="t-cli-")
    op = Operator(cluster, ns, tmp_path_factory.mktemp("cli") / "operator.log")
    yield ns, op, api
    op.stop()
    delete_namespace(api, ns)
    api.close()


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def ddpjob(cluster, *args: str, env: dict[str, str] | None = None) -> Ran:
    """`ddpjob ARGS` with the cluster's KUBECONFIG (and `env` on top), run in this process (an
    interpreter start per command would cost a second each); `wait` reads every 0.2 s."""
    if args[0] == "wait":
        args = (*args, "--interval", "0.2")
    res = CliRunner().invoke(main, list(args), env={"KUBECONFIG": str(cluster.kubeconfig), **(env or {})})
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return Ran(res.exit_code, res.stdout, res.stderr)


def ok(proc: Ran) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    return proc.stdout


def one_line_error(proc: Ran, code: int = 1) -> str:
    """The stderr of a command that failed as the CLI promises: `code`, one line, no traceback."""
    assert proc.returncode == code, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def job_file(tmp_path: Path, name: str, **spec) -> str:
    """A DDPJob file; `spec` fields over a 2-node GPU job of the built-in trainer (None: left out)."""
    spec = {"image": "reg/trainer:1", "nodes": 2, "gpusPerNode": 1,
            "trainer": {"dataset": "digits", "model": "mlp", "epochs": 1}, **spec}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
                                    "spec": {k: v for k, v in spec.items() if v is not None}}))
    return str(path)


def pods_of(api, ns: str, name: str) -> list[str]:
    pods = client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=f"ddpjob.dev/job-name={name}").items
    return sorted(p.metadata.name for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp)


def finish(api, ns: str, name: str, code: int, nodes: int = 2) -> None:
    """Every running pod of the job exits with `code` (kwok)."""
    pods = wait_for(lambda: (lambda p: p if len(p) == nodes else None)(pods_of(api, ns, name)),
                    timeout=30, desc=f"{nodes} running pods of {name}")
    for pod in pods if code == 0 else pods[:1]:
        set_pod_exit(api, ns, pod, code)


def test_submit_list_get_describe_top_wait_delete(cluster, env, tmp_path):
    ns, _, api = env
    name = ok(ddpjob(cluster, "submit", job_file(tmp_path, "train"), "-n", ns)).strip()
    assert name == "train"
    assert "already exists" in one_line_error(ddpjob(cluster, "submit", job_file(tmp_path, "train"), "-n", ns))
    assert ok(ddpjob(cluster, "wait", name, "--for", "Running", "--timeout", "60", "-n", ns)).strip() == "train Running"

    table = ok(ddpjob(cluster, "list", "-n", ns)).splitlines()
    assert table[0].split() == ["NAME", "PHASE", "READY", "PROGRESS", "LOSS", "SAMPLES/S", "RESTARTS", "GOODPUT", "AGE"]
    assert table[1].split()[:3] == ["train", "Running", "2/2"]
    everywhere = ok(ddpjob(cluster, "list", "-A")).splitlines()
    assert everywhere[0].startswith("NAMESPACE") and any(ln.split()[:2] == [ns, "train"] for ln in everywhere)
    assert json.loads(ok(ddpjob(cluster, "list", "-n", ns, "-o", "json")))["items"][0]["metadata"]["name"] == "train"
    assert json.loads(ok(ddpjob(cluster, "get", name, "-n", ns, "-o", "json")))["status"]["phase"] == "Running"
    assert yaml.safe_load(ok(ddpjob(cluster, "get", name, "-n", ns, "-o", "yaml")))["spec"]["nodes"] == 2
    assert ok(ddpjob(cluster, "get", name, "-n", ns, "-o", "wide")).splitlines()[0].split()[-4:] == \
        ["ETA", "ATTEMPT", "ACCURACY", "REASON"]

    text = ok(ddpjob(cluster, "describe", name, "-n", ns))
    assert "Phase:                Running" in text and "World size:         2" in text
    # The API server kept the ledger the operator wrote (status.goodput: its schema prunes nothing).
    assert re.search(r"^Goodput:\s+\d+% training of ", text, re.M), text
    ranks = [ln.split() for ln in text.split("Ranks (attempt 0):")[1].split("Failures")[0].splitlines()[2:] if ln.strip()]
    assert [r[:2] for r in ranks] == [["0", "train-0"], ["1", "train-1"]]
    assert all(r[2].startswith("kwok-gpu-") and r[3] == "Running" for r in ranks)
    assert json.loads(ok(ddpjob(cluster, "describe", name, "-n", ns, "-o", "json")))["ranks"][1]["pod"] == "train-1"
    top = ok(ddpjob(cluster, "top", name, "--once", "-n", ns))
    assert top.startswith(f"{ns}/train  Running") and "train-0" in top and "train-1" in top and "\x1b[" not in top
    live = ok(ddpjob(cluster, "top", name, "--once", "--live", "-n", ns))   # kwok pods are not asked
    assert "no process reported metrics yet" in live and "rank 1: on simulated (kwok) node kwok-gpu-" in live

    # A terminal phase that is not the wanted one ends the wait at once.
    finish(api, ns, name, 0)
    assert ok(ddpjob(cluster, "wait", name, "--for", "Succeeded", "--timeout", "60", "-n", ns)).strip() == "train Succeeded"
    assert "train is Succeeded, not Running" in one_line_error(
        ddpjob(cluster, "wait", name, "--for", "Running", "--timeout", "60", "-n", ns))
    assert ok(ddpjob(cluster, "delete", name, "-n", ns)).strip() == "ddpjob train deleted"
    assert 'DDPJob "train" not found' in one_line_error(ddpjob(cluster, "get", name, "-n", ns))


def test_wait_on_failure_and_timeout_suspend_resume(cluster, env, tmp_path):
    ns, _, api = env
    ok(ddpjob(cluster, "submit", job_file(tmp_path, "fails", failurePolicy={"maxRestarts": 0}), "-n", ns))
    ok(ddpjob(cluster, "submit", job_file(tmp_path, "later", suspend=True), "-n", ns))
    ok(ddpjob(cluster, "wait", "fails", "--for", "Running", "--timeout", "60", "-n", ns))
    finish(api, ns, "fails", 3)
    failed = ddpjob(cluster, "wait", "fails", "--timeout", "60", "-n", ns)
    assert "fails is Failed, not Succeeded" in one_line_error(failed, 1)
    text = ok(ddpjob(cluster, "describe", "fails", "-n", ns))
    failure = text.split("Failures (earlier attempts):")[1].splitlines()[2].split()
    assert failure[:3] == ["0", "0", "fails-0"] and failure[4] == "3"   # attempt, rank, pod, node, exit code
    # The operator's event about the job (posted just after the status write the wait saw).
    wait_for(lambda: "Warning" in ok(ddpjob(cluster, "describe", "fails", "-n", ns)).split("Events:")[1],
             timeout=30, desc="the failure's event in describe")

    # A suspended job never succeeds: the wait times out (2); resumed, it runs; suspended again, it says so.
    assert ok(ddpjob(cluster, "wait", "later", "--for", "Suspended", "--timeout", "60", "-n", ns)).strip() == \
        "later Suspended"
    timed_out = ddpjob(cluster, "wait", "later", "--timeout", "1", "-n", ns)
    assert "timed out after 1s waiting for later to be Succeeded (it is Suspended)" in one_line_error(timed_out, 2)
    assert ok(ddpjob(cluster, "resume", "later", "-n", ns)).strip() == "ddpjob later resumed"
    ok(ddpjob(cluster, "wait", "later", "--for", "Running", "--timeout", "60", "-n", ns))
    assert ok(ddpjob(cluster, "suspend", "later", "-n", ns)).strip() == "ddpjob later suspended"
    ok(ddpjob(cluster, "wait", "later", "--for", "Suspended", "--timeout", "60", "-n", ns))
    # Its pods are gone: logs says so instead of failing somewhere else.
    assert "no pod of rank 0 of later" in one_line_error(ddpjob(cluster, "logs", "later", "-n", ns))


def test_the_progress_bar_of_wait_on_a_terminal(cluster, env, tmp_path):
    ns, _, api = env
    ok(ddpjob(cluster, "submit", job_file(tmp_path, "bar"), "-n", ns))
    ok(ddpjob(cluster, "wait", "bar", "--for", "Running", "--timeout", "60", "-n", ns))
    custom = client.CustomObjectsApi(api)

    def show_progress() -> bool:  # the operator keeps what it did not scrape itself
        custom.patch_namespaced_custom_object_status("ddpjob.dev", "v1alpha1", ns, "ddpjobs", "bar", {
            "status": {"progress": {"step": 7, "totalSteps": 20, "percent": 35.0, "loss": 0.5}}})
        return (custom.get_namespaced_custom_object("ddpjob.dev", "v1alpha1", ns, "ddpjobs", "bar")
                .get("status", {}).get("progress", {}).get("step") == 7)
    wait_for(show_progress, timeout=20, desc="progress in the status")

    top = Terminal(cluster, "top", "bar", "--interval", "0.2", "-n", ns)   # refreshes until stopped
    try:
        assert top.read_until(lambda out: out.count(CLEAR) >= 2 and out.rstrip().endswith(b"-"), 30), top.out
    finally:
        top.stop(interrupt=True)
    screen = top.out.split(CLEAR)[-2]
    assert b"step 7/20 (35%)" in screen and b"bar-0" in screen and b"bar-1" in screen
    assert top.code == 130   # Ctrl-C

    wait = Terminal(cluster, "wait", "bar", "--timeout", "60", "--interval", "0.2", "-n", ns)
    try:
        assert wait.read_until(lambda out: b"7/20" in out, 30), wait.out
        finish(api, ns, "bar", 0)
        assert wait.read_until(lambda out: b"bar Succeeded" in out, 60), wait.out
    finally:
        wait.stop(interrupt=wait.code is None and b"bar Succeeded" not in wait.out)
    assert wait.code == 0
    assert b"phase=Running" in wait.out and b"loss=0.5" in wait.out

    # kubectl finds the kubectl-ddpjob command on PATH as its plugin.
    path = f"{Path(DDPJOB).parent}{os.pathsep}{cluster.env()['PATH']}"
    plugin = subprocess.run([str(cluster.bin_dir / "kubectl"), "ddpjob", "get", "bar", "-n", ns], capture_output=True,
                            text=True, timeout=60, env={**cluster.env(), "PATH": path})
    assert plugin.returncode == 0 and plugin.stdout.splitlines()[1].split()[:2] == ["bar", "Succeeded"], plugin


CLEAR = b"\x1b[H\x1b[2J"


class Terminal:
    """`ddpjob ARGS` (the installed command) in a pseudo-terminal of 100x24, its output read as it comes."""

    def __init__(self, cluster, *args: str):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            # Ctrl-C's default action, as a terminal's program starts with: a test run started in
            # the background of a non-interactive shell ignores SIGINT, and exec passes that on
            # (Python then keeps it ignored: a `ddpjob top` that no Ctrl-C ends).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(DDPJOB, [DDPJOB, *args], cluster.env())
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        self.out = b""
        self.code: int | None = None

    def read_until(self, done, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done(self.out) and time.monotonic() < deadline:
            if select.select([self.fd], [], [], 0.5)[0]:
                try:
                    self.out += os.read(self.fd, 4096)
                except OSError:   # the child closed the terminal
                    break
        return done(self.out)

    def stop(self, *, interrupt: bool = False) -> None:
        """Its exit code in `code` once it has ended (read to the end of its output), or with
        `interrupt` after Ctrl-C."""
        if interrupt:
            os.kill(self.pid, signal.SIGINT)
        self.read_until(lambda out: False, 30)
        deadline = time.monotonic() + 30  # a bound for a failure, never waited out when it works
        while (waited := os.waitpid(self.pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        pid, status = waited
        if pid == 0:  # still running: fail now, not after the test's whole timeout
            os.kill(self.pid, signal.SIGKILL)
            _, status = os.waitpid(self.pid, 0)
            os.close(self.fd)
            raise AssertionError(f"`ddpjob` still ran a minute after {'Ctrl-C' if interrupt else 'its output ended'}: "
                                 f"{self.out[-2000:]!r}")
        os.close(self.fd)
        self.code = os.waitstatus_to_exitcode(status)


def test_errors_are_one_line(cluster, env, tmp_path):
    ns, _, api = env
    assert 'DDPJob "nosuch" not found in namespace ' + ns in one_line_error(ddpjob(cluster, "describe", "nosuch", "-n", ns))
    missing = tmp_path / "none" / "kubeconfig"
    assert "no kubeconfig" in one_line_error(ddpjob(cluster, "list", env={"KUBECONFIG": str(missing)}))
    assert "no kubeconfig" in one_line_error(ddpjob(cluster, "list", "--kubeconfig", str(missing)))
    assert "--context" in one_line_error(ddpjob(cluster, "list", "--context", "nosuch"))
    assert "exclude each other" in ddpjob(cluster, "list", "-A", "-n", ns).stderr
    bad = job_file(tmp_path, "bad", nodes=0)
    assert "invalid DDPJob" in ddpjob(cluster, "submit", bad, "-n", ns).stderr

    # The API server's own 404 for a resource it does not serve (a CRD not installed) reads as such.
    resp = api.call_api(*api.param_serialize("GET", "/apis/nosuch.ddpjob.dev/v1alpha1/namespaces/x/ddpjobs/y",
                                              header_params={"Accept": "application/json"},
                                              auth_settings=["BearerToken"]))
    resp.read()
    from ddpjob_cli.views import api_error, missing_object
    assert resp.status == 404 and not missing_object(resp.status, resp.data)
    assert "not installed on this cluster" in api_error(resp.status, resp.data, name="y", namespace="x", verb="get")

    # No permission: a service account without RBAC.
    token = client.CoreV1Api(api).create_namespaced_service_account_token(
        "default", ns, {"spec": {"expirationSeconds": 600}}).status.token
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    admin["users"] = [{"name": "nobody", "user": {"token": token}}]
    admin["contexts"] = [{"name": "nobody", "context": {"cluster": admin["clusters"][0]["name"], "user": "nobody",
                                                         "namespace": ns}}]
    admin["current-context"] = "nobody"
    (tmp_path / "nobody").write_text(yaml.safe_dump(admin))
    denied = one_line_error(ddpjob(cluster, "list", "--kubeconfig", str(tmp_path / "nobody")))
    assert "forbidden" in denied and f"kubectl auth can-i list ddpjobs -n {ns}" in denied   # the context's namespace
    # An API server that is not there.
    admin["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"
    (tmp_path / "down").write_text(yaml.safe_dump(admin))
    assert "cannot reach the API server at https://127.0.0.1:1" in one_line_error(
        ddpjob(cluster, "list", "--kubeconfig", str(tmp_path / "down")))


# Rank 1 of attempt 0 fails at once (exit 3, two lines); then each pod prints a line, serves a fixed
# exposition on its metrics port until 2 s after its second scrape (`top --live`, then `describe
# --live`; 60 s at most), prints another line and exits 0.
REAL_POD_SCRIPT = r'''
import http.server, os, signal, time
signal.signal(signal.SIGTERM, lambda *_: os._exit(143))   # as PID 1, no default action would end it
r, port = int(os.environ["NODE_RANK"]), int(os.environ["DDPJOB_METRICS_PORT"])
if r == 1 and os.environ["DDPJOB_ATTEMPT"] == "0":
    print("rank 1 starts attempt 0", flush=True)
    print("RuntimeError: rank 1 fails attempt 0", flush=True)
    raise SystemExit(3)
print(f"hello from rank {r}", flush=True)
lab = f'rank="{r}",local_rank="0",node_rank="{r}"'
body = "".join(f"ddpjob_trainer_{m}{{{lab}}} {v}\n" for m, v in (
    ("step", 10 + r), ("samples_total", 640), ("step_seconds_sum", 2.0 * (1 + r)), ("step_seconds_count", 10)))
body += f'ddpjob_trainer_stage{{{lab},stage="training"}} 1\n'
end, scrapes = time.time() + 60, 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global end, scrapes
        scrapes += 1
        if scrapes == 2:
            end = min(end, time.time() + 2)
        self.send_response(200); self.end_headers(); self.wfile.write(body.encode())
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("", port), H)
srv.timeout = 0.2
while time.time() < end:
    srv.handle_request()
print(f"bye from rank {r}", flush=True)
'''


def test_logs_and_top_live_on_real_pods(real_cluster, env, tmp_path):
    """On the local cluster's two real nodes: after a group restart the failed rank's pod is kept
    (ended, out of the Service's endpoints) and `logs --attempt 0` reads its last lines from it,
    `top --live` reads each pod's metrics through the API server, `logs -f --all-ranks` follows
    both pods to their end, `logs --rank 1` reads one; `describe --live` shows the same numbers."""
    from tests.realpods.conftest import REAL_NODE_SCHEDULING, TRAINER_IMAGE

    cluster = real_cluster   # its fixture puts our images on both real nodes (the job pulls Never)
    ns, _, api = env
    ok(ddpjob(cluster, "submit", job_file(tmp_path, "real", gpusPerNode=0, image=TRAINER_IMAGE, imagePullPolicy="Never",
                                          launcher=False, command=["python", "-c", REAL_POD_SCRIPT], trainer=None,
                                          scheduling=REAL_NODE_SCHEDULING,
                                          failurePolicy={"maxRestarts": 1, "logTailInStatus": True}), "-n", ns))
    try:
        wait_for(lambda: "hello from rank 1" in ddpjob(cluster, "logs", "real", "--rank", "1", "-n", ns).stdout,
                 timeout=300, desc="rank 1's first line in attempt 1")
    except AssertionError as exc:   # what the job and its pods were doing, for whoever reads the failure
        pods = client.CoreV1Api(api).list_namespaced_pod(ns, label_selector="ddpjob.dev/job-name=real").items
        states = [(p.metadata.name, p.status.phase, [s.state.to_dict() for s in p.status.container_statuses or []])
                  for p in pods]
        raise AssertionError(f"{exc}\npods: {states}\n{ddpjob(cluster, 'describe', 'real', '-n', ns).stdout}") from None
    pods = {p.metadata.name: p for p in client.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector="ddpjob.dev/job-name=real").items if p.metadata.deletion_timestamp is None}
    # The failed rank's pod stays, ended; the rank that was running went with its attempt.
    assert (pods["real-1"].metadata.labels["ddpjob.dev/attempt"], pods["real-1"].status.phase) == ("0", "Failed")
    assert sorted(pods) == ["real-0-a1", "real-1", "real-1-a1"], sorted(pods)
    wait_for(lambda: endpoint_pods(api, ns, "real") == ["real-0-a1", "real-1-a1"], timeout=30,
             desc="the Service lists attempt 1's pods only")
    kept = ddpjob(cluster, "logs", "real", "--attempt", "0", "-n", ns)
    assert ok(kept).splitlines() == ["[rank 1] rank 1 starts attempt 0", "[rank 1] RuntimeError: rank 1 fails attempt 0"]
    assert kept.stderr == ""   # read from the kept pod, not from the tails in the status
    failure = ok(ddpjob(cluster, "describe", "real", "-n", ns)).split("Failures (earlier attempts):")[1].splitlines()[2]
    assert failure.split()[:5] == ["0", "1", "real-1"] + failure.split()[3:4] + ["3"] and \
        failure.rstrip().endswith("RuntimeError: rank 1 fails attempt 0"), failure

    top = ok(ddpjob(cluster, "top", "real", "--once", "--live", "-n", ns))
    procs = {ln.split()[0]: ln.split() for ln in top.split("DATA WAIT MS")[1].splitlines()[1:] if ln.strip()}
    assert procs["0"][:7] == ["0", "0", "real-0-a1", "training", "10", "-", "320.0"], top
    assert procs["1"][:8] == ["1", "1", "real-1-a1", "training", "11", "-", "160.0", "400.0"], top
    described = ok(ddpjob(cluster, "describe", "real", "--live", "-n", ns))
    live = described.split("Processes (live):")[1].split("Failures (earlier attempts):")[0].splitlines()[2:]
    assert [ln.split()[:8] for ln in live] == [procs["0"][:8], procs["1"][:8]], described

    followed = ok(ddpjob(cluster, "logs", "real", "--all-ranks", "-f", "-n", ns)).splitlines()
    assert {"[rank 0] bye from rank 0", "[rank 1] bye from rank 1", "[rank 1] hello from rank 1"} <= set(followed)
    ok(ddpjob(cluster, "wait", "real", "--timeout", "60", "-n", ns))
    assert ok(ddpjob(cluster, "logs", "real", "--rank", "1", "-n", ns)).splitlines() == \
        ["hello from rank 1", "bye from rank 1"]
