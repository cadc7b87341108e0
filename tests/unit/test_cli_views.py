"""The cluster commands' builders (cli/ddpjob_cli/views.py): plain data in, rows and text out."""
from __future__ import annotations

import json

import pytest

from ddpjob_api.phases import Phase
from ddpjob_cli import views
from tests.support.builders import NOW, ago, make_manifest, make_pod, running_status


def job_with(status=None, name="j", namespace="ns", **spec):
    job = make_manifest(name, namespace=namespace, **spec)
    job["metadata"]["creationTimestamp"] = ago(250)
    if status is not None:
        job["status"] = status
    return job


def placed(pod, node):
    pod["spec"] = {"nodeName": node, "containers": [{"name": "trainer"}]}
    return pod


# --- list / get -------------------------------------------------------------------------------------

def test_list_rows_show_phase_progress_loss_rate_restarts_age():
    running = job_with(running_status(restarts=2, nodes={"ready": "2/2"},
                                      progress={"display": "42% (420/1000)", "loss": 0.41234567,
                                                "samplesPerSecond": 812.46, "eta": "4m10s"},
                                      goodput={"display": "83%"}), name="b")
    pending = job_with(None, name="a")
    headers, rows = views.list_rows([running, pending], NOW)
    assert headers == ["NAME", "PHASE", "READY", "PROGRESS", "LOSS", "SAMPLES/S", "RESTARTS", "GOODPUT", "AGE"]
    assert rows == [["a", "Pending", "-", "-", "-", "-", "0", "-", "4m10s"],
                    ["b", "Running", "2/2", "42% (420/1000)", "0.4123", "812.5", "2", "83%", "4m10s"]]


@pytest.mark.parametrize("wide, all_ns, first, extra", [
    (False, True, "NAMESPACE", []),
    (True, False, "NAME", ["ETA", "ATTEMPT", "ACCURACY", "REASON"]),
])
def test_list_rows_wide_and_all_namespaces(wide, all_ns, first, extra):
    job = job_with(running_status(progress={"eta": "1m"}, reason="Running"))
    headers, rows = views.list_rows([job], NOW, wide=wide, all_namespaces=all_ns)
    assert headers[0] == first
    if extra:
        assert headers[-len(extra):] == extra
    assert len(rows[0]) == len(headers)
    if all_ns:
        assert rows[0][0] == "ns"
    if wide:
        assert rows[0][-4:] == ["1m", "0", "-", "Running"]


def test_table_pads_columns_like_kubectl():
    assert views.table(["A", "LONGER"], [["xyz", "1"]]) == "A     LONGER\nxyz   1\n"


def test_dump_json_and_yaml_round_trip():
    obj = views.as_list([job_with()])
    assert json.loads(views.dump(obj, "json")) == obj
    import yaml
    assert yaml.safe_load(views.dump(obj, "yaml")) == obj


# --- per-rank rows ------------------------------------------------------------------------------------

def test_rank_rows_take_the_current_attempt_and_show_missing_ranks():
    job = job_with(running_status(attempt=1), nodes=3)
    pods = [placed(make_pod(0, attempt=1), "n0"), placed(make_pod(1, attempt=0, phase="Failed", exit_code=1), "n1"),
            placed(make_pod(2, attempt=1, phase="Failed", exit_code=137), "n2")]
    rows = views.rank_rows(job, pods)
    assert [(r.rank, r.pod, r.node, r.phase, r.exit_code) for r in rows] == [
        (0, "j-0-a1", "n0", "Running", None), (1, "", "", "-", None), (2, "j-2-a1", "n2", "Failed", 137)]


def test_rank_rows_flag_the_pods_a_straggler_condition_names():
    cond = {"type": "Straggler", "status": "True", "reason": "SlowRank",
            "message": "straggling: rank 1 (pod j-1 on node n1) (2.0x the median 100ms per step)"}
    job = job_with(running_status(conditions=[cond]))
    rows = views.rank_rows(job, [placed(make_pod(0), "n0"), placed(make_pod(1), "n1")])
    assert [r.flags for r in rows] == [(), ("straggler",)]
    recovered = job_with(running_status(conditions=[dict(cond, status="False")]))
    assert all(not r.flags for r in views.rank_rows(recovered, [make_pod(0), make_pod(1)]))


def test_top_text_marks_and_colours_the_straggler():
    cond = {"type": "Straggler", "status": "True", "message": "straggling: rank 1 (pod j-1 on node n1)"}
    job = job_with(running_status(conditions=[cond], progress={"step": 5, "totalSteps": 10, "percent": 50}))
    pods = [placed(make_pod(0), "n0"), placed(make_pod(1), "n1")]
    plain = views.top_text(job, pods, NOW)
    assert "step 5/10 (50%)" in plain and "Straggler: straggling: rank 1" in plain
    line = next(ln for ln in plain.splitlines() if ln.startswith("1 "))
    assert line.endswith("straggler") and "\x1b[" not in plain
    coloured = views.top_text(job, pods, NOW, color=True)
    assert any(ln.startswith("\x1b[") and "j-1" in ln for ln in coloured.splitlines())


# --- describe -----------------------------------------------------------------------------------------

def test_describe_shows_spec_conditions_ranks_failures_and_only_this_jobs_events():
    status = running_status(attempt=1, restarts=1, countedRestarts=1, reason="Running", masterAddr="j-0.j.ns.svc",
                            conditions=[{"type": "Running", "status": "True", "reason": "Running",
                                         "message": "all 2 pods running", "lastTransitionTime": ago(60)}],
                            failures=[{"attempt": 0, "rank": 1, "pod": "j-1", "node": "n1", "exitCode": 137,
                                       "signal": 9, "reason": "OOMKilled", "logTail": "step 3\nKilled\n"}])
    status["mlflow"] = {"runId": "abc123", "experimentId": "7", "url": "http://mlf/#/experiments/7/runs/abc123"}
    job = job_with(status, trainer={"dataset": "digits", "model": "convnet",
                                    "mlflow": {"trackingUri": "http://u:pw@mlf", "experiment": "vision"}},
                   failurePolicy={"maxRestarts": 2})
    job["metadata"]["uid"] = "uid-j"
    pods = [placed(make_pod(0, attempt=1), "n0"), placed(make_pod(1, attempt=1), "n3")]
    events = [{"type": "Warning", "reason": "Restarting", "message": "restarting all 2 node(s)",
               "involvedObject": {"kind": "DDPJob", "name": "j", "uid": "uid-j"}, "lastTimestamp": ago(90)},
              {"type": "Normal", "reason": "Scheduled", "message": "assigned",
               "involvedObject": {"kind": "Pod", "name": "j-0-a1"}, "lastTimestamp": ago(80)},
              {"type": "Normal", "reason": "Created", "message": "someone else's",
               "involvedObject": {"kind": "DDPJob", "name": "other"}, "lastTimestamp": ago(10)}]
    data = views.describe_data(job, events, pods, NOW)
    assert data["spec"]["Trainer"].startswith("built-in (dataset digits, model convnet")
    assert data["spec"]["MLflow"] == "http://mlf, experiment vision" and data["maxRestarts"] == 2
    assert [e["reason"] for e in data["events"]] == ["Restarting", "Scheduled"]
    text = views.describe_text(data, NOW)
    assert "Restarts:             1 (1/2 of the budget)" in text
    assert "MLflow run:           abc123 http://mlf/#/experiments/7/runs/abc123" in text and "pw" not in text
    assert "Running   True     Running   1m00s   all 2 pods running" in text
    assert "j-1-a1   n3" in text                                    # the current attempt's rank 1
    failure = next(ln for ln in text.splitlines() if "OOMKilled" in ln)
    assert "137 (signal 9)" in failure and failure.rstrip().endswith("Killed")
    assert "someone else's" not in text
    assert json.loads(views.dump(data, "json"))["ranks"][1]["node"] == "n3"


def test_describe_of_a_new_job_says_none_where_nothing_is_known():
    text = views.describe_text(views.describe_data(job_with(None, nodes=1, command=["python", "t.py"]), [], [], NOW), NOW)
    assert "Phase:                Pending" in text and "Command:            python t.py" in text
    assert text.count("<none>") == 3   # conditions, failures, events; the rank row shows '-'


# --- wait ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("phase, want, code", [
    ("Succeeded", {Phase.SUCCEEDED}, 0),
    ("Running", {Phase.RUNNING}, 0),
    ("Running", {Phase.SUCCEEDED}, None),
    ("Restarting", {Phase.SUCCEEDED}, None),
    ("Suspended", {Phase.SUCCEEDED}, None),
    (None, {Phase.SUCCEEDED}, None),
    (None, {Phase.PENDING}, 0),
    ("Failed", {Phase.SUCCEEDED}, 1),
    ("Succeeded", {Phase.RUNNING}, 1),
    ("Failed", {Phase.FAILED, Phase.SUCCEEDED}, 0),
])
def test_wait_outcome(phase, want, code):
    status = {"phase": phase, "reason": "RestartLimit", "message": "rank 1 exited 1"} if phase else None
    outcome = views.wait_outcome(job_with(status), want)
    assert (outcome.code if outcome else None) == code
    if code == 1:
        assert f"j is {phase}" in outcome.message
        if phase == "Failed":
            assert "RestartLimit: rank 1 exited 1" in outcome.message


def test_wait_outcome_of_a_deleted_job_is_an_end():
    assert views.wait_outcome(None, {Phase.SUCCEEDED}, name="gone") == views.Outcome(1, "DDPJob gone was deleted")


# --- logs -----------------------------------------------------------------------------------------------

def test_log_pods_default_to_rank_0_of_the_current_attempt():
    job = job_with(running_status(attempt=2))
    pods = [make_pod(1, attempt=2), make_pod(0, attempt=2), make_pod(0, attempt=1, phase="Failed", exit_code=1)]
    assert views.log_pods(job, pods, rank=None, all_ranks=False, attempt=None) == [(0, "j-0-a2")]
    assert views.log_pods(job, pods, rank=1, all_ranks=False, attempt=None) == [(1, "j-1-a2")]
    assert views.log_pods(job, pods, rank=None, all_ranks=True, attempt=None) == [(0, "j-0-a2"), (1, "j-1-a2")]
    assert views.log_pods(job, pods, rank=None, all_ranks=True, attempt=1) == [(0, "j-0-a1")]
    assert views.log_pods(job, pods, rank=5, all_ranks=False, attempt=None) == []
    assert views.prefixed(3, "loss 0.1") == "[rank 3] loss 0.1"


@pytest.mark.parametrize("rank, all_ranks, attempt, every", [
    (None, False, None, False),   # rank 0 of the current attempt
    (None, False, 2, False),      # the current attempt named
    (None, False, 1, True),       # an earlier attempt: every rank it kept, prefixed
    (1, False, 1, False),         # ... unless one rank is asked for
    (None, True, None, True),
])
def test_logs_of_an_earlier_attempt_show_every_kept_rank(rank, all_ranks, attempt, every):
    job = job_with(running_status(attempt=2))
    assert views.every_rank(job, [], rank=rank, all_ranks=all_ranks, attempt=attempt) is every


POD_LOG = ["==> ddpjob: attempt 1 restart 0 <==", "step 1", "step 2", "Killed",
           "==> ddpjob: attempt 1 restart 1 <==", "resumed at step 2", "step 3",
           "==> ddpjob: attempt 1 restart 2 <==", "step 4"]


@pytest.mark.parametrize("restart, lines", [
    (0, POD_LOG[0:4]),
    (1, POD_LOG[4:7]),
    (2, POD_LOG[7:]),
    (3, []),  # a restart that has not happened (yet)
])
def test_a_restart_in_place_is_read_out_of_the_pods_log_between_markers(restart, lines):
    from ddpjob_api import contract

    assert POD_LOG[4] == contract.inplace_marker(1, 1)  # the launcher's own format
    assert list(views.restart_lines(iter(POD_LOG), restart)) == lines


# --- errors -----------------------------------------------------------------------------------------------

def status_body(code, reason, message, details=None):
    return json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                       "reason": reason, "code": code, "details": details or {}})


@pytest.mark.parametrize("code, body, expect, missing", [
    (404, status_body(404, "NotFound", 'ddpjobs.ddpjob.dev "x" not found', {"name": "x", "group": "ddpjob.dev",
                                                                             "kind": "ddpjobs"}),
     'DDPJob "x" not found in namespace ns: `ddpjob list -n ns`', True),
    (404, "404 page not found\n", "is not installed on this cluster: install the operator", False),
    (404, status_body(404, "NotFound", "the server could not find the requested resource"),
     "is not installed on this cluster", False),
    (403, status_body(403, "Forbidden", 'ddpjobs.ddpjob.dev is forbidden: User "u" cannot list resource "ddpjobs"'),
     'forbidden: ddpjobs.ddpjob.dev is forbidden: User "u" cannot list', False),
    (401, status_body(401, "Unauthorized", "Unauthorized"), "unauthorized", False),
    (409, status_body(409, "AlreadyExists", 'ddpjobs.ddpjob.dev "x" already exists'),
     'already exists: delete it first (ddpjob delete x)', False),
    (422, status_body(422, "Invalid", "spec.nodes: Invalid value: 0"), "refused the DDPJob: spec.nodes", False),
    (400, status_body(400, "BadRequest", 'container "trainer" in pod "j-0" is waiting to start: ContainerCreating'),
     'container "trainer" in pod "j-0" is waiting to start', False),
    (500, "boom", "answered 500", False),
])
def test_api_errors_are_one_line_saying_what_to_do(code, body, expect, missing):
    text = views.api_error(code, body, name="x", namespace="ns", verb="list")
    assert expect in text and "\n" not in text
    assert views.missing_object(code, body) is missing


def test_top_live_adds_each_process_own_numbers_and_flags_the_named_rank():
    from ddpjob_operator.decisions.samples import parse_metrics

    text = "".join(
        f'ddpjob_trainer_{m}{{rank="{r}",local_rank="{r % 2}",node_rank="{r // 2}"{extra}}} {v}\n'
        for r in range(4)
        for m, v, extra in (("step", 10 + r, ""), ("samples_total", 640, ""), ("step_seconds_sum", 2.0 * (1 + (r == 3)), ""),
                            ("step_seconds_count", 10, ""), ("data_wait_seconds_total", 0.5, ""), ("loss", 0.25, ""),
                            ("gpu_memory_allocated_bytes", 2**31, ""), ("stage", 1, ',stage="training"')))
    samples = parse_metrics(text)
    for s in samples.values():
        s.pod = f"j-{s.node_rank}"
    cond = {"type": "Straggler", "status": "True", "message": "straggling: rank 3 (pod j-1 on node n1) (2.0x)"}
    job = job_with(running_status(conditions=[cond]))
    rows = views.process_rows(job, samples)
    assert [cells for cells, _ in rows][3] == ["3", "1", "j-1", "training", "13", "0.25", "160.0", "400.0", "50.0",
                                               "2.00", "straggler"]
    assert [flagged for _, flagged in rows] == [False, False, False, True]
    screen = views.top_text(job, [placed(make_pod(0), "n0"), placed(make_pod(1), "n1")], NOW, samples=samples,
                            notes=["rank 1: no metrics (boom)"])
    assert "DATA WAIT MS" in screen and screen.rstrip().endswith("rank 1: no metrics (boom)")
    assert "no process reported metrics yet" in views.top_text(job, [], NOW, samples={})
    # describe --live: the same numbers under the per-rank table, as data and as text.
    data = views.describe_data(job, [], [placed(make_pod(0), "n0"), placed(make_pod(1), "n1")], NOW, samples=samples,
                               notes=["rank 1: no metrics (boom)"])
    assert data["processes"][3] == dict(zip(views.PROCESS_HEADERS, [cells for cells, _ in rows][3]))
    text = views.describe_text(data, NOW)
    live = text.split("Processes (live):\n")[1].split("Failures (earlier attempts):")[0].splitlines()
    assert live[0].split() == ["RANK", "NODE", "RANK", "POD", "STAGE", "STEP", "LOSS", "SAMPLES/S", "STEP", "MS", "DATA",
                               "WAIT", "MS", "GPU", "MEM", "GiB", "FLAGS"]
    assert live[4].split() == ["3", "1", "j-1", "training", "13", "0.25", "160.0", "400.0", "50.0", "2.00", "straggler"]
    assert live[-1] == "  rank 1: no metrics (boom)"
    # Without --live, nothing is read and nothing is said.
    plain = views.describe_data(job, [], [], NOW)
    assert "processes" not in plain and "Processes (live)" not in views.describe_text(plain, NOW)


def test_progress_line_says_why_progress_is_unavailable():
    assert views.progress_line({"step": 4, "totalSteps": 8, "percent": 50.0, "loss": 0.5}) == \
        "step 4/8 (50%), loss 0.5"
    assert views.progress_line({"unavailable": "2 pod(s) on simulated (kwok) nodes"}) == \
        "unavailable: 2 pod(s) on simulated (kwok) nodes"


def test_the_wait_bar_follows_the_step_back_after_a_restart(capsys):
    from ddpjob_cli.jobs import _Bar

    bar = _Bar(True, "j")
    for step in (7, 12, 4):
        bar.update(job_with(running_status(progress={"step": step, "totalSteps": 20, "loss": 0.5})))
    assert (bar.bar.n, bar.bar.total) == (4, 20)
    bar.close()
    assert "4/20" in capsys.readouterr().out


def test_kept_tails_of_an_attempt_whose_pods_are_gone():
    failures = [{"attempt": 0, "rank": 1, "logTail": "step 3\nRuntimeError: boom"}, {"attempt": 0, "rank": 0},
                {"attempt": 1, "rank": 0, "logTail": "later"}]
    job = job_with(running_status(attempt=2, failures=failures))
    assert views.kept_tails(job, attempt=0, rank=None, all_ranks=False) == [(1, "step 3\nRuntimeError: boom")]
    assert views.kept_tails(job, attempt=0, rank=0, all_ranks=False) == []
    assert views.kept_tails(job, attempt=1, rank=None, all_ranks=True) == [(0, "later")]


def test_describe_and_top_show_where_the_time_went():
    from ddpjob_operator.decisions.goodput import Observed, advance

    t0 = NOW.timestamp() - 250
    ledger = advance(None, Observed(now=t0 + 250, created=t0, scheduled_at=t0 + 10, stepped_at=t0 + 50,
                                    ranks={"checkpointing": 12.0}))
    job = job_with(running_status(goodput=ledger))
    data = views.describe_data(job, [], [], NOW)
    assert "accounting" not in data["goodput"] and data["goodput"]["seconds"]["queued"] == 10
    line = next(ln for ln in views.describe_text(data, NOW).splitlines() if ln.startswith("Goodput:"))
    assert line.endswith("75% training of 4m10s: queued 10s, starting 40s, training 3m08s, checkpointing 12s"), line
    assert "goodput 75% training of 4m10s: queued 10s" in views.top_text(job, [], NOW)
    assert "Goodput" not in views.describe_text(views.describe_data(job_with(running_status()), [], [], NOW), NOW)
