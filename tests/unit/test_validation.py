"""validate_manifest: the CRD schema + its CEL rules (evaluated by a CEL library), every message naming the field."""
from __future__ import annotations

import copy

import pytest

from ddpjob_api.validation import InvalidDDPJob, apply_defaults, check_manifest, validate_manifest

GOOD = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "mnist"},
        "spec": {"image": "reg/trainer:1", "nodes": 2, "trainer": {"dataset": "digits", "model": "convnet"}}}


def with_spec(**spec):
    m = copy.deepcopy(GOOD)
    m["spec"].update(spec)
    return m


def test_good_manifest_has_no_problems():
    assert validate_manifest(GOOD) == []


@pytest.mark.parametrize("extra", [
    {"nprocPerNode": 4}, {"nprocPerNode": "auto"}, {"gpusPerNode": 8}, {"elastic": {"minNodes": 1, "maxNodes": 4}},
    {"gpusPerNode": 8, "nprocPerNode": 8}, {"gpusPerNode": 8, "nprocPerNode": 2}, {"gpusPerNode": 0, "nprocPerNode": 16},
    {"gpusPerNode": 4, "nprocPerNode": "auto"}, {"scheduling": {"onePodPerNode": False}},
    {"shmSize": "16Gi"}, {"shmSize": 1073741824}, {"cleanPodPolicy": "All"}, {"suspend": True},
    {"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "x"}}]},
    {"scheduling": {"nodeSelector": {"a": "b"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In",
                                                                     "values": ["a100"]}]}]}}}}},
    {"resources": {"limits": {"cpu": 2, "memory": "8Gi"}, "requests": {"cpu": "500m"}}},
    {"env": [{"name": "1PASSWORD_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
    {"securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}, "podSecurityContext": {"fsGroup": 1000}},
    {"trainer": {"dataset": "synthetic", "model": "mlp", "optimizer": "adamw", "maxSteps": 10,
                 "synthetic": {"shape": [1, 8, 8], "numClasses": 4}, "checkpoint": {"everySteps": 0}}},
    {"command": ["torchrun", "train.py"], "launcher": False},
])
def test_valid_variants(extra):
    assert validate_manifest(with_spec(**extra)) == []


@pytest.mark.parametrize("change,field", [
    ({"nodes": 0}, "spec.nodes"),
    ({"nodes": -3}, "spec.nodes"),
    ({"nodes": "four"}, "spec.nodes"),
    ({"nprocPerNode": "many"}, "spec.nprocPerNode"),
    ({"nprocPerNode": 0}, "spec.nprocPerNode"),
    ({"gpusPerNode": -1}, "spec.gpusPerNode"),
    ({"gpusPerNode": 2, "nprocPerNode": 3}, "spec.nprocPerNode must be <= spec.gpusPerNode"),
    ({"scheduling": {"onePodPerNode": "no"}}, "spec.scheduling.onePodPerNode"),
    ({"masterPort": 70000}, "spec.masterPort"),
    ({"metricsPort": 0}, "spec.metricsPort"),
    ({"masterPort": 9400}, "spec.masterPort and spec.metricsPort must differ"),
    ({"elastic": {"minNodes": 3, "maxNodes": 8}}, "spec.elastic.minNodes must be <= spec.nodes"),
    ({"elastic": {"minNodes": 1, "maxNodes": 1}}, "spec.elastic.maxNodes must be >= spec.nodes"),
    ({"shmSize": "lots"}, "spec.shmSize"),
    ({"cleanPodPolicy": "Sometimes"}, "spec.cleanPodPolicy"),
    ({"failurePolicy": {"maxRestarts": -1}}, "spec.failurePolicy.maxRestarts"),
    ({"activeDeadlineSeconds": 0}, "spec.activeDeadlineSeconds"),
    ({"ttlSecondsAfterFinished": -5}, "spec.ttlSecondsAfterFinished"),
    ({"trainer": {"model": "vgg"}}, "spec.trainer.model"),
    ({"nproc_per_node": 2}, "spec.nproc_per_node: unknown field"),
    ({"trainer": {"batch_size": 2}}, "spec.trainer.batch_size: unknown field"),   # the trainer would exit 78
    ({"trainer": {"synthetic": {"shape": []}}}, "spec.trainer.synthetic.shape"),
    ({"image": ""}, "spec.image"),
    ({"env": [{"value": "x"}]}, "spec.env[0].name"),
    # Pod-level fields carry Kubernetes' own core/v1 schemas (hack/gen-crd-schemas.py).
    ({"env": [{"name": "A=B", "value": "x"}]}, "spec.env[0].name"),
    ({"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "kee": "k"}}}]},
     "spec.env[0].valueFrom.secretKeyRef.kee: unknown field"),
    ({"resources": {"limts": {"memory": "8Gi"}}}, "spec.resources.limts: unknown field"),
    ({"resources": {"limits": {"memory": "8 GB"}}}, "spec.resources.limits.memory"),
    ({"scheduling": {"tolerations": [{"kye": "gpu", "operator": "Exists"}]}},
     "spec.scheduling.tolerations[0].kye: unknown field"),
    ({"scheduling": {"affinity": {"nodeAffinity": {"anything": "goes"}}}},
     "spec.scheduling.affinity.nodeAffinity.anything: unknown field"),
    ({"volumes": [{"name": "d", "persistentVolumeClam": {"claimName": "x"}}]},
     "spec.volumes[0].persistentVolumeClam: unknown field"),
    ({"volumeMounts": [{"name": "d"}]}, "spec.volumeMounts[0].mountPath"),
    ({"podSecurityContext": {"fsGroup": "root"}}, "spec.podSecurityContext.fsGroup"),
    ({"failurePolicy": {"podStartTimeoutSeconds": 0}}, "spec.failurePolicy.podStartTimeoutSeconds"),
])
def test_invalid_specs_name_the_field(change, field):
    problems = validate_manifest(with_spec(**change))
    assert problems, change
    assert any(field in p for p in problems), problems


@pytest.mark.parametrize("name,ok", [("a" * 58, True), ("a" * 59, False), ("Bad_Name", False), ("9lives", False)])
def test_name_must_leave_room_for_the_rank(name, ok):
    m = copy.deepcopy(GOOD)
    m["metadata"]["name"] = name
    problems = validate_manifest(m)
    assert (problems == []) == ok
    if not ok:
        assert all(p.startswith("metadata.name") for p in problems)


def test_missing_image_and_wrong_kind():
    m = copy.deepcopy(GOOD)
    del m["spec"]["image"]
    m["kind"] = "PyTorchJob"
    problems = validate_manifest(m)
    assert any(p.startswith("spec.image") for p in problems)
    assert any(p.startswith("kind:") for p in problems)


def test_not_a_mapping():
    assert validate_manifest(["nope"])[0].startswith("<root>")


def test_defaults_come_from_the_crd():
    spec = apply_defaults(GOOD)["spec"]
    assert spec["nprocPerNode"] == "auto" and spec["gpusPerNode"] == 0
    assert spec["masterPort"] == 29500 and spec["metricsPort"] == 9400
    assert spec["failurePolicy"] == {"maxRestarts": 3, "restartOnHang": True, "logTailInStatus": False,
                                     "keepFailedAttempts": 1}
    assert spec["launcher"] is True and spec["cleanPodPolicy"] == "Running" and spec["suspend"] is False
    assert "suspend" not in GOOD["spec"]  # input untouched


def test_check_manifest_raises_with_every_problem():
    with pytest.raises(InvalidDDPJob) as err:
        check_manifest(with_spec(nodes=0, gpusPerNode=-1))
    assert "spec.nodes" in str(err.value) and "spec.gpusPerNode" in str(err.value)
    assert len(err.value.problems) == 2


def _crd_rules() -> list[dict]:
    """Every x-kubernetes-validations rule of the CRD the operator installs."""
    from ddpjob_api.crdschema import load_crd

    out: list[dict] = []

    def walk(node):
        if isinstance(node, dict):
            out.extend(node.get("x-kubernetes-validations", []))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(load_crd()["spec"]["versions"][0]["schema"])
    return out


# One violation per CEL rule of the CRD, keyed by the rule's message: the local validator evaluates
# the CRD's own rules (ddpjob_api.crdschema), and this table keeps a violating example of each, so a rule
# that the CEL library reads differently from the API server shows up here. Transition rules (oldSelf: immutability) need an
# old object and are the API server's alone (cluster tier: test_immutable_fields_...).
CEL_VIOLATIONS = {
    "metadata.name: must be at most 58 characters so that every pod's DNS name `<name>-<rank>` fits 63 "
    "characters": {"metadata": {"name": "a" * 59}},
    "metadata.name: must be a DNS-1035 label (lowercase letters, digits, '-', starting with a letter): it "
    "names the headless Service": {"metadata": {"name": "9lives"}},
    "spec.elastic.minNodes must be <= spec.nodes": {"spec": {"nodes": 2, "elastic": {"minNodes": 3, "maxNodes": 4}}},
    "spec.elastic.maxNodes must be >= spec.nodes": {"spec": {"nodes": 4, "elastic": {"minNodes": 1, "maxNodes": 3}}},
    "spec.elastic.minNodes must be <= spec.elastic.maxNodes": {"spec": {"nodes": 4, "elastic": {"minNodes": 6,
                                                                                                "maxNodes": 2}}},
    "spec.masterPort and spec.metricsPort must differ": {"spec": {"masterPort": 9400, "metricsPort": 9400}},
    "spec.faultTolerance needs the built-in trainer (no spec.command): the trainer is what joins torchft's quorum "
    "every step": {"spec": {"command": ["torchrun", "train.py"], "faultTolerance": {"mode": "perStep"}}},
    "spec.faultTolerance and spec.elastic do not mix: with per-step fault tolerance each pod is its own torchrun "
    "group and a lost pod is replaced alone": {"spec": {"faultTolerance": {"mode": "perStep"},
                                                         "elastic": {"minNodes": 1}}},
    "spec.faultTolerance.minReplicas must be <= spec.nodes (each pod is one replica group)": {
        "spec": {"nodes": 2, "faultTolerance": {"mode": "perStep", "minReplicas": 3}}},
    "spec.scheduling.gang.scheduleTimeoutSeconds applies to scheduler coscheduling only": {
        "spec": {"scheduling": {"gang": {"scheduler": "volcano", "scheduleTimeoutSeconds": 5}}}},
    "spec.scheduling.gang.queue applies to scheduler volcano only (Kueue queues are set with the "
    "kueue.x-k8s.io/queue-name label)": {"spec": {"scheduling": {"gang": {"scheduler": "coscheduling", "queue": "q"}}}},
    "spec.nodes must be >= 1": {"spec": {"nodes": 0}},
    "spec.nodes must be <= 10000": {"spec": {"nodes": 10001}},
    'spec.nprocPerNode must be "auto" or an integer >= 1': {"spec": {"nprocPerNode": 0}},
    "spec.gpusPerNode must be >= 0": {"spec": {"gpusPerNode": -1}},
    'spec.nprocPerNode must be <= spec.gpusPerNode: each process of a GPU job drives one GPU of its pod ("auto" = '
    'one per GPU)': {"spec": {"gpusPerNode": 2, "nprocPerNode": 4}},
    "spec.rdma needs spec.gpusPerNode > 0: RDMA carries NCCL's traffic between GPUs (a CPU job's gloo uses TCP)":
        {"spec": {"gpusPerNode": 0, "rdma": {"resource": "rdma/ib"}}},
    'spec.trainer.numWorkers must be "auto" or an integer >= 0': {"spec": {"trainer": {"numWorkers": -1}}},
    "spec.masterPort must be between 1 and 65535": {"spec": {"masterPort": 70000}},
    "spec.metricsPort must be between 1 and 65535": {"spec": {"metricsPort": 0}},
    "spec.shmSize must be a quantity such as 16Gi": {"spec": {"shmSize": "lots"}},
    "spec.podLabels must not use ddpjob.dev/ keys, nor keys that Prometheus reads as one of them (ddpjob-dev/..., "
    "ddpjob_dev_...): the operator's own labels": {"spec": {"podLabels": {"ddpjob-dev/job-name": "other"}}},
    "spec.podAnnotations must not use ddpjob.dev/ keys (the operator's own annotations)":
        {"spec": {"podAnnotations": {"x.ddpjob.dev/attempt": "9"}}},
    "spec.failurePolicy.maxRestarts must be >= 0": {"spec": {"failurePolicy": {"maxRestarts": -1}}},
    "spec.failurePolicy.podStartTimeoutSeconds must be >= 1": {"spec": {"failurePolicy": {"podStartTimeoutSeconds": 0}}},
    "spec.failurePolicy.keepFailedAttempts must be between 0 and 10": {"spec": {"failurePolicy": {"keepFailedAttempts": 11}}},
    "spec.hangTimeoutSeconds must be >= 1": {"spec": {"hangTimeoutSeconds": 0}},
    "spec.elastic.minNodes must be >= 1": {"spec": {"nodes": 2, "elastic": {"minNodes": 0, "maxNodes": 2}}},
    "spec.elastic.maxNodes must be >= 1": {"spec": {"nodes": 1, "elastic": {"minNodes": 1, "maxNodes": 0}}},
    "spec.elastic.maxRestarts must be >= 0": {"spec": {"elastic": {"maxRestarts": -1}}},
    "spec.ttlSecondsAfterFinished must be >= 0": {"spec": {"ttlSecondsAfterFinished": -1}},
    "spec.activeDeadlineSeconds must be >= 1": {"spec": {"activeDeadlineSeconds": 0}},
    "spec.template.spec.restartPolicy must be Never: the operator restarts the whole group (a pod restarting "
    "on its own would rejoin a rendezvous the other ranks have left)":
        {"spec": {"template": {"spec": {"restartPolicy": "Always"}}}},
    "spec.template.spec.hostname must not be set: the operator names every pod <job>-<rank> in the subdomain "
    "<job>, its stable DNS name": {"spec": {"template": {"spec": {"hostname": "mine"}}}},
    "spec.template.spec.subdomain must not be set: the operator names every pod <job>-<rank> in the subdomain "
    "<job>, its stable DNS name": {"spec": {"template": {"spec": {"subdomain": "mine"}}}},
    "spec.template.spec.containers: the trainer container's image, command, args and terminationMessagePolicy "
    "are the operator's (spec.image, spec.command, spec.args; the launcher's termination message)":
        {"spec": {"template": {"spec": {"containers": [{"name": "trainer", "image": "other"}]}}}},
    "spec.template.metadata.labels must not use ddpjob.dev/ keys, nor keys that Prometheus reads as one of them "
    "(ddpjob-dev/..., ddpjob_dev_...): the operator's own labels":
        {"spec": {"template": {"metadata": {"labels": {"ddpjob_dev_node_rank": "0"}}}}},
    "spec.template.metadata.annotations must not use ddpjob.dev/ keys (the operator's own annotations)":
        {"spec": {"template": {"metadata": {"annotations": {"ddpjob.dev/restarts": "0"}}}}},
}


def test_every_cel_rule_of_the_crd_has_a_violation_in_the_table():
    messages = {r["message"] for r in _crd_rules() if "oldSelf" not in r["rule"]}
    assert len(messages) > 20
    assert messages == set(CEL_VIOLATIONS), (messages - set(CEL_VIOLATIONS), set(CEL_VIOLATIONS) - messages)


@pytest.mark.parametrize("message", sorted(CEL_VIOLATIONS))
def test_the_local_validator_gives_each_cel_rules_own_message(message):
    change = CEL_VIOLATIONS[message]
    m = copy.deepcopy(GOOD)
    m["metadata"].update(change.get("metadata", {}))
    m["spec"].update(change.get("spec", {}))
    problems = validate_manifest(m)
    assert any(p.startswith(message) for p in problems), problems


@pytest.mark.parametrize("spec", [{"image": "i"}, {"image": "i", "trainer": {}, "failurePolicy": {}},
                                  {"image": "i", "elastic": {"minNodes": 1, "maxNodes": 2}}])
def test_the_operators_fallbacks_are_the_crds_defaults(spec):
    """The API server fills in the CRD's defaults; a manifest that never met it (`ddpjob run
    --local`, `ddpjob render`, an object from an older CRD) gets them from the typed spec, generated
    from the CRD (ddpjob_api.specgen), and spec.py's own fallbacks. Every field and
    property of the JobSpec must come out the same both ways, or the two paths run different jobs."""
    import dataclasses

    from ddpjob_api.spec import JobSpec, from_manifest

    bare = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "j", "namespace": "ns"},
            "spec": spec}
    as_written, as_stored = from_manifest(copy.deepcopy(bare)), from_manifest(apply_defaults(bare))
    names = [f.name for f in dataclasses.fields(JobSpec) if f.name not in ("raw", "spec")]
    names += [n for n, v in vars(JobSpec).items() if isinstance(v, property) and n != "spec"]
    differ = {n: (getattr(as_written, n), getattr(as_stored, n)) for n in names
              if getattr(as_written, n) != getattr(as_stored, n)}
    assert len(names) > 15 and not differ, differ


def test_a_rule_added_to_the_crd_is_enforced_locally_with_no_python_change(tmp_path, monkeypatch):
    import yaml

    from ddpjob_api import crdschema as crd_mod

    doc = copy.deepcopy(crd_mod.load_crd())
    nodes = crd_mod.version_schema(doc)["properties"]["spec"]["properties"]["nodes"]
    nodes.setdefault("x-kubernetes-validations", []).append(
        {"rule": "self % 2 == 0", "message": "spec.nodes must be even in this cluster"})
    path = tmp_path / "crd.yaml"
    path.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv(crd_mod.CRD_ENV, str(path))
    assert "spec.nodes must be even in this cluster" in validate_manifest(with_spec(nodes=3))
    assert validate_manifest(with_spec(nodes=4)) == []


def test_a_missing_name_is_named_once():
    m = copy.deepcopy(GOOD)
    del m["metadata"]["name"]
    assert validate_manifest(m) == ["metadata.name: required field is missing"]


@pytest.mark.parametrize("change, problems", [
    # A null reaches no rule (the API server drops it), only the schema's type check.
    ({"nodes": None}, ["spec.nodes: None is not of type 'integer'"]),
    # Nor does a value of the wrong type: its type error alone.
    ({"nodes": "four"}, ["spec.nodes: 'four' is not of type 'integer'"]),
    ({"trainer": {"numWorkers": True}}, ["spec.trainer.numWorkers: must be an integer or a string, got True"]),
    # An int-or-string node that also spells out anyOf [integer, string] says so once.
    ({"resources": {"limits": {"memory": 2.5}}}, ["spec.resources.limits.memory: must be an integer or a string, got 2.5"]),
    # One line per unknown key, as the API server names them.
    ({"foo": 1, "bar": 2}, ["spec.bar: unknown field", "spec.foo: unknown field"]),
])
def test_each_problem_is_said_once(change, problems):
    assert validate_manifest(with_spec(**change)) == problems


def test_a_rule_that_cannot_be_evaluated_says_why(tmp_path, monkeypatch):
    import yaml

    from ddpjob_api import crdschema as crd_mod

    doc = copy.deepcopy(crd_mod.load_crd())
    nodes = crd_mod.version_schema(doc)["properties"]["spec"]["properties"]["nodes"]
    nodes["x-kubernetes-validations"] = [{"rule": "self / 0 == 1", "message": "spec.nodes must divide"}]
    path = tmp_path / "crd.yaml"
    path.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv(crd_mod.CRD_ENV, str(path))
    (problem,) = validate_manifest(with_spec(nodes=2))
    assert problem.startswith("spec.nodes must divide (the rule could not be evaluated: "), problem
