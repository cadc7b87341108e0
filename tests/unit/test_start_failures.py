"""Jobs that cannot start say why: containers stuck before starting (ContainersNotStarting) and pod
creates the API server refused (FailedCreatePod). Pure: lifecycle.decide + status.job_status."""
from __future__ import annotations

import json

import pytest

from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions.lifecycle import decide
from ddpjob_api.phases import Phase
from ddpjob_operator.app.children import refusal
from ddpjob_operator.decisions.status import CreateRefusal
from ddpjob_operator.decisions.status import create_refused
from tests.support.builders import NOW, ago, make_job, make_pod, running_status
from tests.support.passes import pass_status
from tests.unit.test_status import cond

PULL_MSG = 'Back-off pulling image "reg/trainer:typo": ErrImagePull: not found'


def stuck(rank, reason, *, init=False, message=PULL_MSG, phase="Pending"):
    pod = make_pod(rank, phase=phase)
    key = "initContainerStatuses" if init else "containerStatuses"
    name = "setup" if init else "trainer"
    pod["status"][key] = [{"name": name, "state": {"waiting": {"reason": reason, "message": message}}}]
    return pod


def waiting_status(reason, since):
    return {"phase": "Pending", "attempt": 0, "launchedAttempt": 0, "startTime": ago(since + 5),
            "conditions": [{"type": "ContainersNotStarting", "status": "True", "reason": reason,
                            "message": "", "lastTransitionTime": ago(since)}]}


@pytest.mark.parametrize("reason,init", [
    ("ErrImagePull", False), ("ImagePullBackOff", False), ("ErrImageNeverPull", False),
    ("InvalidImageName", False), ("CreateContainerConfigError", False), ("CreateContainerError", False),
    ("CrashLoopBackOff", True), ("ImagePullBackOff", True),
])
def test_stuck_container_named_in_reason_condition_and_one_event(reason, init):
    job = make_job(nodes=2)
    pods = [make_pod(0, phase="Pending"), stuck(1, reason, init=init)]
    status, events = pass_status(job, Group.of(pods), now=NOW, prev_status={"phase": "Pending", "attempt": 0})
    kind = "init container setup" if init else "container trainer"
    assert status["phase"] == "Pending" and status["reason"] == reason
    assert status["message"].startswith(f"pod j-1 {kind}: {reason}: {PULL_MSG}; waiting")
    c = cond(status, "ContainersNotStarting")
    assert c["status"] == "True" and c["reason"] == reason and f"pod j-1 {kind}: {reason}" in c["message"]
    assert ("Warning", reason, c["message"]) in events
    # The next pass (same pods) keeps the condition and posts nothing new.
    again, events2 = pass_status(job, Group.of(pods), now=NOW, prev_status=status)
    assert cond(again, "ContainersNotStarting") == c and not [e for e in events2 if e[1] == reason]


@pytest.mark.parametrize("pod", [
    make_pod(0, phase="Pending"),                                             # not even scheduled yet
    stuck(0, "ContainerCreating", message=""),                                # normal start
    stuck(0, "PodInitializing", message=""),
    stuck(0, "CrashLoopBackOff"),            # the trainer never loops (restartPolicy Never): not a start error
])
def test_normal_start_is_not_a_start_error(pod):
    status, _ = pass_status(make_job(nodes=1), Group.of([pod]), now=NOW, prev_status={"phase": "Pending", "attempt": 0})
    assert status["reason"] == "Created" and cond(status, "ContainersNotStarting") is None


def test_default_policy_keeps_waiting_like_kubeflow_and_jobset():
    d = decide(make_job(nodes=1), Group.of([stuck(0, "ImagePullBackOff")]), now=NOW,
               prev_status=waiting_status("ImagePullBackOff", since=86400))
    assert d.phase is Phase.PENDING and d.reason == "ImagePullBackOff" and d.requeue_after is None
    assert "set spec.failurePolicy.podStartTimeoutSeconds to fail instead" in d.message


@pytest.mark.parametrize("since,phase", [(0, Phase.PENDING), (299, Phase.PENDING), (300, Phase.FAILED),
                                         (5000, Phase.FAILED)])
def test_pod_start_timeout_fails_the_job_with_the_container_reason(since, phase):
    job = make_job(nodes=2, failurePolicy={"podStartTimeoutSeconds": 300})
    pods = [make_pod(0), stuck(1, "ErrImagePull")]
    prev = waiting_status("ErrImagePull", since) if since else {"phase": "Pending", "attempt": 0}
    d = decide(job, Group.of(pods), now=NOW, prev_status=prev)
    assert d.phase is phase and d.reason == "ErrImagePull" and "pod j-1 container trainer" in d.message
    if phase is Phase.FAILED:
        assert "podStartTimeoutSeconds=300" in d.message and d.completion_time == NOW
        assert d.delete_pods == ["j-0", "j-1"]      # cleanPodPolicy Running: unfinished pods go
    else:
        assert d.requeue_after == pytest.approx(300 - since) and "failing after" in d.message


def test_condition_clears_once_the_container_starts():
    prev = waiting_status("ImagePullBackOff", since=60)
    status, _ = pass_status(make_job(nodes=1), Group.of([make_pod(0)]), now=NOW, prev_status=prev)
    c = cond(status, "ContainersNotStarting")
    assert status["phase"] == "Running" and c["status"] == "False" and c["reason"] == "Started"


def test_only_the_current_attempt_counts():
    prev = {"phase": "Restarting", "attempt": 1, "launchedAttempt": 0}
    old = stuck(0, "ImagePullBackOff")
    old["metadata"]["deletionTimestamp"] = ago(1)
    d = decide(make_job(nodes=1), Group.of([old]), now=NOW, prev_status=prev)
    assert d.start_errors == []


# -- refused creates --------------------------------------------------------------------------------
INVALID = json.dumps({"kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422,
                      "message": 'Pod "j-0" is invalid: spec.containers[0].env[0].name: Invalid value: "A=B": '
                                 "a valid environment variable name must consist only of printable ASCII "
                                 "characters other than '='"})
QUOTA = json.dumps({"kind": "Status", "reason": "Forbidden", "code": 403,
                    "message": 'pods "j-1" is forbidden: exceeded quota: gpus, requested: nvidia.com/gpu=8, '
                               "used: nvidia.com/gpu=8, limited: nvidia.com/gpu=8"})


@pytest.mark.parametrize("code,body,reason,permanent", [
    (422, INVALID, "Invalid", True),
    (400, b'{"reason": "BadRequest", "message": "bad"}', "BadRequest", True),
    (403, QUOTA, "Forbidden", False),
    (400, "plain text body", "400", True),
])
def test_refusal_from_api_error(code, body, reason, permanent):
    r = refusal("j-0", code, body)
    assert r.reason == reason and r.permanent is permanent and r.message


# What a 1.32 API server answers a strict create of a pod with a 1.33 field.
UNKNOWN = json.dumps({"kind": "Status", "reason": "BadRequest", "code": 400,
                      "message": 'Pod in version "v1" cannot be handled as a Pod: strict decoding error: '
                                 'unknown field "spec.containers[0].lifecycle.stopSignal"'})


def test_a_field_the_api_server_lacks_is_refused_naming_it_and_the_servers_version():
    from ddpjob_operator.app.children import split_creates, unknown_field
    from kubernetes.client.rest import ApiException

    r = refusal("j-0", 400, UNKNOWN, server="v1.32.9")
    assert r.permanent and "spec.containers[0].lifecycle.stopSignal" in r.message
    assert "Kubernetes v1.32.9, which does not have that field" in r.message
    assert "Kubernetes" not in refusal("j-0", 422, INVALID, server="v1.32.9").message  # other errors: as they were
    exc = ApiException(status=400, reason="BadRequest")
    exc.body = UNKNOWN
    assert unknown_field(exc) and not unknown_field(ValueError("unknown field"))
    _, refused = split_creates([make_pod(0)], [exc], server="v1.32.9")
    assert "v1.32.9" in refused[0].message
    job = make_job(nodes=1, template={"spec": {"containers": [{"name": "trainer", "lifecycle": {"stopSignal": "SIGUSR1"}}]}})
    status, _ = pass_status(job, Group.of([]), now=NOW, prev_status=None)      # the pass that creates rank 0
    new, _ = create_refused(job, status, [r], now=NOW)
    assert new["phase"] == "Failed" and "(DDPJob spec.template.spec.containers[0].lifecycle.stopSignal)" in new["message"], new
    # The passes after it keep saying so: no pod was ever created.
    after, _ = pass_status(job, Group.of([]), now=NOW, prev_status=new)
    assert after["phase"] == "Failed"
    assert cond(after, "FailedCreatePod")["status"] == "True" and "stopSignal" in cond(after, "FailedCreatePod")["message"]
    assert cond(after, "Created")["status"] == "False", after["conditions"]


@pytest.mark.parametrize("code", [409, 429, 500, 503, None, 200])
def test_retryable_errors_are_not_refusals(code):
    assert refusal("j-0", code, "{}") is None


def test_invalid_pod_fails_the_job_with_the_api_message():
    job = make_job(nodes=2)
    status, _ = pass_status(job, Group.of([]), now=NOW, prev_status=None)      # the pass that creates both ranks
    new, events = create_refused(job, status, [refusal("j-0", 422, INVALID)], now=NOW)
    assert new["phase"] == "Failed" and new["reason"] == "FailedCreatePod"
    assert "spec.containers[0].env[0].name" in new["message"] and "cannot start" in new["message"]
    assert new["completionTime"] == "2026-11-22T12:00:00Z"
    c = cond(new, "FailedCreatePod")
    assert c["status"] == "True" and c["reason"] == "Invalid" and "pod(s) j-0" in c["message"]
    assert cond(new, "Created")["status"] == "False" and cond(new, "Failed")["reason"] == "FailedCreatePod"
    assert events == [("Warning", "FailedCreatePod", c["message"])]
    # Failed is final: the next pass creates nothing and keeps the reason.
    d = decide(job, Group.of([]), now=NOW, prev_status=new)
    assert d.phase is Phase.FAILED and d.create_ranks == [] and d.reason == "FailedCreatePod"


def test_quota_refusal_waits_with_the_reason_until_every_pod_exists():
    job = make_job(nodes=2)
    status, _ = pass_status(job, Group.of([make_pod(0, phase="Pending")]), now=NOW, prev_status=None)
    new, events = create_refused(job, status, [refusal("j-1", 403, QUOTA)], now=NOW)
    assert new["phase"] == "Pending" and new["reason"] == "FailedCreatePod" and "exceeded quota" in new["message"]
    assert len(events) == 1
    # Next pass, still refused: the status keeps saying so (no flip back to "Created").
    again, ev = pass_status(job, Group.of([make_pod(0, phase="Pending")]), now=NOW, prev_status=new)
    assert again["reason"] == "FailedCreatePod" and "exceeded quota" in again["message"]
    assert cond(again, "Created")["status"] == "False" and ev == []
    again2, ev2 = create_refused(job, again, [refusal("j-1", 403, QUOTA)], now=NOW)
    assert again2["phase"] == "Pending" and ev2 == []                 # same message: no new event
    # Quota freed: every pod exists, the condition clears and Created is true again.
    done, _ = pass_status(job, Group.of([make_pod(0), make_pod(1)]), now=NOW, prev_status=again2)
    assert done["phase"] == "Running" and cond(done, "FailedCreatePod")["status"] == "False"
    assert cond(done, "Created")["status"] == "True"


def test_no_refusals_change_nothing():
    status = {"phase": "Pending"}
    assert create_refused(make_job(nodes=1), status, [], now=NOW) == (status, [])


def test_refusal_is_a_value():
    assert CreateRefusal("p", 422, "Invalid", "m").permanent


# -- evidence kept across a group restart ---------------------------------------------------------------
from ddpjob_operator.decisions.status import MAX_FAILURES, failure_evidence  # noqa: E402


def killed(rank, code, *, attempt=0, message="", signal=None):
    pod = make_pod(rank, attempt=attempt, phase="Failed", exit_code=code, message=message,
                   node_name=f"gpu-node-{rank}")
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    term.update(reason="Error", finishedAt=ago(3))
    if signal:
        term["signal"] = signal
    return pod


def test_a_group_restart_keeps_each_failed_rank_in_status():
    tail = "Traceback ...\nRuntimeError: NCCL error: unhandled system error"
    pods = [killed(0, 137), make_pod(1), killed(2, 1, message=tail)]
    status, _ = pass_status(make_job(nodes=3, failurePolicy={"logTailInStatus": True}), Group.of(pods), now=NOW,
                            prev_status=running_status())
    assert status["phase"] == "Restarting" and status["attempt"] == 1
    assert status["failures"] == [
        {"attempt": 0, "pod": "j-0", "rank": 0, "container": "trainer", "exitCode": 137, "signal": 9,
         "reason": "Error", "node": "gpu-node-0", "finishedAt": ago(3)},
        {"attempt": 0, "pod": "j-2", "rank": 2, "container": "trainer", "exitCode": 1, "reason": "Error",
         "node": "gpu-node-2", "finishedAt": ago(3), "logTail": tail},
    ]
    # The next passes (old pods terminating, new ones created) keep it and do not repeat it.
    nxt, _ = pass_status(make_job(nodes=3), Group.of([make_pod(0, attempt=1)]), now=NOW, prev_status=status)
    assert nxt["failures"] == status["failures"]


def test_log_tails_stay_out_of_status_unless_the_job_opts_in():
    tail = "connecting to https://alice:hunter2@mlflow.example/api\nRuntimeError: boom"
    pods = [killed(0, 1, message=tail), make_pod(1)]
    status, events = pass_status(make_job(nodes=2), Group.of(pods), now=NOW, prev_status=running_status())
    assert "logTail" not in status["failures"][0] and "boom" not in status["message"]
    assert status["message"] == "pod j-0 failed with exit code 1 (Error)"
    assert not any("boom" in m for _, _, m in events)
    opted, events = pass_status(make_job(nodes=2, failurePolicy={"logTailInStatus": True}), Group.of(pods), now=NOW,
                                prev_status=running_status())
    assert opted["failures"][0]["logTail"].endswith("RuntimeError: boom")
    assert "hunter2" not in opted["failures"][0]["logTail"] and "https://***@mlflow.example" in \
        opted["failures"][0]["logTail"]
    assert opted["message"] == "pod j-0 failed with exit code 1 (Error): RuntimeError: boom"


def test_the_final_failure_is_kept_too_and_the_list_is_bounded():
    prev = running_status(restarts=3, countedRestarts=3, attempt=3, launchedAttempt=3,
                          failures=[{"attempt": a % 3, "pod": f"j-{a}", "exitCode": 1} for a in range(MAX_FAILURES)])
    status, _ = pass_status(make_job(nodes=1, failurePolicy={"maxRestarts": 3}), Group.of([killed(0, 2, attempt=3)]),
                            now=NOW, prev_status=prev)
    assert status["phase"] == "Failed" and len(status["failures"]) == MAX_FAILURES
    assert status["failures"][-1]["attempt"] == 3 and status["failures"][-1]["exitCode"] == 2


@pytest.mark.parametrize("spec, where", [
    ({"gpusPerNode": 8, "trainer": {"checkpoint": {"dir": "/ckpt/"}}}, "/ckpt/debug/attempt-0"),
    ({"gpusPerNode": 0, "trainer": {"checkpoint": {"dir": "/ckpt"}}}, None),   # gloo: no flight recorder
    ({"gpusPerNode": 8, "trainer": {}}, None),                                 # no volume that outlives the pod
    ({"gpusPerNode": 8, "command": ["torchrun", "train.py"]}, None),           # a user's script: its own
])
def test_a_failed_gpu_attempt_names_where_its_flight_recorder_dumps_are(spec, where):
    status, _ = pass_status(make_job(nodes=2, **spec), Group.of([killed(0, 1), make_pod(1)]), now=NOW,
                            prev_status=running_status())
    assert status["failures"][0].get("debugDir") == where


def test_evidence_ignores_other_attempts_and_clean_exits():
    pods = [killed(0, 1, attempt=1), make_pod(1, phase="Succeeded", exit_code=0), killed(2, 143, signal=15)]
    assert [(e["pod"], e.get("signal")) for e in failure_evidence(Group.of(pods).at(0))] == [("j-2", 15)]
    assert len(failure_evidence(Group.of(pods).at(1))) == 1


def test_split_creates_keeps_refusals_and_raises_the_rest():
    from kubernetes.client.rest import ApiException

    from ddpjob_operator.app.children import split_creates

    def api_error(code, body):
        exc = ApiException(status=code, reason="x")
        exc.body = body
        return exc

    pods = [make_pod(r) for r in range(3)]
    created, refused = split_creates(pods, [{"kind": "Pod"}, api_error(422, INVALID), None])
    assert created == [{"kind": "Pod"}, None] and [(r.pod, r.code) for r in refused] == [("j-1", 422)]
    with pytest.raises(ApiException):
        split_creates(pods, [api_error(500, "{}"), api_error(422, INVALID), None])
    with pytest.raises(ConnectionError):
        split_creates(pods[:1], [ConnectionError("reset")])


@pytest.mark.parametrize("pod_path,job_path", [
    ("spec.containers[0].volumeMounts[1].name", "spec.volumeMounts[0].name"),
    ("spec.volumes[2].persistentVolumeClaim", "spec.volumes[1].persistentVolumeClaim"),
    ("spec.containers[0].env[{user}].name", "spec.env[0].name"),         # the user's come after ours
    ("spec.containers[0].resources.limits", "spec.resources.limits"),
    ("spec.securityContext.fsGroup", "spec.podSecurityContext.fsGroup"),
    ("spec.containers[0].securityContext.runAsUser", "spec.securityContext.runAsUser"),
    ("spec.tolerations[0].operator", "spec.scheduling.tolerations[0].operator"),
    ("metadata.labels", "spec.podLabels"),
    ("spec.containers[0].env[3].name", None),                              # MASTER_ADDR & co: ours
    ("spec.volumes[0].emptyDir.sizeLimit", None),                          # /dev/shm (spec.shmSize)
    ("spec.hostname", None),
])
def test_pod_error_paths_name_the_ddpjob_field(pod_path, job_path):
    from ddpjob_operator.builders.pods import job_field, render_pod

    job = make_job(nodes=2, env=[{"name": "A", "value": "1"}])
    user = len(render_pod(job, 0)["spec"]["containers"][0]["env"]) - 1  # the one spec.env variable is the last
    assert job_field(pod_path.format(user=user), job) == job_path


def test_refused_create_names_the_ddpjob_field():
    job = make_job(nodes=1, volumeMounts=[{"name": "data", "mountPath": "/data"}])
    body = json.dumps({"reason": "Invalid", "code": 422, "message": 'Pod "j-0" is invalid: '
                       'spec.containers[0].volumeMounts[1].name: Not found: "data"'})
    status, _ = pass_status(job, Group.of([]), now=NOW, prev_status=None)
    new, _ = create_refused(job, status, [refusal("j-0", 422, body)], now=NOW)
    assert ('spec.containers[0].volumeMounts[1].name (DDPJob spec.volumeMounts[0].name): Not found: "data"'
            in new["message"])


PSA = ('pods "j-0" is forbidden: violates PodSecurity "restricted:latest": unrestricted capabilities '
       '(container "trainer" must not include "IPC_LOCK" in securityContext.capabilities.add)')


@pytest.mark.parametrize("fields,named", [
    ({"rdma": {"resource": "rdma/ib"}}, "spec.rdma (the IPC_LOCK capability it adds)"),
    ({"template": {"spec": {"hostNetwork": True}}}, "spec.template.spec.hostNetwork"),
    ({}, None),                                    # the job's own securityContext: the refusal names it
])
def test_a_pod_security_refusal_names_the_jobs_fields_that_need_privileged(fields, named):
    from ddpjob_operator.builders.pods import explain_pod_error

    text = explain_pod_error(PSA, make_job(nodes=1, **fields))
    if named is None:
        assert text == PSA
    else:
        assert text.startswith(PSA) and f"{named} needs Pod Security level privileged" in text, text
    # Only after a Pod Security refusal.
    assert "privileged" not in explain_pod_error("Pod is invalid: spec.containers[0].image: Required value",
                                                 make_job(nodes=1, **fields))
