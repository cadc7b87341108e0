"""The env every training container gets: one function for pods and local runs."""
from __future__ import annotations

import functools
import json

import pytest

from ddpjob_api.names import master_dns
from ddpjob_api.spec import resolve_nproc
from ddpjob_operator.builders.envvars import env_dict, nccl_env, pod_env
from tests.support.builders import make_job


# 4 nodes x 8 GPUs: the assertions spell out its names, sizes and uid (bert-0.bert.ml.svc, 32, u-1).
job = functools.partial(make_job, "bert", namespace="ml", uid="u-1", nodes=4, gpusPerNode=8, trainer={"epochs": 2})


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_every_job_rendezvouses_through_c10d_at_pod_0_so_workers_restart_in_place(rank):
    env = env_dict(pod_env(job(failurePolicy={"maxRestarts": 5}), rank, attempt=2))
    assert env["MASTER_ADDR"] == "bert-0.bert.ml.svc" and env["MASTER_PORT"] == "29500"
    assert env["PET_RDZV_BACKEND"] == "c10d"
    assert env["PET_RDZV_ENDPOINT"] == "bert-0.bert.ml.svc:29500"
    assert env["PET_RDZV_ID"] == "u-1-2"  # one rendezvous per attempt
    assert env["PET_MAX_RESTARTS"] == "5"  # failurePolicy.maxRestarts: torchrun's in-place budget per pod
    assert env["NODE_RANK"] == str(rank) and "PET_NODE_RANK" not in env  # c10d numbers the nodes
    assert env["NNODES"] == env["PET_NNODES"] == "4"
    assert env["NPROC_PER_NODE"] == env["PET_NPROC_PER_NODE"] == "8"
    assert env["WORLD_SIZE"] == "32"
    assert json.loads(env["DDPJOB_TRAINER_CONFIG"]) == {"epochs": 2}
    assert env["DDPJOB_IMAGE"] == "img"  # spec.image: the MLflow run's tag ddpjob.image
    # Pod 0 hosts the c10d store, by the config torchrun reads (--rdzv-conf), not by its guess from DNS.
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
    conf = _parse_rendezvous_config(env["PET_RDZV_CONF"])
    params = RendezvousParameters("c10d", env["PET_RDZV_ENDPOINT"], "u-1-2", 4, 4, **conf)
    assert params.get_as_bool("is_host") is (rank == 0)


def test_a_users_own_rendezvous_endpoint_gets_no_host_of_ours():
    env = env_dict(pod_env(job(env=[{"name": "PET_RDZV_ENDPOINT", "value": "etcd:2379"}]), 0))
    assert env["PET_RDZV_ENDPOINT"] == "etcd:2379" and "PET_RDZV_CONF" not in env


@pytest.mark.parametrize("nproc, gpus, expected", [
    ("auto", 8, 8), ("auto", 0, 1), (None, 2, 2), (3, 0, 3), ("4", 8, 4)])
def test_nproc_auto_is_one_per_gpu_or_one_on_cpu(nproc, gpus, expected):
    assert resolve_nproc(nproc, gpus) == expected


def test_local_mode_overrides_master_and_ports():
    env = env_dict(pod_env(job(), 1, master_addr="127.0.0.1", master_port=40000,
                           metrics_port=19401, attempt=2))
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["PET_RDZV_ENDPOINT"] == "127.0.0.1:40000"
    assert env["MASTER_PORT"] == "40000" and env["DDPJOB_METRICS_PORT"] == "19401"
    assert env["DDPJOB_ATTEMPT"] == "2"


def test_cluster_domain_is_appended_when_configured():
    assert master_dns(job(), cluster_domain="cluster.local") == "bert-0.bert.ml.svc.cluster.local"


def test_elastic_job_gets_its_node_range_and_its_own_in_place_budget():
    env = env_dict(pod_env(job(elastic={"minNodes": 2, "maxNodes": 6}), 1))
    assert env["PET_NNODES"] == "2:6"
    assert env["PET_RDZV_BACKEND"] == "c10d"
    assert env["PET_RDZV_ID"] == "u-1-0"
    assert env["PET_MAX_RESTARTS"] == "3"  # failurePolicy.maxRestarts' default
    assert env_dict(pod_env(job(elastic={"minNodes": 2, "maxRestarts": 1}), 1))["PET_MAX_RESTARTS"] == "1"


def test_user_env_wins_and_appears_once():
    env = pod_env(job(env=[{"name": "MASTER_PORT", "value": "1234"},
                          {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]), 0)
    names = [e["name"] for e in env]
    assert names.count("MASTER_PORT") == 1
    assert env_dict(env)["MASTER_PORT"] == "1234"
    assert {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}} in env


@pytest.mark.parametrize("nccl, expected", [
    ({"p2pDisable": True}, {"NCCL_P2P_DISABLE": "1"}),
    ({"debug": "INFO", "socketIfname": "eth0"}, {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0"}),
    ({"ibDisable": False}, {"NCCL_IB_DISABLE": "0"}),
    ({"minNchannels": 4}, {"NCCL_MIN_NCHANNELS": "4"}),
])
def test_nccl_knobs_become_nccl_env(nccl, expected):
    assert nccl_env(nccl) == expected
    assert expected.items() <= env_dict(pod_env(job(nccl=nccl), 0)).items()


def test_command_jobs_get_no_trainer_config():
    assert "DDPJOB_TRAINER_CONFIG" not in env_dict(pod_env(job(command=["torchrun", "t.py"]), 0))


@pytest.mark.parametrize("resources, present", [
    ({"requests": {"cpu": "6"}}, True),
    ({"limits": {"cpu": "6"}}, False),   # a limit alone: the trainer falls back to its affinity mask
    ({}, False),
])
def test_the_pods_cpu_request_reaches_the_trainer_through_the_downward_api(resources, present):
    env = {e["name"]: e for e in pod_env(job(resources=resources), 0)}
    assert ("DDPJOB_CPUS" in env) is present
    if present:
        ref = env["DDPJOB_CPUS"]["valueFrom"]["resourceFieldRef"]
        assert ref == {"containerName": "trainer", "resource": "requests.cpu", "divisor": "1"}
        assert "DDPJOB_CPUS" not in env_dict(list(env.values()))  # local runs: not a plain value


@pytest.mark.parametrize("gpus, expected", [(8, "8"), (0, "0")])
def test_the_trainer_is_told_whether_its_ranks_need_gpus(gpus, expected):
    assert env_dict(pod_env(job(gpusPerNode=gpus, nprocPerNode=1), 0))["DDPJOB_GPUS_PER_NODE"] == expected


def test_every_pod_gets_the_jobs_uid_and_mlflows_own_variables_from_trainer_mlflow():
    plain = env_dict(pod_env(job(), 0))
    assert plain["DDPJOB_UID"] == "u-1" and not {"MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"} & set(plain)
    tracked = job(trainer={"mlflow": {"trackingUri": "http://mlflow.mlops:5000", "experiment": "vision"}})
    for rank in (0, 3):
        env = env_dict(pod_env(tracked, rank))
        assert (env["MLFLOW_TRACKING_URI"], env["MLFLOW_EXPERIMENT_NAME"]) == ("http://mlflow.mlops:5000", "vision")
    default = env_dict(pod_env(job(trainer={"mlflow": {"trackingUri": "http://m"}}), 0))
    assert default["MLFLOW_EXPERIMENT_NAME"] == "ddpjob"  # the trainer's default experiment
    # spec.env wins by name, as for every variable of ours.
    mine = env_dict(pod_env(job(trainer={"mlflow": {"trackingUri": "http://m"}},
                                env=[{"name": "MLFLOW_EXPERIMENT_NAME", "value": "mine"}]), 0))
    assert mine["MLFLOW_EXPERIMENT_NAME"] == "mine"


@pytest.mark.parametrize("template, grace", [
    (None, 30 - 7.0),                                                    # Kubernetes' default grace period
    ({"spec": {"terminationGracePeriodSeconds": 120}}, 113.0),
    ({"spec": {"terminationGracePeriodSeconds": 10}}, 3.0),
    ({"spec": {"terminationGracePeriodSeconds": 5}}, 0.0),              # shorter than the margin
    ({"spec": {"terminationGracePeriodSeconds": 0}}, 0.0),
])
def test_the_launchers_stop_grace_follows_the_pods_termination_grace_period(template, grace):
    from ddpjob_operator.builders.pods import render_pod

    spec = {"template": template} if template else {}
    pod = render_pod(make_job("j", **spec), 0)
    env = env_dict(pod["spec"]["containers"][0]["env"])
    assert float(env["DDPJOB_STOP_GRACE_SECONDS"]) == grace
    assert pod["spec"].get("terminationGracePeriodSeconds") == (template or {}).get("spec", {}).get(
        "terminationGracePeriodSeconds")


def test_a_stop_grace_in_spec_env_wins_and_a_local_run_keeps_the_launchers_default():
    from ddpjob_operator.builders.pods import render_pod

    pod = render_pod(make_job("j", env=[{"name": "DDPJOB_STOP_GRACE_SECONDS", "value": "2"}]), 0)
    env = pod["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "DDPJOB_STOP_GRACE_SECONDS"] == ["2"]
    assert "DDPJOB_STOP_GRACE_SECONDS" not in env_dict(pod_env(job(), 0))  # what `ddpjob run --local` uses


SECRET_ENV = {"MLFLOW_TRACKING_TOKEN": "token", "MLFLOW_TRACKING_USERNAME": "username",
              "MLFLOW_TRACKING_PASSWORD": "password"}


@pytest.mark.parametrize("mlflow, default, expected", [
    # The job's own URI; the operator's default unused.
    ({"trackingUri": "http://team:5000"}, "http://platform:5000",
     {"MLFLOW_TRACKING_URI": "http://team:5000", "MLFLOW_EXPERIMENT_NAME": "ddpjob", "DDPJOB_MLFLOW": "optional"}),
    # `mlflow: {}` opts in to the operator's default.
    ({}, "http://platform:5000",
     {"MLFLOW_TRACKING_URI": "http://platform:5000", "MLFLOW_EXPERIMENT_NAME": "ddpjob", "DDPJOB_MLFLOW": "optional"}),
    ({"experiment": "vision", "runName": "a", "required": True}, "http://platform:5000",
     {"MLFLOW_TRACKING_URI": "http://platform:5000", "MLFLOW_EXPERIMENT_NAME": "vision", "DDPJOB_MLFLOW": "required",
      "DDPJOB_MLFLOW_RUN_NAME": "a"}),
    # systemMetrics: each node's launcher logs them (false: nothing said).
    ({"systemMetrics": True}, "http://platform:5000",
     {"MLFLOW_TRACKING_URI": "http://platform:5000", "MLFLOW_EXPERIMENT_NAME": "ddpjob", "DDPJOB_MLFLOW": "optional",
      "DDPJOB_MLFLOW_SYSTEM_METRICS": "1"}),
    ({"systemMetrics": False}, "http://platform:5000",
     {"MLFLOW_TRACKING_URI": "http://platform:5000", "MLFLOW_EXPERIMENT_NAME": "ddpjob", "DDPJOB_MLFLOW": "optional"}),
    # No URI anywhere: no tracking; no mlflow section: no tracking, whatever the default.
    ({}, None, {}),
    (None, "http://platform:5000", {}),
])
def test_mlflow_variables_from_the_job_or_the_operators_default(mlflow, default, expected):
    trainer = {"epochs": 1} if mlflow is None else {"mlflow": mlflow}
    env = env_dict(pod_env(job(trainer=trainer), 1, mlflow_tracking_uri=default))
    assert {k: v for k, v in env.items() if "MLFLOW" in k} == expected


def test_mlflow_credentials_come_only_from_the_named_secret():
    tracked = {"trackingUri": "http://m:5000", "credentialsSecret": "mlflow-creds"}
    env = pod_env(job(trainer={"mlflow": tracked}), 0)
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]}
    assert refs == {var: {"name": "mlflow-creds", "key": key, "optional": True} for var, key in SECRET_ENV.items()}
    assert not set(SECRET_ENV) & set(env_dict(env))  # never a plain value
    # No tracking (no URI), no credentials; the operator's default brings them with it.
    untracked = pod_env(job(trainer={"mlflow": {"credentialsSecret": "mlflow-creds"}}), 0)
    assert not set(SECRET_ENV) & {e["name"] for e in untracked}
    by_default = pod_env(job(trainer={"mlflow": {"credentialsSecret": "c"}}), 0, mlflow_tracking_uri="http://p")
    assert set(SECRET_ENV) <= {e["name"] for e in by_default}


@pytest.mark.parametrize("spec,restart,timeout", [
    ({}, "1", None),                                                  # the default: restart in place
    ({"hangTimeoutSeconds": 90}, "1", "90"),
    ({"hangTimeoutSeconds": 90, "failurePolicy": {"restartOnHang": False}}, "0", "90"),
])
def test_the_agents_watchdog_gets_restart_on_hang_and_the_hang_timeout(spec, restart, timeout):
    env = env_dict(pod_env(job(**spec), 0))
    assert env["DDPJOB_RESTART_ON_HANG"] == restart
    assert env.get("DDPJOB_HANG_TIMEOUT_SECONDS") == timeout  # unset: the agent derives it as the monitor does


FT = {"mode": "perStep", "minReplicas": 2, "timeoutSeconds": 4, "quorumTimeoutSeconds": 30}


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_a_per_step_pod_is_a_torchrun_world_of_its_own_reached_at_its_ip(rank):
    """spec.faultTolerance: each pod is one replica group, hosting its own c10d store at its IP; the job-level
    NODE_RANK/NNODES say which group of how many; the trainer gets the Lighthouse and the quorum's timing."""
    listed = pod_env(job(faultTolerance=FT), rank, attempt=2)
    assert listed[0] == {"name": "DDPJOB_FT_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    env = env_dict(listed)
    assert env["MASTER_ADDR"] == "$(DDPJOB_FT_HOST)" and env["MASTER_PORT"] == "29500"
    assert env["PET_RDZV_ENDPOINT"] == "$(DDPJOB_FT_HOST):29500" and env["PET_RDZV_CONF"] == "is_host=true"
    assert env["PET_NNODES"] == "1" and "PET_NODE_RANK" not in env
    assert env["NODE_RANK"] == str(rank) and env["NNODES"] == "4"
    assert env["DDPJOB_FT_LIGHTHOUSE"] == "http://bert-ft.ml.svc:29510"
    assert (env["DDPJOB_FT_MIN_REPLICAS"], env["DDPJOB_FT_TIMEOUT_SECONDS"],
            env["DDPJOB_FT_QUORUM_TIMEOUT_SECONDS"]) == ("2", "4", "30")


def test_a_local_per_step_node_gets_loopback_its_own_port_and_the_local_lighthouse():
    env = env_dict(pod_env(job(faultTolerance={"mode": "perStep"}), 1, master_port=40001, ft_host="127.0.0.1",
                           ft_lighthouse="http://127.0.0.1:40100"))
    assert env["DDPJOB_FT_HOST"] == env["MASTER_ADDR"] == "127.0.0.1"
    assert env["PET_RDZV_ENDPOINT"] == "127.0.0.1:40001" and env["DDPJOB_FT_LIGHTHOUSE"] == "http://127.0.0.1:40100"
    assert (env["DDPJOB_FT_MIN_REPLICAS"], env["DDPJOB_FT_TIMEOUT_SECONDS"],
            env["DDPJOB_FT_QUORUM_TIMEOUT_SECONDS"]) == ("1", "3", "60")  # the CRD's defaults


@pytest.mark.parametrize("rank", [0, 2])
def test_without_fault_tolerance_no_ft_variable_and_the_env_is_as_before(rank):
    listed = pod_env(job(), rank, attempt=1)
    assert not [e for e in listed if e["name"].startswith("DDPJOB_FT_")]
    env = env_dict(listed)
    assert env["PET_NNODES"] == "4" and env["MASTER_ADDR"] == "bert-0.bert.ml.svc"
    assert env["PET_RDZV_CONF"] == f"is_host={'true' if rank == 0 else 'false'}"
