"""spec.template on real pods: an init container stages a file the training container reads, and a
native sidecar (an init container with restartPolicy Always) runs beside the training until the
kubelet stops it, so the pod, and the job, still complete."""
from __future__ import annotations

import json

from ddpjob_api import contract

from tests.realpods.conftest import REAL_NODE_SCHEDULING, TRAINER_IMAGE, apply_docs, wait_phase

STAGED = {"name": "staged", "mountPath": "/staged"}
# A sidecar that stops at once when the kubelet ends it (PID 1 ignores a SIGTERM it has no handler for).
SIDECAR = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(86400)"


def hardened() -> dict:
    """What Pod Security "restricted" asks of a container: the operator hardens its own, the
    template's are the user's to harden."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def templated_job(token: str) -> dict:
    """Two nodes, a few steps; the training starts only when the init container's file is there."""
    return {
        "apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "templated"},
        "spec": {
            "nodes": 2, "nprocPerNode": 1, "image": TRAINER_IMAGE,
            "command": ["sh", "-c", f'test "$(cat /staged/token)" = {token} && echo "saw $(cat /staged/token)" '
                                    "&& exec torchrun -m ddpjob_trainer"],
            "env": [{"name": contract.ENV_TRAINER_CONFIG, "value": json.dumps(
                {"dataset": "digits", "model": "mlp", "epochs": 1, "maxSteps": 5})}],
            "failurePolicy": {"maxRestarts": 0, "logTailInStatus": True},
            "scheduling": REAL_NODE_SCHEDULING,
            "template": {
                "metadata": {"labels": {"template-test": "yes"}},
                "spec": {
                    "terminationGracePeriodSeconds": 10,
                    "volumes": [{"name": "staged", "emptyDir": {}}],
                    "initContainers": [
                        {"name": "stage", "image": TRAINER_IMAGE, "command": ["sh", "-c", f"echo {token} > /staged/token"],
                         "volumeMounts": [STAGED], "securityContext": hardened()},
                        {"name": "sidecar", "image": TRAINER_IMAGE, "restartPolicy": "Always",
                         "command": ["python", "-c", SIDECAR], "securityContext": hardened()},
                    ],
                    "containers": [{"name": "trainer", "volumeMounts": [STAGED]}],
                },
            },
        },
    }


def test_init_container_and_native_sidecar_from_the_template(real_cluster, namespaces):
    ns = namespaces["template"]
    token = f"staged-by-init-{ns}"
    apply_docs(real_cluster, [templated_job(token)], ns)

    st = wait_phase(real_cluster, ns, "templated", {"Succeeded", "Failed"}, timeout=900)
    assert st["phase"] == "Succeeded", st
    for rank in (0, 1):
        name = f"templated-{rank}"
        assert f"saw {token}" in real_cluster.kubectl("logs", "-n", ns, name, "-c", "trainer").stdout
        pod = json.loads(real_cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)
        assert pod["metadata"]["labels"]["template-test"] == "yes"
        assert [c["name"] for c in pod["spec"]["initContainers"]] == ["stage", "sidecar"]
        assert pod["status"]["phase"] == "Succeeded"
        # The sidecar ran beside the training, then the kubelet stopped it.
        sidecar = next(s for s in pod["status"]["initContainerStatuses"] if s["name"] == "sidecar")
        assert "terminated" in sidecar["state"], sidecar
