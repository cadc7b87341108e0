"""A deleted training pod is gone within its termination grace period, not killed at its end: the
in-pod launcher stops torchrun's agent and workers within seconds of the kubelet's SIGTERM (issue
18), whether they are still starting (importing torch) or training. Deleted as soon as it runs, the
launcher may not have its handlers yet: as its container's PID 1 it would drop that SIGTERM and
wait for the SIGKILL (a CI run's failure, 31 s), in the pod's shared PID namespace it just ends. Deleted
mid-epoch, the built-in trainer first saves a checkpoint of that step, its grace derived by the
operator from the pod's terminationGracePeriodSeconds, and the next attempt resumes from it (issue 31)."""
from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest
import yaml

from tests.realpods.conftest import REAL_NODE_SCHEDULING, TRAINER_IMAGE
from tests.support.cluster import REPO_ROOT, create_namespace, delete_namespace, wait_for

GRACE_SECONDS = 30  # the pod default, stated so the bound below reads against it
# A behaviour bound: the launcher's own stop sends SIGKILL after the grace less its margin; a pod
# that takes the whole grace period was killed by the kubelet, i.e. the launcher never handled SIGTERM.
GONE_WITHIN = 20
CKPT = "/ckpt"


def training_pod(namespace: str, name: str, *, volume: str, attempt: int = 0, env: tuple = ()) -> dict:
    """The pod the operator renders for node 0 of a 1-node x 2-process digits job (the master is
    the pod itself, on loopback), placed on a real node. Checkpoints at epoch ends only, on a
    hostPath both real nodes share; its steps slowed a little, so a deletion lands mid-epoch."""
    from ddpjob_operator.base.config import OperatorConfig
    from ddpjob_cli.local import validate
    from ddpjob_operator.builders.render import render_pod

    job = validate({"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"nodes": 1, "nprocPerNode": 2, "gpusPerNode": 0, "image": TRAINER_IMAGE,
                             "trainer": {"dataset": "digits", "model": "mlp", "epochs": 200, "batchSize": 8,
                                         "logEverySteps": 1, "checkpoint": {"dir": CKPT, "everySteps": 0}},
                             "env": [{"name": "DDPJOB_DEBUG_STEP_SLEEP", "value": "0.05"}, *env],
                             "volumes": [{"name": "ckpt", "hostPath": {"path": volume, "type": "Directory"}}],
                             "volumeMounts": [{"name": "ckpt", "mountPath": CKPT}],
                             "template": {"spec": {"terminationGracePeriodSeconds": GRACE_SECONDS}}}})
    pod = render_pod(job, 0, attempt=attempt, config=OperatorConfig())
    spec = pod["spec"]
    spec.update(REAL_NODE_SCHEDULING)
    (c,) = spec["containers"]
    c["imagePullPolicy"] = "Never"
    for e in c["env"]:  # a bare pod: no headless Service names it, its rendezvous is its own
        if e["name"] in ("MASTER_ADDR", "PET_MASTER_ADDR"):
            e["value"] = "127.0.0.1"
        elif e["name"] == "PET_RDZV_ENDPOINT":
            e["value"] = "127.0.0.1:" + e["value"].rsplit(":", 1)[1]
    return pod


def complete_checkpoints(volume) -> list[int]:
    from ddpjob_trainer.checkpointing.checkpoint import MANIFEST
    return sorted(int(p.name.split("-")[1]) for p in volume.glob("step-*") if (p / MANIFEST).is_file())


# "before-handlers": the launcher made to start slowly (debug.delay_launcher_start), deleted before
# it has a SIGTERM handler; "start-up": right after Running (torchrun's workers importing torch).
@pytest.mark.parametrize("moment", ["before-handlers", "start-up", "training"])
def test_a_deleted_training_pod_is_gone_within_seconds(real_cluster, moment):
    api = real_cluster.api()
    ns = create_namespace(api, prefix="real-stop-")
    name = "stop"
    pod = f"{name}-0"
    volume = (REPO_ROOT / ".cache" / "cluster" / "volumes" / ns / "ckpt").resolve()
    volume.mkdir(parents=True)
    volume.chmod(0o1777)  # the image runs as a non-root user; hostPath ignores fsGroup
    follow = None
    try:
        from ddpjob_trainer.debug import LAUNCHER_START_LINE
        slow = moment == "before-handlers"
        manifest = training_pod(ns, name, volume=str(volume),
                                env=[{"name": "DDPJOB_DEBUG_LAUNCHER_START", "value": "600"}] if slow else [])
        assert {"name": "DDPJOB_STOP_GRACE_SECONDS", "value": "23"} in manifest["spec"]["containers"][0]["env"]
        real_cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(manifest))

        def phase() -> str:
            return real_cluster.kubectl("get", "pod", pod, "-n", ns, "-o", "jsonpath={.status.phase}").stdout

        wait_for(lambda: phase() == "Running", timeout=300, desc=f"pod {pod} Running", interval=0.5)
        if slow:
            line = LAUNCHER_START_LINE.format(seconds=600)
            wait_for(lambda: line in real_cluster.kubectl("logs", "-n", ns, pod, check=False).stdout,
                     timeout=120, desc=f"{line!r} in the log of {pod}", interval=0.5)
        if moment == "training":
            # The first epoch's checkpoint measured a save; the pod is deleted inside the second epoch.
            wait_for(lambda: complete_checkpoints(volume), timeout=300, desc=f"epoch 0's checkpoint in {volume}",
                     interval=0.2)
            follow = subprocess.Popen(["kubectl", "logs", "-f", "-n", ns, pod], env=real_cluster.env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t0 = time.monotonic()
        real_cluster.kubectl("delete", "pod", pod, "-n", ns, "--wait=true", timeout=GRACE_SECONDS + 60)
        took = time.monotonic() - t0
        print(f"pod {pod} deleted at moment {moment!r}: gone after {took:.1f}s (grace {GRACE_SECONDS}s)")
        assert took < GONE_WITHIN, (f"pod {pod} deleted at moment {moment!r} took {took:.1f}s to go "
                                    f"(grace {GRACE_SECONDS}s): the kubelet had to SIGKILL it")
        if moment != "training":
            return
        log, _ = follow.communicate(timeout=60)  # ends with the container
        saved = re.search(r"stop requested \(SIGTERM\): saving a checkpoint at step (\d+) \(epoch 1, sample (\d+)\)", log)
        assert saved, log[-3000:]
        step, sample = int(saved.group(1)), int(saved.group(2))
        epoch_end = complete_checkpoints(volume)[0]
        assert step > epoch_end and sample > 0, (epoch_end, step, sample)
        assert complete_checkpoints(volume) == [epoch_end, step], log[-3000:]

        # The next attempt (what the operator's group restart creates) resumes from that step.
        again = training_pod(ns, name, volume=str(volume), attempt=1)
        pod = again["metadata"]["name"]   # an attempt's own pod name (keepFailedAttempts keeps the last)
        real_cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(again))
        resumed = f"resumed from {CKPT}/step-{step:08d} at step {step} (epoch 1, sample {sample} of "
        wait_for(lambda: resumed in real_cluster.kubectl("logs", "-n", ns, pod, check=False).stdout,
                 timeout=300, desc=f"{resumed!r} in the log of {pod}, attempt 1", interval=1)
    finally:
        if follow is not None and follow.poll() is None:
            follow.kill()
            follow.wait()
        delete_namespace(api, ns)
        api.close()
        shutil.rmtree(volume.parent, ignore_errors=True)
