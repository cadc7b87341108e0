"""ddpjob_operator_* metrics: namespace (and ddpjob) labels, counters born at 0, per-job gauges."""
from __future__ import annotations

import random
import tracemalloc

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions.lifecycle import decide
from ddpjob_operator.app.operator_metrics import (FAILURE_REASONS, RECOVERY_KINDS, RESTART_REASONS,
                                                 STEPS_LOST_BUCKETS, JobGauge, OperatorMetrics)
from ddpjob_api.phases import Phase
from tests.support.builders import NOW, make_job, make_pod, running_status

KEY = ("team-a", "mnist")


def value(m: OperatorMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_counters_are_born_at_zero_for_every_reason_of_a_configured_namespace():
    m = OperatorMetrics(CollectorRegistry(), namespaces=["team-a"])
    for reason in FAILURE_REASONS:
        assert value(m, "ddpjob_operator_jobs_failed_total", namespace="team-a", reason=reason) == 0
    for reason in RESTART_REASONS:
        assert value(m, "ddpjob_operator_jobs_restarted_total", namespace="team-a", reason=reason) == 0
    for name in ("jobs_created", "jobs_succeeded", "pods_created", "pods_deleted"):
        assert value(m, f"ddpjob_operator_{name}_total", namespace="team-a") == 0
    assert value(m, "ddpjob_operator_jobs", namespace="team-a", phase="Failed") == 0
    assert {"ImagePullBackOff", "FailedCreatePod", "RestartLimitExceeded"} <= set(FAILURE_REASONS)


def test_a_new_namespace_gets_its_zero_series_on_first_sight():
    m = OperatorMetrics(CollectorRegistry())
    assert value(m, "ddpjob_operator_jobs_failed_total", namespace="team-b", reason="PodFailed") is None
    m.record_pass(("team-b", "j"), prev_status={}, status={"phase": "Pending"})
    assert value(m, "ddpjob_operator_jobs_failed_total", namespace="team-b", reason="DeadlineExceeded") == 0
    assert value(m, "ddpjob_operator_jobs_created_total", namespace="team-b") == 1
    assert value(m, "ddpjob_operator_jobs", namespace="team-b", phase="Pending") == 1


def test_a_pass_counts_transitions_once():
    m = OperatorMetrics(CollectorRegistry())
    m.record_pass(KEY, prev_status={}, status={"phase": "Pending"})
    m.record_pass(KEY, prev_status={"phase": "Pending"}, status={"phase": "Running"})
    m.record_pass(KEY, prev_status={"phase": "Running"}, status={"phase": "Restarting", "reason": "PodFailed"},
                  restarted="PodFailed")
    failed = {"phase": "Failed", "reason": "RestartLimitExceeded", "completionTime": "2026-11-22T12:00:00Z"}
    m.record_pass(KEY, prev_status={"phase": "Restarting"}, status=failed)
    m.record_pass(KEY, prev_status=failed, status=failed)                       # no double count
    assert value(m, "ddpjob_operator_jobs_created_total", namespace="team-a") == 1
    assert value(m, "ddpjob_operator_jobs_restarted_total", namespace="team-a", reason="PodFailed") == 1
    assert value(m, "ddpjob_operator_jobs_failed_total", namespace="team-a", reason="RestartLimitExceeded") == 1
    assert value(m, "ddpjob_operator_jobs", namespace="team-a", phase="Failed") == 1
    assert value(m, "ddpjob_operator_jobs", namespace="team-a", phase="Running") == 0
    assert value(m, "ddpjob_operator_job_failed_timestamp_seconds", namespace="team-a", ddpjob="mnist",
                 reason="RestartLimitExceeded") == 1795348800.0


def test_per_job_series_follow_the_spec_and_go_with_the_job():
    m = OperatorMetrics(CollectorRegistry())
    m.record_pass(KEY, prev_status={}, status={"phase": "Running"}, hang_timeout=120)
    assert value(m, "ddpjob_operator_job_hang_timeout_seconds", namespace="team-a", ddpjob="mnist") == 120
    m.record_pass(KEY, prev_status={"phase": "Running"}, status={"phase": "Running"})       # unset in the spec
    assert value(m, "ddpjob_operator_job_hang_timeout_seconds", namespace="team-a", ddpjob="mnist") is None
    m.record_pass(KEY, prev_status={"phase": "Running"}, status={"phase": "Failed", "reason": "PodFailed"},
                  hang_timeout=60)
    m.set_phase(KEY, None)                                                   # the DDPJob was deleted
    text = generate_latest(m.registry).decode()
    assert 'ddpjob="mnist"' not in text
    assert value(m, "ddpjob_operator_jobs", namespace="team-a", phase="Failed") == 0


def test_pending_since_is_the_jobs_start_and_goes_when_it_runs(monkeypatch):
    """The DDPJobPendingTooLong alert's series: status.startTime while Pending (so an operator restart
    keeps it), gone when the job runs or is deleted, the resume time when resumed."""
    m = OperatorMetrics(CollectorRegistry())
    labels = {"namespace": "team-a", "ddpjob": "mnist"}
    name = "ddpjob_operator_job_pending_since_timestamp_seconds"
    m.record_pass(KEY, prev_status={}, status={"phase": "Pending", "startTime": "2026-01-01T00:00:00Z"})
    assert value(m, name, **labels) == 1767225600
    restarted = OperatorMetrics(CollectorRegistry())          # a new operator process: the same value
    restarted.record_pass(KEY, prev_status={"phase": "Pending"},
                          status={"phase": "Pending", "startTime": "2026-01-01T00:00:00Z"})
    assert value(restarted, name, **labels) == 1767225600
    m.record_pass(KEY, prev_status={"phase": "Pending"}, status={"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    assert value(m, name, **labels) is None
    m.record_pass(KEY, prev_status={"phase": "Suspended"},
                  status={"phase": "Pending", "reason": "Resumed", "startTime": "2026-01-01T01:00:00Z"})
    assert value(m, name, **labels) == 1767229200
    m.set_phase(KEY, None)
    assert value(m, name, **labels) is None


def test_pending_since_without_a_start_time_is_when_first_seen(monkeypatch):
    import ddpjob_operator.app.operator_metrics as om

    m = OperatorMetrics(CollectorRegistry())
    monkeypatch.setattr(om.time, "time", lambda: 1000.0)
    m.record_pass(KEY, prev_status={}, status={"phase": "Pending"})
    monkeypatch.setattr(om.time, "time", lambda: 1300.0)
    m.record_pass(KEY, prev_status={"phase": "Pending"}, status={"phase": "Pending"})
    assert value(m, "ddpjob_operator_job_pending_since_timestamp_seconds", namespace="team-a", ddpjob="mnist") == 1000


def test_a_job_waiting_in_a_kueue_queue_is_not_pending_too_long():
    """Kueue gates the pods on purpose (Admitted False, reason Queued): no series until admitted."""
    m = OperatorMetrics(CollectorRegistry())
    queued = {"type": "Admitted", "status": "False", "reason": "Queued"}
    m.record_pass(KEY, prev_status={}, status={"phase": "Pending", "startTime": "2026-01-01T00:00:00Z",
                                               "conditions": [queued]})
    name = "ddpjob_operator_job_pending_since_timestamp_seconds"
    assert value(m, name, namespace="team-a", ddpjob="mnist") is None
    admitted = {"type": "Admitted", "status": "True", "reason": "Admitted"}
    m.record_pass(KEY, prev_status={"phase": "Pending"}, status={
        "phase": "Pending", "startTime": "2026-01-01T00:30:00Z", "conditions": [admitted]})
    assert value(m, name, namespace="team-a", ddpjob="mnist") == 1767227400


def test_pods_counted_per_namespace():
    m = OperatorMetrics(CollectorRegistry())
    m.count_pods("team-a", created=4)
    m.count_pods("team-a", deleted=2)
    assert value(m, "ddpjob_operator_pods_created_total", namespace="team-a") == 4
    assert value(m, "ddpjob_operator_pods_deleted_total", namespace="team-a") == 2


def test_every_series_has_a_namespace_label_and_none_is_named_job():
    m = OperatorMetrics(CollectorRegistry(), namespaces=["n"])
    m.record_pass(("n", "j"), prev_status={}, status={"phase": "Running"}, hang_timeout=5)
    m.reconcile_seconds.observe(0.1)
    for metric in m.registry.collect():
        for sample in metric.samples:
            assert "job" not in sample.labels, sample
            if not sample.name.startswith(("ddpjob_operator_reconcile", "python_", "process_")):
                assert sample.labels.get("namespace") == "n", sample


@pytest.mark.parametrize("pod", [   # rank 0's: a lost pod of another rank is replaced alone
    make_pod(0, phase="Failed", exit_code=1),
    make_pod(0, phase="Failed", exit_code=137, evicted=True),
    make_pod(0, phase="Failed", exit_code=137, disruption="PreemptionByScheduler"),
    make_pod(0, phase="Failed", exit_code=137, disruption="DeletionByPodGC"),
    make_pod(0, phase="Failed", exit_code=137, reason="NodeLost"),
    make_pod(0, deleting=True),
], ids=["failed", "evicted", "preempted", "node-gone", "node-lost", "deleted"])
def test_every_restart_the_decisions_make_has_a_series_born_at_zero(pod):
    """The restart counter's series start at zero from the one list of reasons (RestartReason):
    `increase()` in the dashboards and alerts sees even the first restart of each kind."""
    d = decide(make_job(nodes=2), Group.of([pod, make_pod(1)]), now=NOW, prev_status=running_status())
    assert d.phase is Phase.RESTARTING, d
    m = OperatorMetrics(CollectorRegistry(), namespaces=["ns"])
    assert value(m, "ddpjob_operator_jobs_restarted_total", namespace="ns", reason=d.reason) == 0, d.reason


def test_recovery_histograms_are_born_at_zero_and_observe_each_recovery_once():
    m = OperatorMetrics(CollectorRegistry(), namespaces=["team-a"])
    assert RECOVERY_KINDS == ("InPlace", "Group", "Replace")
    for kind in RECOVERY_KINDS:
        assert value(m, "ddpjob_operator_recovery_seconds_count", namespace="team-a", kind=kind) == 0
        assert value(m, "ddpjob_operator_recovery_steps_lost_bucket", namespace="team-a", kind=kind, le="0.0") == 0
    failed = {"kind": "InPlace", "attempt": 0, "restart": 0, "rank": 1, "pod": "j-1", "failedAt": 1.0,
              "stepAtFailure": 47}
    prev = {"phase": "Running", "restartHistory": [failed]}
    now = {"phase": "Running", "restartHistory": [{**failed, "resumedFromStep": 40, "recoverySeconds": 4.5,
                                                  "stepsLost": 7}]}
    m.record_pass(KEY, prev_status=prev, status=now)
    m.record_pass(KEY, prev_status=now, status=now)                # the next scrape's pass: nothing new
    labels = {"namespace": "team-a", "kind": "InPlace"}
    restarted = OperatorMetrics(CollectorRegistry())               # a new operator process reads the same status
    restarted.record_pass(KEY, prev_status=now, status=now)
    assert value(restarted, "ddpjob_operator_recovery_seconds_count", **labels) == 0
    assert value(m, "ddpjob_operator_recovery_seconds_count", **labels) == 1
    assert value(m, "ddpjob_operator_recovery_seconds_sum", **labels) == 4.5
    assert value(m, "ddpjob_operator_recovery_seconds_bucket", **labels, le="5.0") == 1
    assert value(m, "ddpjob_operator_recovery_seconds_bucket", **labels, le="2.0") == 0
    assert value(m, "ddpjob_operator_recovery_steps_lost_sum", **labels) == 7
    assert value(m, "ddpjob_operator_recovery_steps_lost_bucket", **labels, le="10.0") == 1
    assert value(m, "ddpjob_operator_recovery_steps_lost_bucket", **labels, le="5.0") == 0
    assert value(m, "ddpjob_operator_recovery_seconds_count", namespace="team-a", kind="Group") == 0
    assert STEPS_LOST_BUCKETS[0] == 0  # "lost nothing" is a bucket of its own


def _exposition(steps: dict[int, int]) -> str:
    """What ranks' endpoints serve (the scrape parses it as the monitor does)."""
    return "".join(f'ddpjob_trainer_step{{ddpjob="mnist",namespace="team-a",rank="{r}"}} {s}\n'
                   for r, s in steps.items())


@pytest.mark.parametrize("steps, slowest, behind", [
    ({0: 10, 1: 10}, 0, 0),                       # a tie: the lowest rank
    ({0: 12, 1: 9, 2: 11}, 1, 3),
    ({r: 500 - (r == 201) * 7 for r in range(256)}, 201, 7),   # a 256-rank job: one series, not 256
])
def test_scrape_gauges_say_the_latest_scrape_and_the_rank_behind(steps, slowest, behind):
    from ddpjob_operator.decisions.progress import compute_progress
    from ddpjob_operator.decisions.samples import MonitorReport, parse_metrics

    m = OperatorMetrics(CollectorRegistry())
    ranks = parse_metrics(_exposition(steps))
    prog = compute_progress(ranks, now=100.0)
    m.record_scrape(KEY, MonitorReport(progress=prog, conditions=[], events=[], stalled=False, ranks=ranks), when=100.0)
    labels = {"namespace": "team-a", "ddpjob": "mnist"}
    assert value(m, "ddpjob_operator_job_step", **labels) == min(steps.values())
    assert value(m, "ddpjob_operator_job_slowest_rank", **labels) == slowest
    assert value(m, "ddpjob_operator_job_steps_behind", **labels) == behind
    assert value(m, "ddpjob_operator_job_ranks_reporting", **labels) == len(steps)
    assert value(m, "ddpjob_operator_job_scrape_timestamp_seconds", **labels) == 100.0
    assert value(m, "ddpjob_operator_job_samples_per_second", **labels) is None   # no rate from one scrape
    text = generate_latest(m.registry).decode()
    assert sum(line.startswith("ddpjob_operator_job_step{") for line in text.splitlines()) == 1
    # A scrape that read no rank keeps what the last one said (its timestamp ages).
    m.record_scrape(KEY, MonitorReport(progress=None, conditions=[], events=[], stalled=False), when=130.0)
    assert value(m, "ddpjob_operator_job_scrape_timestamp_seconds", **labels) == 100.0
    m.set_phase(KEY, None)                                   # the job is gone
    assert not [line for line in generate_latest(m.registry).decode().splitlines() if 'ddpjob="mnist"' in line]


def test_goodput_gauges_say_each_jobs_ledger_and_go_with_the_job():
    m = OperatorMetrics(CollectorRegistry())
    seconds = {c: 0.0 for c in ("queued", "starting", "checkpointing", "evaluating", "recovering", "recomputing",
                                "stalled", "suspended")}
    ledger = {"ratio": 0.8, "wallSeconds": 100.0, "seconds": {**seconds, "training": 80.0, "queued": 20.0}}
    m.record_pass(KEY, prev_status={}, status={"phase": "Running", "goodput": ledger})
    assert value(m, "ddpjob_operator_job_goodput_ratio", namespace=KEY[0], ddpjob=KEY[1]) == 0.8
    assert value(m, "ddpjob_operator_job_goodput_seconds", namespace=KEY[0], ddpjob=KEY[1], category="queued") == 20
    assert value(m, "ddpjob_operator_job_goodput_seconds", namespace=KEY[0], ddpjob=KEY[1], category="suspended") == 0
    m.set_phase(KEY, None)
    assert value(m, "ddpjob_operator_job_goodput_ratio", namespace=KEY[0], ddpjob=KEY[1]) is None
    assert value(m, "ddpjob_operator_job_goodput_seconds", namespace=KEY[0], ddpjob=KEY[1], category="queued") is None


def test_phase_counts_follow_each_change_of_many_jobs():
    """set_phase keeps its counts by the change (old phase down, new one up): after any sequence of
    passes and deletions over two namespaces, each (namespace, phase) series is the number of jobs
    there in that phase, and a deleted or never-seen job moves nothing."""
    m = OperatorMetrics(CollectorRegistry())
    rng = random.Random(48)
    phases = [p.value for p in Phase]
    now: dict[tuple[str, str], str] = {}
    for _ in range(2000):
        key = (rng.choice(["team-a", "team-b"]), f"j-{rng.randrange(30)}")
        phase = rng.choice(phases + [None])
        m.set_phase(key, phase)
        if phase is None:
            now.pop(key, None)
        else:
            now[key] = phase
    for ns in ("team-a", "team-b"):
        for phase in phases:
            want = sum(1 for (n, _), p in now.items() if (n, p) == (ns, phase))
            assert value(m, "ddpjob_operator_jobs", namespace=ns, phase=phase) == want, (ns, phase)


def test_a_job_gauge_serves_what_a_gauge_would_and_keeps_a_fraction_of_its_memory():

    def fill(kind, registry, jobs):
        g = kind("ddpjob_operator_job_x", "help", ["namespace", "ddpjob", "category"], registry=registry)
        for j in range(jobs):
            for c in ("queued", "training"):
                g.labels("ns", f"job-{j}", c).set(j + 0.5)
        g.remove("ns", "job-0", "queued")
        return g

    texts = []
    for kind in (Gauge, JobGauge):
        registry = CollectorRegistry()
        fill(kind, registry, 3)
        texts.append(generate_latest(registry))
    assert texts[0] == texts[1] and b'{category="training",ddpjob="job-1",namespace="ns"} 1.5' in texts[1]
    with pytest.raises(KeyError):
        fill(JobGauge, CollectorRegistry(), 1).remove("ns", "job-0", "queued")
    used = []
    for kind in (Gauge, JobGauge):
        tracemalloc.start()
        kept = fill(kind, CollectorRegistry(), 500)
        used.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
        del kept
    assert used[1] < used[0] / 3, used
