"""The trainer image runs every feature a spec field turns on (issue 27): a two-node job with
`trainer.mlflow` and `compile: true`, on the image the real nodes run. Without the MLflow client,
gcc, g++ or Python's headers in the image the launcher's pre-flight fails the job (exit 78)
naming the field; the image's build compiles a function with inductor to prove the toolchain."""
from __future__ import annotations

from tests.realpods.conftest import (
    REAL_NODE_SCHEDULING,
    TRAINER_IMAGE,
    apply_docs,
    shared_checkpoint_pv,
    stalled,
    wait_job,
)

CLAIM = "features-data"
EXPERIMENT = "image-features"


def features_job() -> list[dict]:
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM},
             "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}}
    job = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "features"},
           "spec": {
               "nodes": 2, "nprocPerNode": 1, "gpusPerNode": 0, "image": TRAINER_IMAGE,
               "trainer": {"dataset": "digits", "model": "mlp", "epochs": 1, "batchSize": 32, "maxSteps": 6,
                           "logEverySteps": 2, "compile": True,
                           "mlflow": {"trackingUri": "file:///data/mlruns", "experiment": EXPERIMENT,
                                      "runName": "features"}},
               # MLflow 3 refuses a file store unless asked: a file store is what a test can read
               # back without a tracking server.
               "env": [{"name": "MLFLOW_ALLOW_FILE_STORE", "value": "true"}],
               "scheduling": dict(REAL_NODE_SCHEDULING),
               "failurePolicy": {"maxRestarts": 0, "logTailInStatus": True},
               "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
               "podSecurityContext": {"fsGroup": 10001},
               "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": CLAIM}}],
               "volumeMounts": [{"name": "data", "mountPath": "/data"}]}}
    return [claim, job]


def test_image_runs_a_job_with_mlflow_and_compile_on(real_cluster, namespaces, tmp_path):
    ns = namespaces["features"]
    data = shared_checkpoint_pv(real_cluster, claim=CLAIM, namespace=ns, tmp=tmp_path)
    apply_docs(real_cluster, features_job(), ns)
    st = wait_job(real_cluster, ns, "features", lambda s: s.get("phase") in {"Succeeded", "Failed"},
                  give_up=stalled, desc="the job's end", timeout=600)
    assert st["phase"] == "Succeeded", (st.get("message"), st.get("failures"))

    # MLflow: rank 0's run, finished, with its params and the loss logged at each log step.
    metas = [p for p in (data / "mlruns").rglob("meta.yaml") if (p.parent / "metrics").is_dir()]
    assert len(metas) == 1, f"one MLflow run expected under {data / 'mlruns'}: {metas}"
    run = metas[0].parent
    meta = metas[0].read_text()
    assert "run_name: features" in meta and "status: 3" in meta, meta  # 3: RunStatus.FINISHED
    losses = (run / "metrics" / "train_loss").read_text().split("\n")
    assert len([line for line in losses if line.strip()]) >= 2, losses
    assert (run / "params" / "world_size").read_text().strip() == "2"
