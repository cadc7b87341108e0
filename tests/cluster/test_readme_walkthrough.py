"""The local-cluster walkthrough (docs/development.md, Quick start), run as written: its command
block is read from the doc and each line runs as a user would type it (the operator with its default scrape template, in the
`default` namespace), against the cluster the suite already runs. What it must show: resnet-gpu's
pods scheduled one per simulated GPU node and Running, the progress column saying why it is
unavailable, and not one connection attempt to kwok's addresses (hack/kwok-guard.sh counts them)."""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import threading

import yaml

from tests.support.cluster import REPO_ROOT, Cluster
from tests.support.network import SCRAPE_ENV, guard_rejections
from tests.support.readme import readme_block

NAMESPACE = "default"      # the walkthrough's own
DOC = "docs/development.md"
# Lines the suite must not run: it owns the cluster's life (up before, down after the whole run).
SUITE_OWNED = ("make cluster-down",)


def readme_lines() -> list[str]:
    return readme_block("make cluster-up", "examples/resnet-gpu.yaml", doc=DOC)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_names(lines: list[str]) -> list[str]:
    files = [m for line in lines for m in re.findall(r"kubectl apply -f (\S+\.yaml)", line)]
    docs = [d for f in files for d in yaml.safe_load_all((REPO_ROOT / f).read_text()) if d]
    return [d["metadata"]["name"] for d in docs if d.get("kind") == "DDPJob"]


def _cleanup(cluster: Cluster, lines: list[str]) -> None:
    for f in {m for line in lines for m in re.findall(r"kubectl apply -f (\S+\.yaml)", line)}:
        cluster.kubectl("delete", "-n", NAMESPACE, "-f", f, "--ignore-not-found", "--wait=false", check=False)
    cluster.kubectl("delete", "pv", "-l", "ddpjob.dev/local-volume=true", "--wait=false", check=False)


def test_the_local_cluster_walkthrough_runs_as_written(cluster):
    lines = readme_lines()
    (job,) = _job_names(lines)
    # A user's shell: no scrape template from the test environment; free ports for the operator's
    # own endpoints only (the defaults may be taken by another operator on this machine).
    env = {k: v for k, v in os.environ.items() if k != SCRAPE_ENV and not k.startswith("KUBECONFIG")}
    env.update(DDPJOB_OPERATOR_METRICS_PORT=str(_free_port()), DDPJOB_HEALTH_PORT=str(_free_port()))
    _cleanup(cluster, lines)  # a run interrupted earlier
    guard_before = guard_rejections()
    assert guard_before is not None, "hack/kwok-guard.sh is not set up: cluster-up must run it"
    background: list[subprocess.Popen] = []
    watched = ""
    try:
        for line in lines:
            if line in SUITE_OWNED:
                continue
            if line.startswith("export "):
                name, value = line[len("export "):].split("=", 1)
                env[name] = os.path.expandvars(value.replace("$PWD", str(REPO_ROOT)).replace("$PATH", env["PATH"]))
                continue
            argv = shlex.split(line.rstrip("&").strip())
            if line.endswith("&"):
                background.append(subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT, text=True))
                continue
            if "-w" in argv:  # a watch: read it until the job shows Running on every node
                watched = _watch_until_running(argv, env, job)
                continue
            proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"`{line}` exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            if argv[:3] == ["kubectl", "get", "pods"]:
                pods = proc.stdout
        assert watched, "the block has no `kubectl get ddpj -w`"
        assert "n/a (not scraped)" in watched, watched
        rows = [r.split() for r in pods.strip().splitlines()[1:]]
        assert len(rows) == 4 and all(r[2] == "Running" for r in rows), pods
        assert len({r[6] for r in rows}) == 4 and all(r[6].startswith("kwok-gpu-") for r in rows), pods
        status = yaml.safe_load(cluster.kubectl("get", "ddpj", job, "-n", NAMESPACE, "-o", "yaml").stdout)["status"]
        assert "simulated (kwok) nodes" in status["progress"]["unavailable"]
        assert guard_rejections() == guard_before, "a connection attempt to a kwok address was refused meanwhile"
    finally:
        for proc in background:
            proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            print(f"--- {shlex.join(proc.args)} ---\n{out[-4000:]}")
        _cleanup(cluster, lines)


def _watch_until_running(argv: list[str], env: dict[str, str], job: str) -> str:
    """Lines of `kubectl get ddpj -w` up to the first that shows JOB Running on all its nodes."""
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    # The watch prints only on changes: a timer ends it if the awaited line never comes.
    timer = threading.Timer(180, proc.kill)
    timer.start()

    def running() -> bool:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise AssertionError(f"{job} not Running 4/4 with its progress explained within 180 s:\n{''.join(seen)}")
        seen.append(line)
        cols = line.split()
        return cols[:3] == [job, "Running", "4/4"] and "not scraped" in line

    try:
        while not running():
            pass
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()
    return "".join(seen)


def test_the_block_is_found_and_names_one_job():
    lines = readme_lines()
    assert "make cluster-up" in lines and _job_names(lines) == ["resnet50"]

