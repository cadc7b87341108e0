"""spec.template merged with what the operator owns (template.merge_template, through render_pod)."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import yaml

from ddpjob_api import labels
from ddpjob_api.validation import validate_manifest
from ddpjob_operator.base.group import Group
from ddpjob_operator.base import podinfo
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.builders.envvars import env_dict
from ddpjob_operator.decisions.lifecycle import verdict
from ddpjob_operator.builders.pods import LAUNCHER, explain_pod_error, job_field, render_pod
from ddpjob_operator.builders.render import render_file
from ddpjob_operator.decisions.result import run_result
from tests.support.builders import make_job, make_manifest, make_pod

ROOT = Path(__file__).resolve().parents[2]
TRAIN = {"name": "train", "namespace": "ml", "uid": "uid-1", "image": "reg/trainer:1", "nodes": 2}
job = functools.partial(make_job, **TRAIN)
SHM_MOUNT = {"name": "dshm", "mountPath": "/dev/shm"}
MASTER = {"name": "master", "containerPort": 29500, "protocol": "TCP"}
METRICS = {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}


def at(obj, path):
    """The value at a dotted path with [i] indexes (`spec.containers[1].name`); KeyError if absent."""
    for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        obj = obj[int(index)] if index else obj[key]
    return obj


def pod_of(template=None, *, rank=1, config=None, **spec):
    if template is not None:
        spec["template"] = template
    return render_pod(job(**spec), rank, config=config or OperatorConfig(default_runtime_class="nvidia"))


STAGE = {"name": "stage", "image": "busybox", "command": ["sh", "-c", "cp -r /src /data"],
         "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
SIDECAR = {"name": "log-shipper", "image": "fluent-bit", "restartPolicy": "Always"}
PROBE = {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 30}
TRAINER = {"name": "trainer", "livenessProbe": PROBE, "env": [{"name": "HF_HOME", "value": "/data/hf"}],
           "ports": [{"name": "debug", "containerPort": 5678}],
           "resources": {"limits": {"memory": "64Gi", "nvidia.com/gpu": "1"}, "requests": {"cpu": "8"}},
           "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
# What the schema refuses in the template's trainer (the operator's own), and render_pod drops anyway.
OWNED = {"image": "other", "command": ["other"], "args": ["other"], "terminationMessagePolicy": "File"}

# (case, DDPJob spec fields, {pod path: value}); `None` as a value: the path must be absent.
CASES = [
    ("no template", {}, {"spec.containers[0].name": labels.CONTAINER, "spec.restartPolicy": "Never",
                         "spec.initContainers": None}),
    ("init container and native sidecar", {"template": {"spec": {"initContainers": [STAGE, SIDECAR]}}},
     {"spec.initContainers": [STAGE, SIDECAR], "spec.containers[0].name": labels.CONTAINER}),
    ("a sidecar in containers: ours goes first", {"template": {"spec": {"containers": [{"name": "side"}]}}},
     {"spec.containers[0].name": labels.CONTAINER, "spec.containers[1]": {"name": "side"}}),
    ("the template's trainer keeps its place and its own fields",
     {"gpusPerNode": 2, "template": {"spec": {"containers": [{"name": "side"}, TRAINER]}}},
     {"spec.containers[0]": {"name": "side"}, "spec.containers[1].livenessProbe": PROBE,
      "spec.containers[1].image": "reg/trainer:1", "spec.containers[1].command": LAUNCHER,
      "spec.containers[1].args": None, "spec.containers[1].terminationMessagePolicy": "FallbackToLogsOnError",
      "spec.containers[1].ports": [MASTER, METRICS, {"name": "debug", "containerPort": 5678}],
      "spec.containers[1].resources": {"limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
                                       "requests": {"cpu": "8"}},
      "spec.containers[1].volumeMounts": [SHM_MOUNT, {"name": "data", "mountPath": "/data"}]}),
    ("image, command, args: spec's, never the template's",
     {"template": {"spec": {"containers": [{**TRAINER, **OWNED}]}}},
     {"spec.containers[0].image": "reg/trainer:1", "spec.containers[0].command": LAUNCHER,
      "spec.containers[0].args": None, "spec.containers[0].terminationMessagePolicy": "FallbackToLogsOnError"}),
    ("spec.args are ours", {"args": ["--fast"], "template": {"spec": {"containers": [{**TRAINER, **OWNED}]}}},
     {"spec.containers[0].args": ["--fast"]}),
    ("flat resources over the template's, per resource",
     {"resources": {"limits": {"memory": "32Gi"}, "requests": {"memory": "16Gi"}},
      "template": {"spec": {"containers": [TRAINER]}}},
     {"spec.containers[0].resources": {"limits": {"memory": "32Gi", "nvidia.com/gpu": "1"},
                                       "requests": {"cpu": "8", "memory": "16Gi"}}}),
    ("template volumes, then flat volumes; mounts likewise",
     {"volumes": [{"name": "ckpt", "emptyDir": {}}], "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
      "template": {"spec": {"volumes": [{"name": "data", "emptyDir": {}}], "containers": [TRAINER]}}},
     {"spec.volumes[0].name": "dshm", "spec.volumes[1].name": "data", "spec.volumes[2].name": "ckpt",
      "spec.containers[0].volumeMounts": [SHM_MOUNT, {"name": "data", "mountPath": "/data"},
                                          {"name": "ckpt", "mountPath": "/ckpt"}]}),
    ("host network and DNS for RDMA/EFA; grace period",
     {"template": {"spec": {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
                            "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
                            "terminationGracePeriodSeconds": 120}}},
     {"spec.hostNetwork": True, "spec.dnsPolicy": "ClusterFirstWithHostNet",
      "spec.dnsConfig": {"options": [{"name": "ndots", "value": "2"}]}, "spec.terminationGracePeriodSeconds": 120,
      "spec.hostname": "train-1", "spec.subdomain": "train"}),
    ("restartPolicy Never in the template is what the operator sets anyway",
     {"template": {"spec": {"restartPolicy": "Never"}}}, {"spec.restartPolicy": "Never"}),
    ("restartPolicy, hostname, subdomain the schema refuses never reach the pod",
     {"template": {"spec": {"restartPolicy": "Always", "hostname": "h", "subdomain": "s"}}},
     {"spec.restartPolicy": "Never", "spec.hostname": "train-1", "spec.subdomain": "train"}),
    ("labels: the template's, podLabels over them, the operator's over both",
     {"podLabels": {"team": "nlp"},
      "template": {"metadata": {"labels": {"team": "vision", "sidecar.istio.io/inject": "false",
                                           labels.MANAGED_BY: "me", labels.JOB_NAME: "other"},
                                "annotations": {"note": "x", labels.RESTARTS: "99"}}}},  # (ddpjob.dev/: refused)
     {"metadata.labels": {labels.JOB_NAME: "train", labels.MANAGED_BY: labels.MANAGER, "team": "nlp",
                          "sidecar.istio.io/inject": "false", labels.NODE_RANK: "1", labels.ATTEMPT: "0"},
      "metadata.annotations": {"note": "x", labels.RESTARTS: "0", labels.COUNTED_RESTARTS: "0"}}),
    ("security: defaults under the template under the flat fields",
     {"securityContext": {"runAsUser": 1000},
      "podSecurityContext": {"fsGroup": 2000},
      "template": {"spec": {"securityContext": {"runAsNonRoot": False, "fsGroup": 1},
                            "containers": [{"name": "trainer", "securityContext": {
                                "capabilities": {"add": ["IPC_LOCK"]}, "runAsUser": 1}}]}}},
     {"spec.securityContext": {"runAsNonRoot": False, "seccompProfile": {"type": "RuntimeDefault"}, "fsGroup": 2000},
      "spec.containers[0].securityContext": {"allowPrivilegeEscalation": False,
                                             "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
                                             "runAsUser": 1000}}),
    ("scheduling: the template's when the job says nothing, its spread before one pod per node",
     {"template": {"spec": {"nodeSelector": {"pool": "a"}, "priorityClassName": "low",
                            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                           "whenUnsatisfiable": "DoNotSchedule"}]}}},
     {"spec.nodeSelector": {"pool": "a"}, "spec.priorityClassName": "low",
      "spec.topologySpreadConstraints[0].topologyKey": "zone",
      "spec.topologySpreadConstraints[1].topologyKey": "kubernetes.io/hostname"}),
    ("scheduling: a flat field replaces the template's",
     {"scheduling": {"nodeSelector": {"pool": "b"}}, "template": {"spec": {"nodeSelector": {"pool": "a"}}}},
     {"spec.nodeSelector": {"pool": "b"}, "spec.topologySpreadConstraints[0].topologyKey": "kubernetes.io/hostname"}),
    ("service account in the template: its token is mounted",
     {"template": {"spec": {"serviceAccountName": "reader"}}},
     {"spec.serviceAccountName": "reader", "spec.automountServiceAccountToken": True}),
    ("the template's explicit token and service-link choices win over the defaults",
     {"serviceAccountName": "reader",
      "template": {"spec": {"automountServiceAccountToken": False, "enableServiceLinks": True}}},
     {"spec.automountServiceAccountToken": False, "spec.enableServiceLinks": True}),
    ("one PID namespace for the pod's containers: the launcher is not PID 1", {}, {"spec.shareProcessNamespace": True}),
    ("the template's PID namespace choice wins",
     {"template": {"spec": {"shareProcessNamespace": False}}}, {"spec.shareProcessNamespace": False}),
    ("no shared PID namespace beside hostPID, where the API refuses the field",
     {"template": {"spec": {"hostPID": True}}}, {"spec.hostPID": True, "spec.shareProcessNamespace": None}),
    ("no shared PID namespace on Windows",
     {"template": {"spec": {"os": {"name": "windows"}}}}, {"spec.shareProcessNamespace": None}),
    ("runtime class: flat over template over the GPU default",
     {"gpusPerNode": 1, "template": {"spec": {"runtimeClassName": "nvidia-cdi"}}},
     {"spec.runtimeClassName": "nvidia-cdi"}),
    ("pull secrets and envFrom: the template's, then the flat field's",
     {"imagePullSecrets": [{"name": "b"}], "envFrom": [{"configMapRef": {"name": "b"}}],
      "template": {"spec": {"imagePullSecrets": [{"name": "a"}],
                            "containers": [{"name": "trainer", "envFrom": [{"configMapRef": {"name": "a"}}]}]}}},
     {"spec.imagePullSecrets": [{"name": "a"}, {"name": "b"}],
      "spec.containers[0].envFrom": [{"configMapRef": {"name": "a"}}, {"configMapRef": {"name": "b"}}]}),
]


@pytest.mark.parametrize("spec,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_merge(spec, expected):
    pod = pod_of(**spec)
    for path, value in expected.items():
        if value is None:
            with pytest.raises((KeyError, IndexError)):
                at(pod, path)
        else:
            assert at(pod, path) == value, path


def test_env_order_and_who_wins():
    """The operator's variables, then the template container's, then spec.env; a user's variable
    replaces ours of the same name (the rule spec.env always had), spec.env a template's."""
    template = {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "HF_HOME", "value": "/data/hf"}, {"name": "NCCL_DEBUG", "value": "WARN"},
        {"name": "SHARED", "value": "template"}]}]}}
    pod = pod_of(template, env=[{"name": "SHARED", "value": "flat"}], nccl={"debug": "INFO"})
    env = pod["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert names[-3:] == ["HF_HOME", "NCCL_DEBUG", "SHARED"] and len(names) == len(set(names))
    assert names[0] == "MASTER_ADDR"
    assert env_dict(env)["NCCL_DEBUG"] == "WARN" and env_dict(env)["SHARED"] == "flat"


def test_a_cpu_request_in_the_template_sizes_the_data_loaders():
    template = {"spec": {"containers": [{"name": "trainer", "resources": {"requests": {"cpu": "6"}}}]}}
    env = pod_of(template)["spec"]["containers"][0]["env"]
    assert any(e["name"] == "DDPJOB_CPUS" and "valueFrom" in e for e in env)
    assert not any(e["name"] == "DDPJOB_CPUS" for e in pod_of()["spec"]["containers"][0]["env"])


@pytest.mark.parametrize("empty", [{}, {"metadata": {}}, {"spec": {}}, {"metadata": {"labels": {}}, "spec": {}}])
def test_an_empty_template_changes_nothing(empty):
    spec = {"gpusPerNode": 2, "env": [{"name": "A", "value": "1"}], "podLabels": {"a": "b"},
            "volumes": [{"name": "v", "emptyDir": {}}], "scheduling": {"nodeSelector": {"a": "b"}}}
    assert pod_of(**spec) == pod_of(empty, **spec)


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_render_the_same_with_an_empty_template(example, tmp_path):
    """Byte for byte: a job without a template renders as it did before templates existed."""
    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    for doc in docs:
        if doc.get("kind") == "DDPJob":
            doc["spec"]["template"] = {"metadata": {}, "spec": {}}
    with_empty = tmp_path / example.name
    with_empty.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    assert render_file(str(with_empty)) == render_file(str(example))


def test_every_pod_gets_the_same_template_and_none_shares_it():
    template = {"spec": {"initContainers": [STAGE], "containers": [TRAINER]}}
    j = job(template=template)
    pods = [render_pod(j, r) for r in range(2)]
    assert pods[0]["spec"]["initContainers"] == pods[1]["spec"]["initContainers"] == [STAGE]
    pods[0]["spec"]["initContainers"][0]["name"] = "changed"
    pods[0]["spec"]["containers"][0]["livenessProbe"]["periodSeconds"] = 1
    assert j.raw["spec"]["template"] == template and render_pod(j, 1) == pods[1]


# -- the local validator (ddpjob render, ddpjob run --local): the CRD's schema and CEL ------------------
@pytest.mark.parametrize("template,problem", [
    ({"spec": {"initContainer": [STAGE]}}, "spec.template.spec.initContainer: unknown field"),
    ({"spec": {"containers": [{"name": "trainer", "livenesProbe": PROBE}]}},
     "spec.template.spec.containers[0].livenesProbe: unknown field"),
    ({"spec": {"containers": [{"image": "x"}]}}, "spec.template.spec.containers[0].name: required field is missing"),
    ({"metadata": {"lables": {"a": "b"}}}, "spec.template.metadata.lables: unknown field"),
    ({"metadata": {"name": "mine"}}, "spec.template.metadata.name: unknown field"),
    ({"spec": {"hostNetwork": "yes"}}, "spec.template.spec.hostNetwork"),
    ({"spec": {"restartPolicy": "Always"}}, "spec.template.spec.restartPolicy must be Never"),
    ({"spec": {"restartPolicy": "OnFailure"}}, "spec.template.spec.restartPolicy must be Never"),
    ({"spec": {"hostname": "fixed"}}, "spec.template.spec.hostname must not be set"),
    ({"spec": {"containers": [{"name": "side", "image": "s"}, {"name": "trainer", "image": "other"}]}},
     "spec.template.spec.containers: the trainer container's image"),
    ({"metadata": {"labels": {"ddpjob.dev/job-name": "other"}}}, "spec.template.metadata.labels must not use"),
])
def test_the_local_validator_refuses_a_bad_template_naming_the_field(template, problem):
    problems = validate_manifest(make_manifest(stored=False, template=template))
    assert any(p.startswith(problem) for p in problems), problems


def test_a_template_with_no_containers_or_only_init_containers_is_valid():
    for template in ({"spec": {"initContainers": [STAGE, SIDECAR]}}, {"metadata": {"labels": {"a": "b"}}},
                     {"spec": {"containers": [TRAINER], "restartPolicy": "Never"}}):
        assert validate_manifest(make_manifest(stored=False, template=template)) == []


def test_ddpjob_render_shows_the_merged_pods(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(make_manifest("train", stored=False, namespace=None, nodes=2, template={
        "spec": {"initContainers": [STAGE], "containers": [{"name": "side", "image": "s"}, TRAINER]}})))
    pods = [d for d in yaml.safe_load_all(render_file(str(path))) if d["kind"] == "Pod"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["initContainers"] == [STAGE]
        assert [c["name"] for c in pod["spec"]["containers"]] == ["side", labels.CONTAINER]
        assert pod["spec"]["containers"][1]["livenessProbe"] == PROBE


def test_ddpjob_render_refuses_a_misspelt_template_field(tmp_path):
    import click

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(make_manifest(stored=False, template={"spec": {"initContainer": [STAGE]}})))
    with pytest.raises(click.ClickException, match=r"spec\.template\.spec\.initContainer: unknown field"):
        render_file(str(path))


# -- API errors about a rendered pod name the DDPJob field ---------------------------------------------
FIELD_JOB = {"env": [{"name": "A", "value": "1"}], "volumes": [{"name": "flat", "emptyDir": {}}],
             "volumeMounts": [{"name": "flat", "mountPath": "/flat"}],
             "scheduling": {"nodeSelector": {"a": "b"}},
             "template": {"metadata": {"labels": {"t": "1"}},
                          "spec": {"initContainers": [STAGE], "volumes": [{"name": "data", "emptyDir": {}}],
                                   "tolerations": [{"key": "k", "operator": "Exists"}],
                                   "containers": [{"name": "side"}, {**TRAINER, "env": [
                                       {"name": "A", "value": "shadowed"}, {"name": "B", "value": "2"}]}]}}}


@pytest.mark.parametrize("pod_path,job_path", [
    ("spec.initContainers[0].image", "spec.template.spec.initContainers[0].image"),
    ("spec.containers[0].name", "spec.template.spec.containers[0].name"),              # the sidecar
    ("spec.containers[1].livenessProbe.httpGet.port", "spec.template.spec.containers[1].livenessProbe.httpGet.port"),
    ("spec.containers[1].ports[1].name", None),                                         # metrics: ours
    ("spec.containers[1].ports[2].name", "spec.template.spec.containers[1].ports[0].name"),
    ("spec.containers[1].volumeMounts[0].name", None),                                  # /dev/shm
    ("spec.containers[1].volumeMounts[1].name", "spec.template.spec.containers[1].volumeMounts[0].name"),
    ("spec.containers[1].volumeMounts[2].name", "spec.volumeMounts[0].name"),
    ("spec.containers[1].resources.limits.memory", "spec.template.spec.containers[1].resources.limits.memory"),
    ("spec.containers[1].image", "spec.image"),
    ("spec.containers[1].command", None),
    ("spec.volumes[1].name", "spec.template.spec.volumes[0].name"),
    ("spec.volumes[2].name", "spec.volumes[0].name"),
    ("spec.tolerations[0].key", "spec.template.spec.tolerations[0].key"),
    ("spec.nodeSelector", "spec.scheduling.nodeSelector"),
    ("spec.securityContext.runAsUser", "spec.podSecurityContext.runAsUser"),
    ("metadata.labels", "spec.template.metadata.labels"),
    ("spec.hostname", None),
])
def test_pod_error_paths_name_template_fields(pod_path, job_path):
    assert job_field(pod_path, job(**FIELD_JOB)) == job_path


def test_env_error_paths_follow_the_merged_order():
    j = job(**FIELD_JOB)
    env = render_pod(j, 0)["spec"]["containers"][1]["env"]
    named = {e["name"]: job_field(f"spec.containers[1].env[{i}].name", j) for i, e in enumerate(env)}
    assert named["MASTER_ADDR"] is None
    assert named["B"] == "spec.template.spec.containers[1].env[1].name"     # A of the template is shadowed
    assert named["A"] == "spec.env[0].name"


def test_a_refused_pod_names_the_template_field():
    message = ('Pod "train-0" is invalid: spec.containers[1].ports[2].name: Duplicate value: "metrics"')
    assert ("spec.containers[1].ports[2].name (DDPJob spec.template.spec.containers[1].ports[0].name)"
            in explain_pod_error(message, job(**FIELD_JOB)))


# -- a pod with the template's containers, as the operator reads it back ------------------------------
def with_statuses(pod, *, containers=(), init=()):
    """`pod` (builders.make_pod) with these (name, exit code or None: still waiting) statuses."""
    def status(name, code):
        state = {"waiting": {"reason": "PodInitializing"}} if code is None else {"terminated": {"exitCode": code}}
        return {"name": name, "state": state}
    pod["status"]["containerStatuses"] = [status(n, c) for n, c in containers]
    pod["status"]["initContainerStatuses"] = [status(n, c) for n, c in init]
    return pod


def test_the_trainers_exit_code_comes_first_and_only_it_means_bad_configuration():
    """The kubelet lists containers by name: a sidecar `aaa` comes before `trainer`. A sidecar's
    78 is not the launcher's bad-configuration code."""

    pod = with_statuses(make_pod(phase="Failed"), containers=[("aaa", 78), (labels.CONTAINER, 1)])
    assert podinfo.exit_code(pod) == 1 and not podinfo.bad_config(pod)
    assert verdict(pod).reason == "PodFailed"
    pod = with_statuses(make_pod(phase="Failed"), containers=[("aaa", 0), (labels.CONTAINER, 78)])
    assert podinfo.bad_config(pod) and verdict(pod).reason == "BadConfiguration"


def test_a_failed_init_container_gives_the_pods_exit_code():

    pod = with_statuses(make_pod(phase="Failed"), containers=[(labels.CONTAINER, None)],
                        init=[("stage", 3), ("shipper", None)])
    failure = verdict(pod)
    assert failure.reason == "PodFailed" and "exit code 3" in failure.message


def test_the_result_is_the_trainers_own_termination_message():

    pod = with_statuses(make_pod(phase="Succeeded"), containers=[("aaa", 0), (labels.CONTAINER, 0)])
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = json.dumps({"steps": 1})
    assert run_result(Group.of([pod]).at(0)) == {}
    pod["status"]["containerStatuses"][1]["state"]["terminated"]["message"] = json.dumps({"steps": 7})
    assert run_result(Group.of([pod]).at(0)) == {"steps": 7}
