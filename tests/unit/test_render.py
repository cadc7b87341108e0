"""Pure builders: render_service, render_pod, pod_env (via render_pod), render_file."""
from __future__ import annotations

import copy
import functools

import pytest
import yaml

from ddpjob_api import labels
from ddpjob_api.spec import from_manifest
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.builders.envvars import env_dict
from ddpjob_operator.builders.pods import LAUNCHER, render_pod
from ddpjob_operator.builders.render import render_file
from ddpjob_operator.builders.service import render_service
from tests.support.builders import make_job, make_manifest


# The job every test here renders; the assertions spell out its names (train-0.train.ml.svc, uid-1).
TRAIN = {"name": "train", "namespace": "ml", "uid": "uid-1", "image": "reg/trainer:1", "nodes": 4}
manifest = functools.partial(make_manifest, **TRAIN)
job = functools.partial(make_job, **TRAIN)


def container(pod):
    (c,) = pod["spec"]["containers"]
    return c


def test_service_is_headless_and_publishes_not_ready_addresses():
    svc = render_service(job(masterPort=23456, metricsPort=9555))
    assert svc["metadata"]["name"] == "train"
    assert svc["metadata"]["namespace"] == "ml"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {labels.JOB_NAME: "train"}
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"master": 23456, "metrics": 9555}
    (ref,) = svc["metadata"]["ownerReferences"]
    assert ref == {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "name": "train", "uid": "uid-1",
                   "controller": True, "blockOwnerDeletion": True}


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_pod_identity_labels_and_dns(rank):
    # The first attempt's pods are named as their hosts; a later attempt's carry the attempt (the
    # failed attempt's pods may still exist), while hostname and DNS name stay.
    assert render_pod(job(), rank, attempt=0)["metadata"]["name"] == f"train-{rank}"
    pod = render_pod(job(), rank, attempt=2)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == f"train-{rank}-a2"
    assert spec["hostname"] == f"train-{rank}" and spec["subdomain"] == "train"
    assert meta["labels"][labels.JOB_NAME] == "train"
    assert meta["labels"][labels.NODE_RANK] == str(rank)
    assert meta["labels"][labels.ATTEMPT] == "2"
    assert meta["ownerReferences"][0]["controller"] is True
    assert spec["restartPolicy"] == "Never"
    env = env_dict(container(pod)["env"])
    # NODE_RANK equals the rank label; MASTER_ADDR is rank 0's hostname.subdomain.namespace.svc
    assert env["NODE_RANK"] == meta["labels"][labels.NODE_RANK]
    pod0 = render_pod(job(), 0)["spec"]
    assert env["MASTER_ADDR"] == f"{pod0['hostname']}.{pod0['subdomain']}.ml.svc"
    assert env["DDPJOB_ATTEMPT"] == "2"


@pytest.mark.parametrize("nodes,elastic,expected", [
    (1, None, ["train-0"]),
    (10, None, [f"train-{r}" for r in range(10)]),       # up to 10 nodes: the names users know
    (11, None, [f"train-{r:02d}" for r in range(11)]),
    (4, {"minNodes": 2, "maxNodes": 12}, ["train-00", "train-01", "train-02", "train-03"]),  # room to grow
    (101, None, [f"train-{r:03d}" for r in range(101)]),
])
def test_hostnames_are_padded_to_the_widest_rank(nodes, elastic, expected):
    j = job(nodes=nodes, **({"elastic": elastic} if elastic else {}))
    assert [render_pod(j, r)["spec"]["hostname"] for r in range(nodes)] == expected
    assert env_dict(container(render_pod(j, 1 % nodes))["env"])["MASTER_ADDR"] == f"{expected[0]}.train.ml.svc"


@pytest.mark.parametrize("nodes", [2, 11, 12, 64])
def test_torchrun_numbers_the_pods_as_their_rank(nodes):
    # c10d's rendezvous gives node ranks in the sorted order of the nodes' descriptors, whose
    # address is the pod's FQDN (socket.getfqdn(): hostname.subdomain.namespace.svc.<domain>, as
    # the kubelet writes it into /etc/hosts): torch's own _NodeDesc, sorted as
    # _mark_rendezvous_complete sorts the participants.
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc
    j = job(nodes=nodes)
    descs = {}
    for r in range(nodes):
        spec = render_pod(j, r)["spec"]
        fqdn = f"{spec['hostname']}.{spec['subdomain']}.ml.svc.cluster.local"
        descs[_NodeDesc(fqdn, 1000 + (r * 7919) % 997, 0)] = int(env_dict(container(render_pod(j, r))["env"])["NODE_RANK"])
    assert [descs[d] for d in sorted(descs)] == list(range(nodes))


@pytest.mark.parametrize("domain,expected", [("", "train-0.train.ml.svc"),
                                             ("cluster.local", "train-0.train.ml.svc.cluster.local")])
def test_master_addr_cluster_domain(domain, expected):
    pod = render_pod(job(), 1, config=OperatorConfig(cluster_domain=domain))
    assert env_dict(container(pod)["env"])["MASTER_ADDR"] == expected


@pytest.mark.parametrize("spec,gpus,runtime,nproc", [
    ({"gpusPerNode": 8}, "8", "nvidia", "8"),                                  # default runtime class
    ({"gpusPerNode": 2, "runtimeClassName": "nvidia-cdi"}, "2", "nvidia-cdi", "2"),  # job overrides
    ({"gpusPerNode": 0}, None, None, "1"),                                     # CPU job: no GPU, no runtime
    ({"gpusPerNode": 0, "runtimeClassName": "kata"}, None, "kata", "1"),
    ({"gpusPerNode": 4, "nprocPerNode": 2}, "4", "nvidia", "2"),
])
def test_gpus_runtime_class_and_world_size(spec, gpus, runtime, nproc):
    pod = render_pod(job(**spec), 0, config=OperatorConfig(default_runtime_class="nvidia"))
    limits = container(pod)["resources"].get("limits", {})
    assert limits.get("nvidia.com/gpu") == gpus
    assert pod["spec"].get("runtimeClassName") == runtime
    env = env_dict(container(pod)["env"])
    assert env["NPROC_PER_NODE"] == nproc
    assert env["WORLD_SIZE"] == str(4 * int(nproc))


def test_operator_without_default_runtime_class():
    pod = render_pod(job(gpusPerNode=8), 0, config=OperatorConfig(default_runtime_class=""))
    assert "runtimeClassName" not in pod["spec"]


def test_gpu_limit_merges_with_user_resources():
    pod = render_pod(job(gpusPerNode=1, resources={"limits": {"memory": "8Gi"}, "requests": {"cpu": "2"}}), 0)
    assert container(pod)["resources"] == {"limits": {"memory": "8Gi", "nvidia.com/gpu": "1"},
                                           "requests": {"cpu": "2"}}


@pytest.mark.parametrize("spec,command,args", [
    ({}, LAUNCHER, None),                                                    # built-in trainer
    ({"command": ["torchrun", "train.py"], "args": ["--lr", "0.1"]},
     LAUNCHER + ["torchrun", "train.py"], ["--lr", "0.1"]),                  # user's command, wrapped
    ({"command": ["torchrun", "train.py"], "launcher": False}, ["torchrun", "train.py"], None),  # verbatim
])
def test_command_follows_launcher_contract(spec, command, args):
    c = container(render_pod(job(**spec), 0))
    assert c["command"] == command
    assert c.get("args") == args
    assert ("DDPJOB_TRAINER_CONFIG" in env_dict(c["env"])) == ("command" not in spec)


def test_shm_volume_user_volumes_and_mounts():
    vols = [{"name": "data", "persistentVolumeClaim": {"claimName": "imagenet"}}]
    mounts = [{"name": "data", "mountPath": "/data"}]
    pod = render_pod(job(shmSize="16Gi", volumes=vols, volumeMounts=mounts), 0)
    assert pod["spec"]["volumes"][0] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert pod["spec"]["volumes"][1:] == vols
    assert container(pod)["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}] + mounts


def test_scheduling_and_pod_level_pass_throughs():
    sched = {"schedulerName": "volcano", "priorityClassName": "high", "nodeSelector": {"gpu": "h100"},
             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
             "affinity": {"nodeAffinity": {"x": 1}}}
    pod = render_pod(job(scheduling=sched, serviceAccountName="trainer",
                         imagePullSecrets=[{"name": "regcred"}], env=[{"name": "FOO", "value": "bar"}],
                         podLabels={"team": "vision"}), 1)
    for key, value in sched.items():
        assert pod["spec"][key] == value
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["metadata"]["labels"]["team"] == "vision"
    assert env_dict(container(pod)["env"])["FOO"] == "bar"
    ports = {p["name"]: p["containerPort"] for p in container(pod)["ports"]}
    assert ports == {"master": 29500, "metrics": 9400}


OWN_SPREAD = [{"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
               "labelSelector": {"matchLabels": {"team": "vision"}}}]
JOB_PODS = {"labelSelector": {"matchLabels": {labels.JOB_NAME: "train"}}}
# One pod per node, refused otherwise: minDomains = the job's 4 pods.
HARD = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
        "minDomains": 4, **JOB_PODS}
SOFT = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway", **JOB_PODS}
OWN_HOST_HARD = [{"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
                  "labelSelector": {"matchLabels": {"team": "vision"}}}]
OWN_HOST_SOFT = [{**OWN_HOST_HARD[0], "whenUnsatisfiable": "ScheduleAnyway"}]


@pytest.mark.parametrize("spec, expected", [
    ({}, [HARD]),
    ({"gpusPerNode": 8}, [HARD]),
    ({"scheduling": {"nodeSelector": {"gpu": "h100"}}}, [HARD]),
    ({"scheduling": {"onePodPerNode": True}}, [HARD]),
    # The job's own constraints keep one pod per node, added after theirs.
    ({"scheduling": {"topologySpreadConstraints": OWN_SPREAD}}, OWN_SPREAD + [HARD]),
    ({"template": {"spec": {"topologySpreadConstraints": OWN_SPREAD}}}, OWN_SPREAD + [HARD]),
    ({"scheduling": {"topologySpreadConstraints": OWN_HOST_SOFT}}, OWN_HOST_SOFT + [HARD]),
    # The job's own hard rule per node is the one (the API allows one per key and mode).
    ({"scheduling": {"topologySpreadConstraints": OWN_HOST_HARD}}, OWN_HOST_HARD),
    # Relaxed: a preference, which the job's own constraints replace.
    ({"scheduling": {"onePodPerNode": False}}, [SOFT]),
    ({"scheduling": {"onePodPerNode": False, "topologySpreadConstraints": OWN_SPREAD}}, OWN_SPREAD),
    ({"scheduling": {"onePodPerNode": False}, "template": {"spec": {"topologySpreadConstraints": OWN_SPREAD}}},
     OWN_SPREAD),
    # spec.scheduling's constraints replace the template's.
    ({"scheduling": {"topologySpreadConstraints": OWN_HOST_SOFT},
      "template": {"spec": {"topologySpreadConstraints": OWN_SPREAD}}}, OWN_HOST_SOFT + [HARD]),
])
def test_one_pod_per_node_is_a_hard_rule_unless_relaxed(spec, expected):
    pods = [render_pod(job(**spec), r, attempt=a) for r in range(4) for a in (0, 1)]
    assert all(p["spec"]["topologySpreadConstraints"] == expected for p in pods)
    # The selector matches every pod of the job, whatever its rank or attempt.
    assert all(p["metadata"]["labels"][labels.JOB_NAME] == "train" for p in pods)


@pytest.mark.parametrize("nodes", [1, 3, 64])
def test_one_pod_per_node_counts_the_jobs_own_pods(nodes):
    (rule,) = render_pod(job(nodes=nodes), 0)["spec"]["topologySpreadConstraints"]
    assert rule["minDomains"] == nodes and rule["whenUnsatisfiable"] == "DoNotSchedule"


def test_user_env_overrides_ours_by_name():
    pod = render_pod(job(env=[{"name": "MASTER_PORT", "value": "1234"}]), 0)
    names = [e["name"] for e in container(pod)["env"]]
    assert names.count("MASTER_PORT") == 1
    assert env_dict(container(pod)["env"])["MASTER_PORT"] == "1234"


def test_elastic_job_gets_rendezvous_env():
    env = env_dict(container(render_pod(job(nodes=4, elastic={"minNodes": 2, "maxNodes": 6}), 1))["env"])
    assert env["PET_NNODES"] == "2:6"
    assert env["PET_RDZV_BACKEND"] == "c10d"
    assert env["PET_RDZV_ENDPOINT"] == "train-0.train.ml.svc:29500"
    assert "PET_NODE_RANK" not in env


def test_render_does_not_mutate_the_manifest():
    m = manifest(volumes=[{"name": "v", "emptyDir": {}}])
    before = copy.deepcopy(m)
    render_pod(from_manifest(m), 0)
    assert m == before


def test_render_file(tmp_path):
    path = tmp_path / "job.yaml"
    m = manifest(nodes=3, namespace=None, stored=False)
    path.write_text(yaml.safe_dump(m))
    docs = list(yaml.safe_load_all(render_file(str(path), namespace="team-a")))
    assert [d["kind"] for d in docs] == ["Service", "Pod", "Pod", "Pod"]
    assert all(d["metadata"]["namespace"] == "team-a" for d in docs)
    assert [d["metadata"]["name"] for d in docs[1:]] == ["train-0", "train-1", "train-2"]


def test_render_file_rejects_invalid_spec_naming_the_field(tmp_path):
    import click

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(manifest(nodes=0)))
    with pytest.raises(click.ClickException, match=r"spec\.nodes"):
        render_file(str(path))


def test_render_file_refuses_more_processes_than_gpus(tmp_path):
    import click

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(manifest(gpusPerNode=2, nprocPerNode=4)))
    with pytest.raises(click.ClickException, match=r"spec\.nprocPerNode must be <= spec\.gpusPerNode"):
        render_file(str(path))


def test_example_resnet_gpu_renders_4_pods_with_8_gpus():
    from tests.support.cluster import REPO_ROOT

    docs = list(yaml.safe_load_all(render_file(str(REPO_ROOT / "examples/resnet-gpu.yaml"), namespace="d")))
    pods = [d for d in docs if d["kind"] == "Pod"]
    assert len(pods) == 4
    for rank, pod in enumerate(pods):
        assert container(pod)["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert pod["spec"]["runtimeClassName"] == "nvidia"
        env = env_dict(container(pod)["env"])
        assert env["NODE_RANK"] == str(rank) and env["WORLD_SIZE"] == "32"


@pytest.mark.parametrize("elastic, mlflow", [
    (None, None), ({"minNodes": 1, "maxNodes": 4}, None),
    # The operator's default tracking URI adds variables (and the Secret's) only the config knows of.
    (None, {"credentialsSecret": "creds"}),
])
def test_job_field_follows_render_pod(elastic, mlflow):
    """pods.job_field (which names the DDPJob field in a refused create) agrees with render_pod about
    where each user-written list entry lands in the Pod."""
    from ddpjob_operator.builders.pods import job_field

    extra = {"elastic": elastic} if elastic else {}
    if mlflow is not None:
        extra["trainer"] = {"mlflow": mlflow}
    config = OperatorConfig(mlflow_tracking_uri="http://mlflow.mlops:5000")
    j = job(env=[{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
            volumes=[{"name": "d", "emptyDir": {}}, {"name": "e", "emptyDir": {}}],
            volumeMounts=[{"name": "d", "mountPath": "/d"}, {"name": "e", "mountPath": "/e"}], **extra)
    pod = render_pod(j, 1, config=config)
    if mlflow is not None:
        assert env_dict(container(pod)["env"])["MLFLOW_TRACKING_URI"] == "http://mlflow.mlops:5000"
    c = container(pod)
    lists = {"spec.containers[0].env": (c["env"], "env"), "spec.volumes": (pod["spec"]["volumes"], "volumes"),
             "spec.containers[0].volumeMounts": (c["volumeMounts"], "volumeMounts")}
    for base, (items, key) in lists.items():
        for i, item in enumerate(items):
            field = job_field(f"{base}[{i}].name", j, rank=1, config=config)
            if item in j.raw["spec"][key]:
                assert field == f"spec.{key}[{j.raw['spec'][key].index(item)}].name"
            else:
                assert field is None, (base, i, item)
