"""A tenant cannot publish metrics under another team's job: Prometheus, configured from the
chart's PodMonitor (tests/realpods/promkit.py translates `helm template` output the way
prometheus-operator does), labels a trainer's series with the namespace, job and node rank of the
pod it scraped, not with what the pod's env made the trainer report.

Two pods rendered by the operator's own builder (ddpjob_operator.builders.pods.render_pod) live on the
control plane: "theirs" in one namespace, honest, and "mine" in another, whose spec.env sets
DDPJOB_NAMESPACE/DDPJOB_NAME/NODE_RANK to theirs. Each pod's container is stood in for by a
local process running the trainer's real telemetry (Telemetry.from_env) with that container's env;
discovery lists the real Pod objects with the address swapped for the process's loopback port
(kwok pods' own addresses are fictitious: the network rule)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
from kubernetes import client

from ddpjob_operator.builders.pods import render_pod
from tests.e2e.test_prometheus import Prometheus, ensure_prometheus
from tests.realpods.promkit import LOOPBACK_ADDRESS, PodDiscovery, chart_scrape_configs, targets_report
from tests.support.builders import make_job
from tests.support.cluster import create_namespace, delete_namespace, wait_for
from tests.support.localrun import free_ports

INTERVAL = "1s"

# One rank's telemetry, labelled from the env exactly as in a training pod, served on loopback.
RANK = textwrap.dedent("""
    import os, sys, time
    from ddpjob_trainer.telemetry import Telemetry, serve_node_endpoint
    t = Telemetry.from_env()
    t.set_total_steps(10)
    t.step_started(step=1)
    serve_node_endpoint(int(sys.argv[1]), os.environ["DDPJOB_METRICS_DIR"], addr="127.0.0.1")
    print("ready", flush=True)
    time.sleep(600)
""")


def _pod(name: str, namespace: str, env: list[dict]) -> dict:
    pod = render_pod(make_job(name, namespace=namespace, nodes=1, gpusPerNode=0, env=env), 0)
    # No DDPJob owns it here: an owner reference to a missing uid would have it garbage-collected.
    pod["metadata"].pop("ownerReferences")
    return pod


def _start_rank(pod: dict, port: int, workdir) -> subprocess.Popen:
    """The pod's container as a local process: its env (the literal values), nothing of ours."""
    container = pod["spec"]["containers"][0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPJOB_")}
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    env["DDPJOB_METRICS_DIR"] = str(workdir / pod["metadata"]["name"])
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(port)], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "ready", f"{pod['metadata']['name']}: exporter exited {proc.poll()}"
    return proc


@pytest.fixture
def two_tenants(api, namespace):
    """(mine's namespace, theirs' namespace): the second made here, deleted afterwards."""
    theirs = create_namespace(api, prefix="theirs-")
    try:
        yield namespace, theirs
    finally:
        delete_namespace(api, theirs)


def test_a_pod_with_a_forged_label_env_cannot_publish_under_another_job(cluster, api, two_tenants, tmp_path):
    mine_ns, theirs_ns = two_tenants
    forged = [{"name": "DDPJOB_NAMESPACE", "value": theirs_ns}, {"name": "DDPJOB_NAME", "value": "theirs"},
              {"name": "NODE_RANK", "value": "7"}]
    pods = {"theirs": _pod("theirs", theirs_ns, []), "mine": _pod("mine", mine_ns, forged)}
    core = client.CoreV1Api(api)
    for pod in pods.values():
        core.create_namespaced_pod(pod["metadata"]["namespace"], pod)
    ports = dict(zip(pods, free_ports(len(pods))))
    by_pod = {(p["metadata"]["namespace"], p["metadata"]["name"]): f"127.0.0.1:{ports[k]}" for k, p in pods.items()}
    procs, prom, discovery = [], None, None
    try:
        procs = [_start_rank(pods[k], ports[k], tmp_path) for k in pods]
        prom_bin, _ = ensure_prometheus()
        discovery = PodDiscovery(api, address=lambda pod, _port: by_pod[(pod.metadata.namespace, pod.metadata.name)])
        pod_monitor = chart_scrape_configs(release="t", operator_namespace=mine_ns, job_namespaces=[mine_ns, theirs_ns],
                                           kubeconfig=cluster.kubeconfig, interval=INTERVAL, discovery=discovery,
                                           address_regex=LOOPBACK_ADDRESS)[0]
        assert pod_monitor["job_name"].startswith("podMonitor/"), pod_monitor
        # The chart before this fix (honorLabels on), beside it: shows the forged env would have won.
        honored = dict(copy.deepcopy(pod_monitor), job_name="honored", honor_labels=True)
        prom = Prometheus(prom_bin, tmp_path / "prom", targets={}, scrape_configs=[pod_monitor, honored])

        def scraped(job: str):
            return prom.series(f'ddpjob_trainer_total_steps{{job="{job}"}}')

        # The pods reach Running (kwok) and discovery refreshes before both targets are scraped.
        try:
            got = wait_for(lambda: len(scraped(pod_monitor["job_name"])) == 2 and len(scraped("honored")) == 2
                           and scraped(pod_monitor["job_name"]), timeout=90, interval=1,
                           desc="both stand-in pods scraped by both jobs")
        except AssertionError:
            print(targets_report(prom))
            raise
        labels = {s["metric"]["pod"]: s["metric"] for s in got}
        assert {k: (m["namespace"], m["ddpjob"], m["node_rank"]) for k, m in labels.items()} == {
            "theirs-0": (theirs_ns, "theirs", "0"), "mine-0": (mine_ns, "mine", "0")}, got
        # Nothing of what the pod reported is kept beside the metadata's labels.
        assert not [k for m in labels.values() for k in m if k.startswith("exported_")], got
        # Their job's series come from their pod only, through every label a dashboard selects on.
        theirs = prom.series(f'{{namespace="{theirs_ns}", ddpjob="theirs", job="{pod_monitor["job_name"]}"}}')
        assert theirs and {s["metric"]["pod"] for s in theirs} == {"theirs-0"}, theirs

        honored_labels = {s["metric"]["pod"]: s["metric"] for s in scraped("honored")}
        assert (honored_labels["mine-0"]["namespace"], honored_labels["mine-0"]["ddpjob"]) == (theirs_ns, "theirs"), \
            "the forged env should have won with honorLabels on; the test would prove nothing"
    finally:
        if prom is not None:
            prom.stop()
        if discovery is not None:
            discovery.stop()
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
        for pod in pods.values():
            core.delete_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"], grace_period_seconds=0)
