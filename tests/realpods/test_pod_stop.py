"""A deleted training pod is gone within its termination grace period, not killed at its end: the
in-pod launcher (the container's PID 1) stops torchrun's agent and workers within seconds of the
kubelet's SIGTERM (issue 18), whether they are still starting (importing torch) or training."""
from __future__ import annotations

import time

import pytest
import yaml

from tests.realpods.conftest import REAL_NODE_SCHEDULING, TRAINER_IMAGE
from tests.support.cluster import create_namespace, delete_namespace, wait_for

GRACE_SECONDS = 30  # the pod default, stated so the bound below reads against it
# A behaviour bound: the launcher's own stop sends SIGKILL after 5 s; a pod that takes the whole
# grace period was killed by the kubelet, i.e. the launcher never handled SIGTERM.
GONE_WITHIN = 20


def training_pod(namespace: str, name: str) -> dict:
    """The pod the operator renders for node 0 of a 1-node x 2-process digits job (the master is
    the pod itself, on loopback), placed on a real node."""
    from ddpjob_operator.api.config import OperatorConfig
    from ddpjob_cli.local import validate
    from ddpjob_operator.builders.render import render_pod

    job = validate({"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"nodes": 1, "nprocPerNode": 2, "gpusPerNode": 0, "image": TRAINER_IMAGE,
                             "trainer": {"dataset": "digits", "model": "mlp", "epochs": 200, "batchSize": 8,
                                         "logEverySteps": 1}}})
    pod = render_pod(job, 0, config=OperatorConfig())
    spec = pod["spec"]
    spec.update(REAL_NODE_SCHEDULING, terminationGracePeriodSeconds=GRACE_SECONDS)
    (c,) = spec["containers"]
    c["imagePullPolicy"] = "Never"
    for e in c["env"]:
        if e["name"] in ("MASTER_ADDR", "PET_MASTER_ADDR"):
            e["value"] = "127.0.0.1"
    return pod


@pytest.mark.parametrize("moment", ["start-up", "training"])
def test_a_deleted_training_pod_is_gone_within_seconds(real_cluster, moment):
    api = real_cluster.api()
    ns = create_namespace(api, prefix="real-stop-")
    name = "stop"
    pod = f"{name}-0"
    try:
        real_cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(training_pod(ns, name)))

        def phase() -> str:
            return real_cluster.kubectl("get", "pod", pod, "-n", ns, "-o", "jsonpath={.status.phase}").stdout

        wait_for(lambda: phase() == "Running", timeout=300, desc=f"pod {pod} Running", interval=0.5)
        if moment == "training":
            wait_for(lambda: " step " in real_cluster.kubectl("logs", "-n", ns, pod, check=False).stdout,
                     timeout=300, desc=f"training steps in the log of {pod}", interval=1)
        t0 = time.monotonic()
        real_cluster.kubectl("delete", "pod", pod, "-n", ns, "--wait=true", timeout=GRACE_SECONDS + 60)
        took = time.monotonic() - t0
        print(f"pod {pod} deleted at moment {moment!r}: gone after {took:.1f}s (grace {GRACE_SECONDS}s)")
        assert took < GONE_WITHIN, (f"pod {pod} deleted at moment {moment!r} took {took:.1f}s to go "
                                    f"(grace {GRACE_SECONDS}s): the kubelet had to SIGKILL it")
    finally:
        delete_namespace(api, ns)
        api.close()
