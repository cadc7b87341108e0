"""When a status write is due, and when a scrape holds anything a pass must write (pure).

A running job's pods are scraped every scrape interval, but its status is not rewritten per scrape:
progress (and the wording of the monitor's conditions, which quotes the latest step) is written at
most once per progress interval, while a change of phase, of a condition's status or reason, an
event, or anything a user acts on is written in the pass that sees it, carrying the freshest
progress along.

While an attempt's pods come up (phase Pending or Restarting) its node counts change with every pod
that is scheduled or starts: they are not written on their own at all, only carried by the next
write that is due for another reason (all Running, a condition such as Unschedulable, a failure).
A job coming up thus costs two writes, the attempt created and all Running: at 1,000 jobs x 10
pods one per node-count change was 10 per job, half of the operator's requests
(bench/results/operator_scale_1000x10_ours_floor_pair.json). `kubectl get pods -l
ddpjob.dev/job-name=<job>` shows the counts meanwhile.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpjob_api.phases import Phase, Reason, Signal
from ddpjob_api.spec import JobSpec
from ddpjob_operator.builders import gang, kueue
from ddpjob_operator.decisions.progress import UNAVAILABLE

if TYPE_CHECKING:
    from ddpjob_operator.decisions.lifecycle import Decision

# Status fields that only mirror pods (nobody acts on them): their changes may wait and coalesce.
QUIET_FIELDS = frozenset({"nodes", "launchedAttempt"})
# Phases in which the current attempt's pods come up: QUIET_FIELDS ride along with the write that
# ends them (or any other that is due), never written alone.
COMING_UP = frozenset({Phase.PENDING.value, Phase.RESTARTING.value})
# Fields that change with every scrape of a training job: written at the progress interval.
PROGRESS_FIELDS = frozenset({"progress"})
# Progress yields to come-ups: every PROGRESS_YIELD_JOBS jobs whose pods come up (or that have no
# status yet) stretch the progress interval by one interval more, up to PROGRESS_YIELD_MAX times it.
# At 1,000 jobs of 10, the custom-resource status writes were 16 % of kube-apiserver's CPU while the
# pods were created and started, and 3 in 5 of them were the progress of jobs already Running
# (bench/results/operator_scale_1000x10_apiserver_profile.json), beside the pod creates and bindings
# the jobs still coming up wait for. A few jobs starting change nothing; a burst of hundreds has
# the running jobs' progress written at a quarter of the rate until it is up.
PROGRESS_YIELD_JOBS = 100
PROGRESS_YIELD_MAX = 4.0
# Fields that change with every pass, as time goes by (the goodput ledger): they never ask for a
# write of their own, and go along with any other (a ledger not written is accounted by a later
# one all the same: decisions/goodput.py).
RIDE_ALONG = frozenset({"goodput"})
# The monitor's conditions: a change of status or reason is material; of message (which names the
# latest step, or how far behind a straggler is) it is progress.
MONITOR_CONDITIONS = (Signal.STRAGGLER, Signal.STALLED)


def _condition_key(cond: dict[str, Any]) -> tuple:
    """What of a condition counts as a change worth a write of its own."""
    if cond.get("type") in MONITOR_CONDITIONS:
        return (cond.get("type"), cond.get("status"), cond.get("reason"))
    return tuple(sorted((k, str(v)) for k, v in cond.items()))


def _conditions_changed(prev: list[dict[str, Any]] | None, new: list[dict[str, Any]] | None) -> bool:
    return sorted(map(_condition_key, prev or []), key=str) != sorted(map(_condition_key, new or []), key=str)


def _progress_kind(progress: dict[str, Any] | None) -> str:
    """'none', 'unavailable' or 'steps': a change of kind is news, a new step is progress."""
    progress = progress or {}
    if progress.get("step") is not None:
        return "steps"
    return UNAVAILABLE if progress.get(UNAVAILABLE) else "none"


def changed_fields(prev: dict[str, Any], status: dict[str, Any]) -> set[str]:
    """Top-level status fields that differ, but those that only ride along (RIDE_ALONG)."""
    return {k for k in set(prev) | set(status) if prev.get(k) != status.get(k)} - RIDE_ALONG


def settled(prev: dict[str, Any], status: dict[str, Any]) -> bool:
    """True when there is nothing to write: only fields that ride along changed, if anything."""
    return not changed_fields(prev, status)


def urgent(prev: dict[str, Any], status: dict[str, Any], *, events: int) -> bool:
    """True when the write must happen in this pass: it announces a transition (`events`) or
    changes what users or the pods act on (the attempt and counters the pods carry are among them,
    so they are stored before the pods they describe are created or deleted). Progress, node
    counts and the monitor conditions' wording wait."""
    if events:
        return True
    for key in changed_fields(prev, status) - QUIET_FIELDS - PROGRESS_FIELDS:
        if key != "conditions" or _conditions_changed(prev.get(key), status.get(key)):
            return True
    return _progress_kind(prev.get("progress")) != _progress_kind(status.get("progress"))


def write_wait(prev: dict[str, Any], status: dict[str, Any], *, since_write: float, coalesce: float,
               progress_interval: float) -> float | None:
    """Seconds until a write that is not urgent is due (0: now), or None when it is not due by
    itself (node counts while the pods come up: the next write that is due carries them). Node
    counts of a running or finished job wait `coalesce` seconds after the last write; progress
    alone waits `progress_interval`."""
    changed = changed_fields(prev, status)
    if status.get("phase") in COMING_UP:
        changed -= QUIET_FIELDS
        if not changed:
            return None
    quiet = bool(changed & QUIET_FIELDS)
    return max(0.0, (coalesce if quiet else progress_interval) - since_write)


def yield_factor(coming_up: int) -> float:
    """How much longer what can wait waits while `coming_up` jobs' pods come up: 1 more for every
    PROGRESS_YIELD_JOBS of them, at most PROGRESS_YIELD_MAX."""
    return min(PROGRESS_YIELD_MAX, 1.0 + coming_up / PROGRESS_YIELD_JOBS)


def quiet_come_up(job: JobSpec, d: Decision, *, refused: bool) -> bool:
    """After this pass, the job's pods may come up without a pass each: its first attempt waits for
    its pods to start (Pending, Created: nothing refused, failing, unschedulable or restarting),
    and neither a gang scheduler, Kueue, a Lighthouse nor an elastic size adds a condition of its
    own meanwhile. Such a pass while the pods move plainly (podinfo.plain_progress) only finds node
    counts to carry, writes nothing and acts on nothing: at 1,000 jobs x 10 pods ours ran 6 to 8
    passes a job (bench/results/operator_scale_1000x10_ours_floor_svc_3pairs_5529768.json). The
    next pass is then the one all Running asks for, or one any other move asks for."""
    return (d.phase is Phase.PENDING and d.reason == Reason.CREATED and d.attempt == 0 and not refused
            and d.restarted is None and not d.start_errors and d.unschedulable is None and not d.delete_pods
            and not d.create_lighthouse and d.lighthouse_ready is None and job.spec.elastic is None
            and gang.api_of(job) is None and kueue.queue_name(job) is None)


def progress_interval_now(interval: float, coming_up: int) -> float:
    """The progress interval while `coming_up` jobs' pods come up (PROGRESS_YIELD_JOBS)."""
    return interval * yield_factor(coming_up)


def scrape_needs_pass(prev: dict[str, Any], *, progress: dict[str, Any] | None, conditions: list[dict[str, Any]],
                      events: int, mlflow_run: tuple[str, str] | None, progress_due: bool) -> bool:
    """True when a scrape found something a pass must write now: an event, a condition of the
    monitor's that changes status or reason, a first MLflow run, the first progress (or progress
    becoming unavailable), or new progress once `progress_due`. Otherwise the scrape costs no pass."""
    if events:
        return True
    old = {c.get("type"): c for c in prev.get("conditions") or []}
    for cond in conditions:
        was = old.get(cond.get("type"))
        if was is None or (was.get("status"), was.get("reason")) != (cond.get("status"), cond.get("reason")):
            return True
    if mlflow_run is not None and (prev.get("mlflow") or {}).get("runId") != mlflow_run[0]:
        return True
    if not progress:
        return False
    before = prev.get("progress") or {}
    if _progress_kind(before) != _progress_kind({**before, **progress}):
        return True
    return progress_due and any(before.get(k) != v for k, v in progress.items())
