"""The DDPJob CRD on the real API server: installs, defaults, and refuses bad specs by field name."""
from __future__ import annotations

import json

import pytest
import yaml

from ddpjob_api.crdschema import crd_path
from tests.cluster.conftest import wait_for
from tests.support.cluster import wait_crd_established


def install_crd(cluster) -> None:
    """kubectl apply the chart's CRD and wait until it is Established (idempotent)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_path()))
    wait_crd_established(cluster, "ddpjobs.ddpjob.dev")


@pytest.fixture(scope="module")
def crd(cluster):
    install_crd(cluster)
    return cluster


def manifest(name="job", **spec):
    return {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
            "spec": {"image": "reg/trainer:1", "nodes": 2, **spec}}


def apply(cluster, ns, obj):
    return cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(obj), check=False)


def test_crd_established_with_short_name_and_columns(crd, namespace):
    out = crd.kubectl("api-resources", "--api-group=ddpjob.dev", "-o", "wide").stdout
    assert "ddpj" in out and "DDPJob" in out and "true" in out  # namespaced
    assert apply(crd, namespace, manifest()).returncode == 0
    head = crd.kubectl("get", "ddpj", "-n", namespace).stdout.splitlines()[0].split()
    assert head[:8] == ["NAME", "PHASE", "READY", "PROGRESS", "LOSS", "ACCURACY", "RESTARTS", "GOODPUT"]
    assert head[-1] == "AGE"


def test_defaults_applied_by_the_api_server(crd, namespace):
    apply(crd, namespace, manifest("defaults"))
    spec = json.loads(crd.kubectl("get", "ddpj", "defaults", "-n", namespace, "-o", "json").stdout)["spec"]
    assert spec["nprocPerNode"] == "auto" and spec["gpusPerNode"] == 0
    assert spec["masterPort"] == 29500 and spec["metricsPort"] == 9400
    assert spec["failurePolicy"] == {"maxRestarts": 3, "restartOnHang": True, "logTailInStatus": False,
                                     "keepFailedAttempts": 1}
    assert spec["cleanPodPolicy"] == "Running" and spec["launcher"] is True and spec["suspend"] is False


@pytest.mark.parametrize("name,spec,field", [
    ("job", {"nodes": 0}, "spec.nodes"),
    ("job", {"nprocPerNode": "many"}, "spec.nprocPerNode"),
    ("job", {"nprocPerNode": 0}, "spec.nprocPerNode"),
    ("job", {"gpusPerNode": -1}, "spec.gpusPerNode"),
    ("job", {"gpusPerNode": 2, "nprocPerNode": 4}, "spec.nprocPerNode must be <= spec.gpusPerNode"),
    ("job", {"scheduling": {"onePodPerNode": "no"}}, "spec.scheduling.onePodPerNode"),
    ("job", {"nodes": 4, "elastic": {"minNodes": 6, "maxNodes": 2}}, "spec.elastic.minNodes"),
    ("job", {"masterPort": 70000}, "spec.masterPort"),
    ("job", {"metricsPort": 0}, "spec.metricsPort"),
    ("job", {"masterPort": 9400}, "spec.masterPort and spec.metricsPort must differ"),
    ("job", {"shmSize": "lots"}, "spec.shmSize"),
    ("job", {"cleanPodPolicy": "Sometimes"}, "spec.cleanPodPolicy"),
    ("job", {"failurePolicy": {"maxRestarts": -1}}, "spec.failurePolicy.maxRestarts"),
    ("job", {"podLabels": {"ddpjob.dev/job-name": "other"}}, "spec.podLabels must not use ddpjob.dev/ keys"),
    ("job", {"podLabels": {"x.ddpjob.dev/attempt": "9"}}, "spec.podLabels must not use ddpjob.dev/ keys"),
    ("job", {"podAnnotations": {"ddpjob.dev/counted-restarts": "0"}},
     "spec.podAnnotations must not use ddpjob.dev/ keys"),
    ("job", {"activeDeadlineSeconds": 0}, "spec.activeDeadlineSeconds"),
    ("job", {"trainer": {"model": "vgg19"}}, "spec.trainer.model"),
    ("job", {"trainer": {"numWorkers": -1}}, "spec.trainer.numWorkers"),   # a CEL rule the local validator once missed
    ("job", {"trainer": {"batch_size": 8}}, "spec.trainer.batch_size"),   # unknown key: strict decoding
    ("j" * 59, {}, "metadata.name"),
    # spec.template: what the operator owns, refused with the reason (CEL; the local validator evaluates the same rules).
    ("job", {"template": {"spec": {"restartPolicy": "Always"}}}, "spec.template.spec.restartPolicy must be Never"),
    ("job", {"template": {"spec": {"hostname": "fixed"}}}, "spec.template.spec.hostname must not be set"),
    ("job", {"template": {"spec": {"containers": [{"name": "trainer", "image": "other"}]}}},
     "the trainer container's image, command, args"),
    ("job", {"template": {"metadata": {"labels": {"ddpjob.dev/job-name": "other"}}}},
     "spec.template.metadata.labels must not use ddpjob.dev/ keys"),
    # spec.rdma: an extended resource's name, and only for GPU jobs (NCCL's traffic).
    ("job", {"gpusPerNode": 8, "rdma": {"resource": "infiniband"}}, "spec.rdma.resource"),
    ("job", {"gpusPerNode": 8, "rdma": {"resource": "rdma/ib", "devicesPerNode": 0}}, "spec.rdma.devicesPerNode"),
    ("job", {"rdma": {"resource": "rdma/ib"}}, "spec.rdma needs spec.gpusPerNode > 0"),
    # spec.scheduling.gang: the schedulers the operator knows, and each one's own options.
    ("job", {"scheduling": {"gang": {"scheduler": "kube-batch"}}}, "spec.scheduling.gang.scheduler"),
    ("job", {"scheduling": {"gang": {"scheduler": "coscheduling", "queue": "q"}}},
     "spec.scheduling.gang.queue applies to scheduler volcano only"),
    ("job", {"scheduling": {"gang": {"scheduler": "volcano", "scheduleTimeoutSeconds": 9}}},
     "spec.scheduling.gang.scheduleTimeoutSeconds applies to scheduler coscheduling only"),
])
def test_invalid_spec_refused_naming_the_field(crd, namespace, name, spec, field):
    proc = apply(crd, namespace, manifest(name, **spec))
    assert proc.returncode != 0, f"accepted: {spec}"
    assert field in proc.stderr, proc.stderr
    # The local validator (same CRD file) agrees and names the same field.
    from ddpjob_api.validation import validate_manifest
    assert any(field in p for p in validate_manifest(manifest(name, **spec)))


@pytest.mark.parametrize("change,field", [
    ({"nodes": 3}, "spec.nodes is immutable"),
    ({"gpusPerNode": 8}, "spec.gpusPerNode is immutable"),
    ({"image": "reg/trainer:2"}, "spec.image is immutable"),
    ({"command": ["torchrun", "x.py"]}, "spec.command is immutable"),
    ({"trainer": {"epochs": 5}}, "spec.trainer is immutable"),
    ({"scheduling": {"gang": {"scheduler": "volcano"}}}, "spec.scheduling.gang is immutable"),
])
def test_immutable_fields_but_suspend_may_change(crd, namespace, change, field):
    assert apply(crd, namespace, manifest("imm", trainer={"epochs": 1})).returncode == 0
    proc = crd.kubectl("patch", "ddpj", "imm", "-n", namespace, "--type", "merge",
                       "-p", json.dumps({"spec": change}), check=False)
    assert proc.returncode != 0 and field in proc.stderr, proc.stderr
    crd.kubectl("patch", "ddpj", "imm", "-n", namespace, "--type", "merge", "-p", '{"spec":{"suspend":true}}')


def test_status_fields_are_not_pruned(crd, namespace, api):
    from kubernetes import client

    apply(crd, namespace, manifest("st"))
    status = {"phase": "Running", "restarts": 2, "masterAddr": "st-0.st.x.svc", "attempt": 2,
              "nodes": {"total": 2, "pending": 0, "running": 2, "succeeded": 0, "failed": 0, "ready": "2/2"},
              "progress": {"epoch": 1, "step": 10, "totalSteps": 100, "percent": 10.0, "loss": 0.5,
                           "samplesPerSecond": 99.5, "eta": "1m", "lastStepTime": "2026-11-22T00:00:00Z"},
              "conditions": [{"type": "Running", "status": "True", "reason": "Running", "message": "",
                              "lastTransitionTime": "2026-11-22T00:00:00Z"},
                             {"type": "ContainersNotStarting", "status": "False", "reason": "Started",
                              "message": "", "lastTransitionTime": "2026-11-22T00:00:00Z"}],
              "failures": [{"attempt": 1, "pod": "st-0", "rank": 0, "container": "trainer", "exitCode": 137,
                            "signal": 9, "reason": "OOMKilled", "node": "gpu-1",
                            "finishedAt": "2026-11-22T00:00:00Z", "logTail": "Killed"}]}
    co = client.CustomObjectsApi(api)
    co.patch_namespaced_custom_object_status("ddpjob.dev", "v1alpha1", namespace, "ddpjobs", "st",
                                             {"status": status})
    got = wait_for(lambda: co.get_namespaced_custom_object("ddpjob.dev", "v1alpha1", namespace, "ddpjobs", "st")
                   .get("status"), timeout=10, desc="status written")
    for key, value in status.items():
        assert got[key] == value, key


@pytest.mark.parametrize("edit,field", [
    ({"countedRestarts": -100}, "status.countedRestarts"),
    ({"restarts": -1}, "status.restarts"),
    ({"attempt": 2 ** 63 - 1}, "status.attempt"),
    ({"attempt": -1}, "status.attempt"),
    ({"launchedAttempt": 1000001}, "status.launchedAttempt"),
])
def test_status_counters_are_bounded_by_the_schema(crd, namespace, api, edit, field):
    """A status edit (anyone with ddpjobs/status patch) cannot wedge the job with absurd counters."""
    apply(crd, namespace, manifest("bounded"))
    proc = crd.kubectl("patch", "ddpj", "bounded", "-n", namespace, "--subresource", "status", "--type", "merge",
                       "-p", json.dumps({"status": edit}), check=False)
    assert proc.returncode != 0 and field in proc.stderr, proc.stderr


# -- pod-level fields: Kubernetes' own core/v1 schemas in the CRD (hack/gen-crd-schemas.py) ----------
POD_FIELD_MISTAKES = [
    ({"resources": {"limts": {"memory": "8Gi"}}}, 'unknown field "spec.resources.limts"'),
    ({"resources": {"limits": {"memory": "8 GB"}}}, "spec.resources.limits.memory"),
    ({"scheduling": {"tolerations": [{"kye": "nvidia.com/gpu", "operator": "Exists"}]}},
     'unknown field "spec.scheduling.tolerations[0].kye"'),
    ({"scheduling": {"tolerations": [{"key": "gpu", "tolerationSeconds": "soon"}]}},
     "spec.scheduling.tolerations[0].tolerationSeconds"),
    ({"volumes": [{"name": "data", "persistentVolumeClam": {"claimName": "x"}}]},
     'unknown field "spec.volumes[0].persistentVolumeClam"'),
    ({"volumeMounts": [{"name": "data", "mountpath": "/data"}]}, 'unknown field "spec.volumeMounts[0].mountpath"'),
    ({"volumeMounts": [{"name": "data"}]}, "spec.volumeMounts[0].mountPath"),
    ({"env": [{"name": "A=B", "value": "x"}]}, "spec.env[0].name"),
    ({"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "kee": "k"}}}]},
     'unknown field "spec.env[0].valueFrom.secretKeyRef.kee"'),
    ({"envFrom": [{"configMapRef": {"nmae": "cm"}}]}, 'unknown field "spec.envFrom[0].configMapRef.nmae"'),
    ({"securityContext": {"runAsUser": "root"}}, "spec.securityContext.runAsUser"),
    ({"podSecurityContext": {"fsgroup": 1000}}, 'unknown field "spec.podSecurityContext.fsgroup"'),
    ({"scheduling": {"affinity": {"nodeAffinity": {"required": {}}}}},
     'unknown field "spec.scheduling.affinity.nodeAffinity.required"'),
    # spec.template: a misspelt field would be pruned silently (the pods would run without it) if
    # anything below the template kept unknown fields; the API server must name it instead.
    ({"template": {"spec": {"initContainer": [{"name": "stage", "image": "busybox"}]}}},
     'unknown field "spec.template.spec.initContainer"'),
    ({"template": {"spec": {"containers": [{"name": "trainer", "livenesProbe": {"exec": {"command": ["true"]}}}]}}},
     'unknown field "spec.template.spec.containers[0].livenesProbe"'),
    ({"template": {"metadata": {"lables": {"team": "vision"}}}}, 'unknown field "spec.template.metadata.lables"'),
    ({"template": {"spec": {"containers": [{"image": "sidecar"}]}}}, "spec.template.spec.containers[0].name"),
    ({"template": {"spec": {"terminationGracePeriodSeconds": "long"}}},
     "spec.template.spec.terminationGracePeriodSeconds"),
]


@pytest.mark.parametrize("spec,field", POD_FIELD_MISTAKES, ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("how", ["apply", "create"])
def test_pod_level_mistakes_refused_naming_the_field(crd, namespace, spec, field, how):
    """What a user types: `kubectl apply -f` (strict field validation is kubectl's default) and
    `kubectl create --validate=strict`; the API server answers with the field's path."""
    obj = manifest("podfields", **spec)
    if how == "apply":
        proc = apply(crd, namespace, obj)
    else:
        proc = crd.kubectl("create", "--validate=strict", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj),
                           check=False)
    assert proc.returncode != 0, f"accepted: {spec}"
    assert field in proc.stderr, proc.stderr


def dry_run_pod(cluster, ns, env_name):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
           "spec": {"containers": [{"name": "c", "image": "i", "env": [{"name": env_name, "value": "1"}]}]}}
    return cluster.kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", input=yaml.safe_dump(pod), check=False)


@pytest.mark.parametrize("env_name", ["1BAD", "A=B", "with space", "OK_NAME", "ü"])
def test_env_names_accepted_exactly_when_a_pod_accepts_them(crd, namespace, env_name):
    """The DDPJob refuses the env names this Kubernetes refuses in a Pod, and only those (1.34+
    accepts any printable ASCII but '=': `1BAD` is a valid name now)."""
    pod_ok = dry_run_pod(crd, namespace, env_name).returncode == 0
    job = crd.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-",
                      input=yaml.safe_dump(manifest("envname", env=[{"name": env_name, "value": "1"}])), check=False)
    assert (job.returncode == 0) == pod_ok, job.stderr
    if not pod_ok:
        assert "spec.env[0].name" in job.stderr


def test_full_pod_level_spec_accepted_and_its_pods_too(crd, namespace):
    """A DDPJob using every pod-level field is stored as written, and the pods the operator renders
    from it pass the API server's Pod validation (the two schemas agree on valid input)."""
    from ddpjob_operator.builders.pods import render_pod
    from ddpjob_operator.builders.service import render_service
    from ddpjob_api.spec import from_manifest

    spec = {
        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optional": True}}}],
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CFG_"}],
        "resources": {"limits": {"cpu": 2, "memory": "8Gi"}, "requests": {"cpu": "500m", "memory": "4Gi"}},
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
                    {"name": "ckpt", "emptyDir": {"sizeLimit": "1Gi"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True},
                         {"name": "ckpt", "mountPath": "/ckpt"}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000,
                               "seccompProfile": {"type": "RuntimeDefault"}},
        "imagePullSecrets": [{"name": "regcred"}],
        "scheduling": {"nodeSelector": {"gpu": "a100"},
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                       "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                           {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                               "labelSelector": {"matchLabels": {"a": "b"}}}}]}},
                       "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                      "whenUnsatisfiable": "ScheduleAnyway"}]},
    }
    obj = manifest("full", **spec)
    proc = apply(crd, namespace, obj)
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(crd.kubectl("get", "ddpj", "full", "-n", namespace, "-o", "json").stdout)
    for key, value in spec.items():
        assert stored["spec"][key] == value, key                  # nothing pruned
    job = from_manifest(stored)
    for obj in [render_service(job), render_pod(job, 0)]:
        obj["metadata"].pop("ownerReferences", None)
        proc = crd.kubectl("create", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", "-",
                           input=yaml.safe_dump(obj), check=False)
        assert proc.returncode == 0, proc.stderr


def test_an_rdma_job_is_stored_defaulted_and_its_pods_pass_pod_validation(crd, namespace):
    """spec.rdma under the real schema (devicesPerNode defaults to 1), and the pods it renders (the
    device as request = limit, IPC_LOCK added to the dropped ALL) are Pods this API server accepts."""
    from ddpjob_operator.builders.pods import render_pod
    from ddpjob_api.spec import from_manifest

    proc = apply(crd, namespace, manifest("rdma", gpusPerNode=8, rdma={"resource": "rdma/ib"},
                                          resources={"requests": {"rdma/ib": "1", "cpu": "4"}}))
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(crd.kubectl("get", "ddpj", "rdma", "-n", namespace, "-o", "json").stdout)
    assert stored["spec"]["rdma"] == {"resource": "rdma/ib", "devicesPerNode": 1}
    pod = render_pod(from_manifest(stored), 0)
    pod["metadata"].pop("ownerReferences", None)
    proc = crd.kubectl("create", "--dry-run=server", "--validate=strict", "-n", namespace, "-o", "json", "-f", "-",
                       input=yaml.safe_dump(pod), check=False)
    assert proc.returncode == 0, proc.stderr
    (c,) = json.loads(proc.stdout)["spec"]["containers"]
    assert c["resources"]["limits"]["rdma/ib"] == c["resources"]["requests"]["rdma/ib"] == "1"
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


TEMPLATE = {
    "metadata": {"labels": {"team": "vision"}, "annotations": {"note": "staged"}},
    "spec": {
        "initContainers": [
            {"name": "stage", "image": "busybox", "command": ["sh", "-c", "echo ok > /data/ok"],
             "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
            {"name": "shipper", "image": "fluent-bit", "restartPolicy": "Always"},      # a native sidecar
        ],
        "containers": [
            {"name": "exporter", "image": "exporter", "ports": [{"name": "export", "containerPort": 9100}]},
            {"name": "trainer", "ports": [{"name": "debug", "containerPort": 5678}],
             "livenessProbe": {"tcpSocket": {"port": "master"}, "periodSeconds": 30},
             "resources": {"limits": {"memory": "8Gi"}, "requests": {"cpu": "2"}},
             "env": [{"name": "HF_HOME", "value": "/data/hf"}],
             "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
        ],
        "volumes": [{"name": "data", "emptyDir": {"sizeLimit": "1Gi"}}],
        "dnsPolicy": "ClusterFirst", "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
        "terminationGracePeriodSeconds": 60, "restartPolicy": "Never",
    },
}


def test_a_template_is_stored_as_written_and_its_pods_pass_pod_validation(crd, namespace):
    """spec.template under the real schema: nothing pruned, and the pods merge_template makes from
    it (with flat fields on top) are Pods this API server accepts."""
    from ddpjob_operator.builders.pods import render_pod
    from ddpjob_api.spec import from_manifest

    obj = manifest("templated", gpusPerNode=0, env=[{"name": "A", "value": "1"}],
                   volumes=[{"name": "ckpt", "emptyDir": {}}], volumeMounts=[{"name": "ckpt", "mountPath": "/ckpt"}],
                   template=TEMPLATE)
    proc = apply(crd, namespace, obj)
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(crd.kubectl("get", "ddpj", "templated", "-n", namespace, "-o", "json").stdout)
    assert stored["spec"]["template"] == TEMPLATE                  # nothing pruned
    pod = render_pod(from_manifest(stored), 1)
    pod["metadata"].pop("ownerReferences", None)
    proc = crd.kubectl("create", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", "-",
                       input=yaml.safe_dump(pod), check=False)
    assert proc.returncode == 0, proc.stderr


def test_a_clash_with_the_operators_port_is_refused_at_pod_creation_naming_the_template_field(crd, namespace):
    """A port of the trainer named master is the one clash the CRD cannot afford to check (CEL
    cost): the Pod's validation refuses it, and explain_pod_error names the DDPJob field."""
    from ddpjob_operator.builders.pods import explain_pod_error, render_pod
    from ddpjob_api.spec import from_manifest

    job = from_manifest(manifest("clash", template={"spec": {"containers": [
        {"name": "trainer", "ports": [{"name": "master", "containerPort": 1234}]}]}}))
    pod = render_pod(job, 0)
    pod["metadata"].pop("ownerReferences", None)
    pod["metadata"]["namespace"] = namespace
    proc = crd.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(pod), check=False)
    assert proc.returncode != 0
    assert "spec.template.spec.containers[0].ports[0].name" in explain_pod_error(proc.stderr, job), proc.stderr


def _schema_paths(node, at=()):
    """Every field path of a structural schema (list items and map values as '*')."""
    out = {at}
    for key, sub in (node.get("properties") or {}).items():
        out |= _schema_paths(sub, (*at, key))
    for kind in ("items", "additionalProperties"):
        if isinstance(node.get(kind), dict):
            out |= _schema_paths(node[kind], (*at, "*"))
    return out


def test_generated_schemas_match_this_api_server(crd, tmp_path):
    """The CRD embeds the pod schemas of the newest Kubernetes CI runs (hack/gen-crd-schemas.py):
    on that API server exactly (`--check` against its /openapi/v3/api/v1); on an older one (the
    oldest the chart allows, make test-oldest) they hold every field that server has, so no field
    a user's cluster supports is refused by the DDPJob's schema."""
    import re
    import subprocess
    import sys

    from tests.support.cluster import REPO_ROOT

    openapi = tmp_path / "api_v1.json"
    openapi.write_text(crd.kubectl("get", "--raw", "/openapi/v3/api/v1").stdout)
    server = json.loads(crd.kubectl("get", "--raw", "/version").stdout)["gitVersion"]
    newest = re.search(r"^KUBE_VERSION=(\S+)", (REPO_ROOT / "hack" / "versions.env").read_text(), re.M).group(1)
    ours = REPO_ROOT / "charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml"
    gen = [sys.executable, str(REPO_ROOT / "hack/gen-crd-schemas.py"), "--openapi", str(openapi)]
    if server == newest:
        proc = subprocess.run([*gen, "--check"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    theirs = tmp_path / "crd-for-this-server.yaml"
    theirs.write_text(ours.read_text())
    proc = subprocess.run([*gen, "--crd", str(theirs)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def spec(path):
        return yaml.safe_load(path.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    missing = sorted(".".join(p) for p in _schema_paths(spec(theirs)) - _schema_paths(spec(ours)))
    assert missing == [], f"fields the {server} API server has and the CRD ({newest}'s schemas) lacks: {missing[:20]}"
    assert _schema_paths(spec(ours)) - _schema_paths(spec(theirs)), f"the {server} API server has every field {newest} has"


def test_every_field_published_to_kubectl_explain_has_a_description(crd):
    """kubectl explain renders the API server's published OpenAPI v3 of the CRD: every property of
    DDPJob there (spec, status, the embedded core/v1 types) has a description. (`--recursive`
    lists names only, so it cannot show `<no description>`.)"""
    doc = json.loads(crd.kubectl("get", "--raw", "/openapi/v3/apis/ddpjob.dev/v1alpha1").stdout)
    root = doc["components"]["schemas"]["dev.ddpjob.v1alpha1.DDPJob"]
    missing, seen = [], 0

    def walk(node, path):
        nonlocal seen
        for key, sub in (node.get("properties") or {}).items():
            here = f"{path}.{key}"
            seen += 1
            if not sub.get("description") and not sub.get("allOf"):
                missing.append(here)
            walk(sub, here)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], path + "[]")

    walk(root, "")
    assert seen > 500 and missing == []


@pytest.mark.parametrize("path", ["ddpjob.spec", "ddpjob.status", "ddpjob.spec.scheduling",
                                  "ddpjob.spec.failurePolicy", "ddpjob.status.progress", "ddpjob.status.failures",
                                  "ddpjob.spec.volumes.persistentVolumeClaim", "ddpjob.spec.env.valueFrom"])
def test_kubectl_explain_shows_no_undescribed_field(crd, path):
    proc = crd.kubectl("explain", path)
    assert "<no description>" not in proc.stdout and "DESCRIPTION" in proc.stdout, proc.stdout


@pytest.mark.parametrize("field,text", [
    ("ddpjob.spec.scheduling.tolerations.key", "taint key"),
    ("ddpjob.spec.resources.limits", "maximum amount of compute resources"),
    ("ddpjob.spec.failurePolicy.podStartTimeoutSeconds", "keep waiting"),
    ("ddpjob.status.conditions.reason", "reason"),
    ("ddpjob.status.progress.samplesPerSecond", "throughput"),
])
def test_kubectl_explain_describes_fields(crd, field, text):
    out = " ".join(crd.kubectl("explain", field).stdout.split())
    assert text in out and "<no description>" not in out, out
