"""DDPJob status: computed in one place from the observed pods (pure)."""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from ddpjob_api import contract
from ddpjob_api.contract import public_uri
from ddpjob_api.names import lighthouse_name, master_dns
from ddpjob_api.phases import Cond, Phase, Reason, Recovery, Signal
from ddpjob_api.spec import JobSpec
from ddpjob_operator.base import podinfo
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.base.group import Attempt, Group
from ddpjob_operator.builders.gang import gang_state
from ddpjob_operator.builders.kueue import admission, queue_name
from ddpjob_operator.decisions import goodput, inplace
from ddpjob_operator.decisions.lifecycle import Decision, condition
from ddpjob_operator.decisions.progress import UNAVAILABLE, merge_scrape, stopped, succeeded, without_eta
from ddpjob_operator.base.objmeta import format_time
from ddpjob_operator.builders.pods import explain_pod_error
from ddpjob_operator.decisions.redact import redact
from ddpjob_operator.decisions.result import run_result
from ddpjob_operator.decisions.samples import MonitorReport

Event = tuple[str, str, str]  # (Normal|Warning, reason, message)


# API status codes of a create the API server refused for good: the pod spec itself is invalid
# (schema, admission). Anything else in 4xx (quota, PodSecurity, a namespace being deleted) may
# clear without a spec change: the job waits and the operator retries.
PERMANENT_REFUSALS = frozenset({400, 422})
# A pod name already taken by an object this job does not own: retried, as its owner may delete it.
NAME_CONFLICT = Reason.NAME_CONFLICT


@dataclass(frozen=True)
class CreateRefusal:
    """One pod create the API server answered with a 4xx (other than 409 AlreadyExists / 429), as
    app/children.py found it at the create; create_refused renders it."""

    pod: str           # the object's name (a pod's, or the job's Service's when kind is "service")
    code: int
    reason: str        # the API Status reason: Invalid, Forbidden, BadRequest, ...
    message: str       # the API's own message (names the field)
    kind: str = "pod"

    @property
    def permanent(self) -> bool:
        """True when only a different spec could be created."""
        return self.code in PERMANENT_REFUSALS


@dataclass
class Conditions:
    """A status' conditions as one pass rewrites them, each change at `now` for the job's generation."""

    items: list[dict[str, Any]]
    now: dt.datetime
    gen: int

    def true(self, type: str) -> dict[str, Any] | None:
        """The condition of this type, when it is True."""
        return condition({"conditions": self.items}, type)

    def set(self, type: str, status: bool, reason: str, message: str) -> None:
        """Upsert a metav1.Condition; lastTransitionTime moves only when status flips."""
        value = "True" if status else "False"
        for cond in self.items:
            if cond.get("type") == type:
                if cond.get("status") != value:
                    cond["lastTransitionTime"] = format_time(self.now)
                cond.update(status=value, reason=reason, message=message, observedGeneration=self.gen)
                return
        self.items.append({"type": type, "status": value, "reason": reason, "message": message,
                           "lastTransitionTime": format_time(self.now), "observedGeneration": self.gen})

    def clear(self, type: str, reason: str, message: str) -> None:
        """Set a condition False, but only if it was ever reported (no noise)."""
        if any(c.get("type") == type for c in self.items):
            self.set(type, False, reason, message)

    def hold(self, type: str, on: bool, reason: str, message: str, off: str, off_message: str) -> None:
        """A condition True while `on`, else False (only if it was ever reported)."""
        if on:
            self.set(type, True, reason, message)
        else:
            self.clear(type, off, off_message)


def node_counts(job: JobSpec, current: Attempt) -> dict[str, Any]:
    """Per-phase counts of the current attempt's pods, each rank's newest (a replaced pod kept
    Failed for its logs counts as nothing, nor does a terminating one)."""
    counts: dict[str, Any] = {"total": job.spec.nodes, "pending": 0, "running": 0, "succeeded": 0, "failed": 0}
    for p in (p for p in current.by_rank.values() if not podinfo.terminating(p)):
        ph = podinfo.phase(p).lower()
        if ph in counts and ph != "total":
            counts[ph] += 1
    counts["ready"] = f"{counts['running']}/{job.spec.nodes}"
    return counts


def progress_display(progress: dict[str, Any] | None) -> str | None:
    """A short text for `kubectl get ddpj`: 42% (step 420/1000)."""
    if not progress:
        return None
    pct, step, total = progress.get("percent"), progress.get("step"), progress.get("totalSteps")
    if pct is not None:
        return f"{float(pct):.0f}%" + (f" ({step}/{total})" if step is not None and total else "")
    if step is not None:
        return f"step {step}" + (f"/{total}" if total else "")
    if progress.get(UNAVAILABLE):
        return "n/a (not scraped)"
    return None


MAX_FAILURES = 10          # status.failures entries kept (newest last)
MAX_LOG_TAIL = 1500        # characters of each failed container's termination message / log tail


def debug_dir_of(job: JobSpec, attempt: int) -> str | None:
    """Where the built-in trainer of a GPU job puts an attempt's NCCL flight-recorder dumps (on its
    checkpoint volume); None when it has no such place (a CPU job, a user's command, no checkpoints)."""
    ckpt = (job.trainer.get("checkpoint") or {}).get("dir")
    if not (job.uses_builtin_trainer and job.spec.gpus_per_node > 0 and ckpt):
        return None
    return contract.debug_dir(ckpt, attempt)


def failure_evidence(ended: Attempt, *, with_log: bool = False, debug_dir: str | None = None) -> list[dict[str, Any]]:
    """What a group restart deletes, kept in status.failures: each failed (or killed) container
    of the `ended` attempt with its exit code, signal, node and finish time, and with `with_log`
    (spec.failurePolicy.logTailInStatus) its log tail, redacted (the kubelet writes the launcher's
    message, else the log's end, as terminationMessagePolicy FallbackToLogsOnError). With
    `debug_dir`, where that attempt's NCCL flight-recorder dumps are (debug_dir_of)."""
    out: list[dict[str, Any]] = []
    for pod in sorted(ended.pods, key=podinfo.rank):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            code = term.get("exitCode")
            if code is None or int(code) == 0:
                continue
            entry: dict[str, Any] = {"attempt": ended.number, "pod": podinfo.name(pod), "rank": podinfo.rank(pod),
                                     "container": cs.get("name") or "", "exitCode": int(code)}
            signal = term.get("signal") or (int(code) - 128 if 128 < int(code) < 160 else None)
            for key, value in (("signal", signal), ("reason", term.get("reason")),
                               ("node", (pod.get("spec") or {}).get("nodeName")),
                               ("finishedAt", term.get("finishedAt"))):
                if value:
                    entry[key] = value
            if debug_dir:
                entry["debugDir"] = debug_dir
            tail = redact(str(term.get("message") or "").strip()) if with_log else ""
            if tail:
                entry["logTail"] = tail[-MAX_LOG_TAIL:]
            out.append(entry)
    return out


def _gang_condition(conds: Conditions, placed) -> list[Event]:
    """GangScheduled from the gang's placement (None: not gang-scheduled); an event when first placed."""
    if placed is None:
        return []
    was = conds.true(Cond.GANG_SCHEDULED)
    conds.set(Cond.GANG_SCHEDULED, placed.placed, placed.reason, placed.message)
    return [("Normal", "GangScheduled", placed.message)] if placed.placed and was is None else []


def _admission_condition(conds: Conditions, queued, *, queue_named: bool) -> list[Event]:
    """Admitted from Kueue's gate (None: no queue named, or no current pod yet); an event at each
    change of reason."""
    if not queue_named:
        # The queue label was taken off: an earlier attempt's admission says nothing of the next.
        conds.items[:] = [c for c in conds.items if c.get("type") != Cond.ADMITTED]
        return []
    if queued is None:
        return []
    # Any status: Queued (False) and Admitted (True) are both states to announce once.
    was = next((c.get("reason") for c in conds.items if c.get("type") == Cond.ADMITTED), None)
    conds.set(Cond.ADMITTED, queued.admitted, queued.reason, queued.message)
    if was == queued.reason:
        return []
    # Kueue ignoring a job that names a queue is a misconfiguration, not progress.
    return [("Warning" if queued.reason == "NotManagedByKueue" else "Normal", queued.reason, queued.message)]


def mlflow_status(job: JobSpec, *, prev: dict[str, Any] | None, run: tuple[str, str] | None,
                  default_tracking_uri: str = "") -> dict[str, Any] | None:
    """status.mlflow: the run the ranks report (runId, experimentId) and, for an http(s) tracking
    URI, its page (`<uri>/#/experiments/<exp>/runs/<run>`, the URI's userinfo left out). Written
    when the run is first reported or changes, never per scrape; kept while nothing reports."""
    if run is None or (prev or {}).get("runId") == run[0]:
        return dict(prev) if prev else None
    run_id, exp_id = run
    out: dict[str, Any] = {"runId": run_id, "experimentId": exp_id}
    uri = (job.trainer.get("mlflow") or {}).get("trackingUri") or default_tracking_uri
    if uri.startswith(("http://", "https://")):
        out["url"] = f"{public_uri(uri).rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"
    return out


def _in_place(conds: Conditions, up: inplace.Update, job: JobSpec, d: Decision) -> list[Event]:
    """The Restarting condition while a running job restarts in place, and an event for each
    in-place restart (Warning) and for each that steps again (Normal)."""
    used = d.counted_restarts + up.in_place_restarts
    cond = inplace.restarting(up, budget_used=used, max_restarts=job.spec.failure_policy.max_restarts)
    if cond is not None and d.phase is Phase.RUNNING:
        conds.set(Cond.RESTARTING, *cond)
    events: list[Event] = [("Warning", Reason.RESTARTING_IN_PLACE,
                            inplace.restarting_message(e, used=used, max_restarts=job.spec.failure_policy.max_restarts)) for e in up.new]
    events += [("Warning", Reason.REPLACING_POD, f"{inplace.describe(e)}; the other pods keep theirs "
                f"({used}/{job.spec.failure_policy.max_restarts} of failurePolicy.maxRestarts used)")
               for e in up.history if e.get("kind") == Recovery.REPLACE and e.get("newPod") in {r.new_pod for r in d.replaced}]
    events += [("Normal", Reason.POD_REPLACED if e["kind"] == Recovery.REPLACE else Reason.RESTARTED_IN_PLACE,
                inplace.recovered_message(e)) for e in up.recovered]
    return events


def _failure_steps(attempt: Attempt) -> list[int]:
    """The steps the attempt's failed pods wrote in their termination messages (podinfo.failure_step)."""
    return [step for p in [*attempt.pods, *attempt.departed.values()] if (step := podinfo.failure_step(p)) is not None]


def _resized(conds: Conditions, up: inplace.Update, job: JobSpec, ranks: Any) -> list[Event]:
    """`Resized` while an elastic job trains on fewer nodes (spec.elastic.minNodes) because a lost
    pod's replacement is not running (unschedulable, pulling): torchrun's rendezvous completed
    without it; False once every node trains again (the agents restart the workers when its agent
    joins). A per-step job (spec.faultTolerance) the same: its other replica groups train on
    without the lost one, and the replacement joins their next quorum. The scrape tells: None (no
    scrape) leaves it as it was."""
    pending = up.pending
    if pending is not None and pending.get("kind") == Recovery.REPLACE and ranks is not None:
        pods = inplace.training_without(pending, ranks)
        ft = job.spec.fault_tolerance
        if pods is not None and (job.min_nodes < job.spec.nodes or ft is not None):
            was = conds.true(Cond.RESIZED)
            floor = (f"spec.faultTolerance.minReplicas={ft.min_replicas}" if ft is not None
                     else f"spec.elastic.minNodes={job.min_nodes}")
            text = (f"running on {len(pods)} of {job.spec.nodes} nodes ({floor}) while "
                    f"pod {pending.get('newPod')}, which replaces {pending.get('pod')}, is not running; it joins when it starts")
            conds.set(Cond.RESIZED, True, Reason.FEWER_NODES, text)
            return [] if was else [("Warning", Reason.FEWER_NODES, text)]
    if pending is None and conds.true(Cond.RESIZED):
        text = f"running on all {job.spec.nodes} nodes again"
        conds.clear(Cond.RESIZED, Reason.ALL_NODES, text)
        return [("Normal", Reason.ALL_NODES, text)]
    return []


def _goodput(job: JobSpec, current: Attempt, d: Decision, prev: dict[str, Any], up: inplace.Update,
             report: MonitorReport | None, conds: Conditions, progress: dict[str, Any]) -> dict[str, Any]:
    """status.goodput after this pass (decisions/goodput.py): what the pass sees of the job's time."""
    ranks = report.ranks if report is not None else None
    stepped = goodput.stepped_at(ranks)
    if stepped is None and progress.get(UNAVAILABLE) and d.phase is Phase.RUNNING:
        # Pods no one scrapes (simulated nodes): running is as far as anything can tell.
        stepped = goodput.timestamp((conds.true(Cond.RUNNING) or {}).get("lastTransitionTime"))
    stall = conds.true(Signal.STALLED)
    created = (goodput.timestamp((job.raw.get("metadata") or {}).get("creationTimestamp"))
               or goodput.timestamp(prev.get("startTime")) or conds.now.timestamp())
    # A first ledger (a job older than the ledger) counts every restart its history still holds.
    known = prev if prev.get("goodput") else {}
    history = known.get("restartHistory") or []
    return goodput.advance(prev.get("goodput"), goodput.Observed(
        now=conds.now.timestamp(), created=created,
        ended=d.completion_time.timestamp() if d.phase.finished and d.completion_time is not None else None,
        suspended=Phase.parse(prev.get("phase")) is Phase.SUSPENDED, attempt=d.attempt,
        restarted=d.restarted is not None,
        scheduled_at=(goodput.scheduled_at(list(current.by_rank.values()), job.spec.nodes)
                      if goodput.mode(prev.get("goodput"), d.attempt) == "queued" else None),
        stepped_at=stepped, history=up.history, recovered=inplace.recoveries(known, {"restartHistory": up.history}, training_stopped=True),
        stalls=goodput.new_stalls(history, up.history, goodput.timestamp((prev.get("progress") or {}).get("lastStepTime"))),
        stall_since=(goodput.timestamp(progress.get("lastStepTime")) or goodput.timestamp(stall.get("lastTransitionTime"))
                     if stall else None),
        ranks=goodput.rank_counters(ranks), step_seconds=goodput.step_seconds(ranks)))


def _created_conditions(conds: Conditions, job: JobSpec, d: Decision, group: Group) -> None:
    """A refused create (create_refused) holds until every rank exists, and for good once the job
    failed for it (a pod the API server can never accept); until then nothing claims the pods
    were created."""
    refused = conds.true(Cond.FAILED_CREATE_POD) is not None and (
        bool(d.create_ranks) or d.create_lighthouse or (d.phase is Phase.FAILED and not group.pods))
    if not refused and (d.create_ranks or group.pods or any(c.get("type") == Cond.CREATED for c in conds.items)):
        conds.set(Cond.CREATED, True, Reason.CREATED, f"headless service and {job.spec.nodes} pod(s) created")
    if not d.create_ranks and not refused:
        conds.clear(Cond.FAILED_CREATE_POD, Reason.CREATED, f"all {job.spec.nodes} pod(s) created")


def _lighthouse_condition(conds: Conditions, job: JobSpec, d: Decision) -> None:
    """LighthouseReady while a per-step job may run (lifecycle.keep_lighthouse): True once its
    Lighthouse serves, False after that while it is missing or not ready, as when it is made again
    (the groups wait for it: their quorum calls retry within spec.faultTolerance.quorumTimeoutSeconds).
    Left as it was once the job finished or is suspended."""
    if d.lighthouse_ready is None:
        return
    name = lighthouse_name(job)
    conds.hold(Cond.LIGHTHOUSE_READY, d.lighthouse_ready, Reason.RUNNING, f"pod {name} serves the quorum",
               "NotReady", f"pod {name} is missing or not ready: the replica groups wait for it")


def _start_condition(conds: Conditions, d: Decision) -> list[Event]:
    """ContainersNotStarting while a container is stuck before it starts; an event per new reason."""
    was = conds.true(Cond.CONTAINERS_NOT_STARTING)
    if not d.start_errors:
        conds.clear(Cond.CONTAINERS_NOT_STARTING, "Started", "")
        return []
    first = d.start_errors[0]
    text = "; ".join(e.describe() for e in d.start_errors[:5])
    if len(d.start_errors) > 5:
        text += f"; and {len(d.start_errors) - 5} more"
    conds.set(Cond.CONTAINERS_NOT_STARTING, True, first.reason, text)
    return [("Warning", first.reason, text)] if not was or was.get("reason") != first.reason else []


def _node_condition(conds: Conditions, d: Decision, current: Attempt) -> list[Event]:
    """NodeNotReady while a pod of the running attempt is on a node that stopped reporting."""
    stranded = [p for p in current.pods if podinfo.node_not_ready(p)]
    was = conds.true(Cond.NODE_NOT_READY)
    if not stranded or d.phase.finished:
        conds.clear(Cond.NODE_NOT_READY, Reason.NODES_READY, "every pod's node is reporting")
        return []
    text = "; ".join(f"pod {podinfo.name(p)} on node {(p.get('spec') or {}).get('nodeName', '?')}"
                     for p in stranded[:5])
    text += (": the node stopped reporting (NotReady). Training may go on; if Kubernetes evicts "
             "the pod (after its node.kubernetes.io/unreachable toleration, 300 s by default) the "
             "pod is replaced (pod 0: the group restarts) without using the restart budget")
    conds.set(Cond.NODE_NOT_READY, True, "NodeNotReady", text)
    return [("Warning", "NodeNotReady", text)] if not was or was.get("status") != "True" else []


def _end_conditions(conds: Conditions, d: Decision) -> list[Event]:
    """Suspended, Succeeded, Failed and Unschedulable from the decision; an event when unschedulable."""
    conds.hold(Cond.SUSPENDED, d.phase is Phase.SUSPENDED, Reason.SUSPENDED, d.message, Reason.RESUMED, "")
    if d.phase in (Phase.SUCCEEDED, Phase.FAILED):
        conds.set(Cond(d.phase.value), True, d.reason, d.message)
    was = conds.true(Cond.UNSCHEDULABLE) is not None
    conds.hold(Cond.UNSCHEDULABLE, bool(d.unschedulable), Reason.UNSCHEDULABLE, d.unschedulable or "", "Scheduled", "")
    return [("Warning", Reason.UNSCHEDULABLE, d.unschedulable)] if d.unschedulable and not was else []


def _restarts(job: JobSpec, group: Group, d: Decision, prev: dict[str, Any], ranks: Any,
              now: dt.datetime) -> inplace.Update:
    """The restart history after this pass (inplace.update): the group restart the decision starts,
    the lost pods it replaces alone, and the in-place restarts the pods' agents report."""
    group_restart = d.restarted is not None
    return inplace.update(prev, attempt=d.attempt - 1 if group_restart else d.attempt, ranks=ranks,
                          with_log=job.spec.failure_policy.log_tail_in_status, now=now,
                          group=(d.attempt - 1, d.reason, d.message) if group_restart else None,
                          replaced=[inplace.replace_entry(r, attempt=d.attempt, ranks=ranks, prev_status=prev, now=now)
                                    for r in d.replaced],
                          replacement_rounds=d.replacement_rounds,
                          group_steps=_failure_steps(group.at(d.attempt - 1)) if group_restart else (),
                          window=float(job.spec.hang_timeout_seconds or contract.STARTUP_HANG_TIMEOUT))


def _report_conditions(conds: Conditions, report: MonitorReport | None) -> None:
    """The monitor's conditions (Stalled, ...), each keeping its lastTransitionTime while its status holds."""
    items = conds.items
    by_type = {c.get("type"): c for c in items}
    for cond in report.conditions if report is not None else []:
        if cond.get("type") in by_type:
            old = by_type[cond["type"]]
            if old.get("status") == cond.get("status") and old.get("lastTransitionTime"):
                cond = {**cond, "lastTransitionTime": old["lastTransitionTime"]}
            items[items.index(old)] = {"lastTransitionTime": format_time(conds.now), **cond}
        else:
            items.append({"lastTransitionTime": format_time(conds.now), **cond})


def _progress(prev: dict[str, Any], d: Decision, report: MonitorReport | None, up: inplace.Update,
              result: Any, current: Attempt) -> dict[str, Any]:
    """status.progress: the scrape merged in; a terminal write carries where the job ended, and no
    ETA outlives the attempt it was measured on."""
    progress = dict(prev.get("progress") or {})
    if report is not None and report.progress:
        progress = merge_scrape(progress, report.progress)
        if UNAVAILABLE not in report.progress:
            progress.pop(UNAVAILABLE, None)
    if d.phase is Phase.SUCCEEDED:
        progress = succeeded(progress, result)
    elif d.phase is Phase.FAILED:
        progress = stopped(progress, _failure_steps(current))
    elif d.phase is not Phase.RUNNING or up.pending is not None:
        progress = without_eta(progress)
    display = progress_display(progress)
    if display:
        progress["display"] = display
    return progress


def _evidence(job: JobSpec, group: Group, d: Decision, prev: dict[str, Any]) -> list[dict[str, Any]]:
    """status.failures: the evidence of the attempt this pass ends (restarted or failed), once."""
    failures = list(prev.get("failures") or [])
    ended = d.attempt - 1 if d.restarted is not None else (d.attempt if d.phase is Phase.FAILED else None)
    if ended is not None and not any(f.get("attempt") == ended for f in failures):
        failures = (failures + failure_evidence(group.at(ended), with_log=job.spec.failure_policy.log_tail_in_status,
                                                debug_dir=debug_dir_of(job, ended)))[-MAX_FAILURES:]
    return failures


def _first_come_up(d: Decision, prev_phase: Phase | None) -> bool:
    """The job's first attempt being created or starting to run. It posts no Event: its Created and
    Running conditions, with their times, say the same (`kubectl describe` shows them), and two
    Events a job were 2 of the 15 requests each of 1,000 jobs cost to come up (issue 48: pods, the
    Service and 2 status writes, 13). Events keep what a condition cannot: each restart, resume,
    suspension, failure and the end."""
    return (d.attempt == 0 and d.restarted is None and d.phase in (Phase.PENDING, Phase.RUNNING)
            and prev_phase in (None, Phase.PENDING))


def _transition(job: JobSpec, d: Decision, prev_phase: Phase | None, up: inplace.Update) -> list[Event]:
    """One event per transition, never per pass; none for the first come-up (_first_come_up)."""
    if d.restarted is not None:
        return [("Warning", Reason.RESTARTING, f"restarting all {job.spec.nodes} node(s) as attempt {d.attempt} (restart "
                 f"{d.restarts}, {d.counted_restarts + up.in_place_restarts}/{job.spec.failure_policy.max_restarts} of the budget): "
                 f"{d.message}")]
    if d.phase is prev_phase or _first_come_up(d, prev_phase):
        return []
    if d.phase is Phase.FAILED:
        return [("Warning", d.reason or "Failed", d.message)]
    return [("Normal", {Phase.PENDING: Reason.RESUMED if d.reason == Reason.RESUMED else Reason.CREATED}.get(d.phase, d.phase.value),
             d.message)]


def job_status(job: JobSpec, group: Group, *, now: dt.datetime, prev_status: dict[str, Any] | None,
               decision: Decision, config: OperatorConfig | None = None, report: MonitorReport | None = None,
               podgroup: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[Event]]:
    """(new status, events for what changed) for one reconcile pass, from its decision
    (lifecycle.decide: read here, never made again); `podgroup` is a gang-scheduled job's PodGroup
    as last read (None: not read)."""
    config, prev, d = config or OperatorConfig(), dict(prev_status or {}), decision
    conds = Conditions([dict(c) for c in prev.get("conditions") or []], now, job.generation)
    current, ranks = group.at(d.attempt), report.ranks if report is not None else None
    _created_conditions(conds, job, d, group)
    _lighthouse_condition(conds, job, d)
    events = _start_condition(conds, d) + _node_condition(conds, d, current)
    conds.hold(Cond.RUNNING, d.phase is Phase.RUNNING, Reason.RUNNING, d.message, d.reason or d.phase.value, d.message)
    conds.hold(Cond.RESTARTING, d.phase is Phase.RESTARTING, d.reason, d.message,
               Reason.RUNNING if d.phase is Phase.RUNNING else d.phase.value, "")
    restarts = _restarts(job, group, d, prev, ranks, now)
    events += _in_place(conds, restarts, job, d) + _resized(conds, restarts, job, ranks) + _end_conditions(conds, d)
    if d.phase in (Phase.PENDING, Phase.RUNNING, Phase.RESTARTING):
        events += _gang_condition(conds, gang_state(job, current, podgroup=podgroup))
        events += _admission_condition(conds, admission(job, current), queue_named=queue_name(job) is not None)
    result = prev.get("result") or run_result(current)
    progress = _progress(prev, d, report, restarts, result, current)
    _report_conditions(conds, report)
    status: dict[str, Any] = {
        "phase": d.phase.value, "reason": d.reason, "message": d.message, "observedGeneration": job.generation,
        "attempt": d.attempt, "launchedAttempt": d.launched_attempt, "restarts": d.restarts,
        "countedRestarts": d.counted_restarts, "masterAddr": master_dns(job, cluster_domain=config.cluster_domain or None),
        "nodes": node_counts(job, current), "conditions": conds.items,
        "goodput": _goodput(job, current, d, prev, restarts, report, conds, progress)}
    mlflow = mlflow_status(job, prev=prev.get("mlflow"), run=report.mlflow_run if report is not None else None,
                           default_tracking_uri=config.mlflow_tracking_uri)
    optional = {"inPlaceRestarts": restarts.in_place_restarts, "restartHistory": restarts.history,
                "startTime": format_time(d.start_time) if d.start_time is not None else None,
                "completionTime": format_time(d.completion_time) if d.completion_time and d.phase.finished else None,
                "progress": progress, "mlflow": mlflow, "failures": _evidence(job, group, d, prev), "result": result}
    status.update({k: v for k, v in optional.items() if v})
    return status, events + _transition(job, d, Phase.parse(prev.get("phase")), restarts)


def create_refused(job: JobSpec, status: dict[str, Any], refusals: list[CreateRefusal], *,
                   now: dt.datetime, config: OperatorConfig | None = None) -> tuple[dict[str, Any], list[Event]]:
    """The status after pod creates were refused: a FailedCreatePod condition with the API's
    message, Failed when the spec can never be created (400/422), else Pending with that reason
    (lifecycle.decide keeps it until every pod exists). One FailedCreatePod event per new message."""
    if not refusals:
        return status, []
    first = next((r for r in refusals if r.permanent), refusals[0])
    names = ", ".join(sorted({r.pod for r in refusals}))
    message = f"the API server refused to create {first.kind}(s) {names}: {explain_pod_error(first.message, job, config=config)}"
    conds = Conditions([dict(c) for c in status.get("conditions") or []], now, job.generation)
    old = conds.true(Cond.FAILED_CREATE_POD)
    conds.set(Cond.FAILED_CREATE_POD, True, first.reason, message)
    conds.set(Cond.CREATED, False, Cond.FAILED_CREATE_POD.value, message)
    new = {**status, "conditions": conds.items, "reason": Cond.FAILED_CREATE_POD.value}
    events: list[Event] = []
    if not old or old.get("message") != message:
        events.append(("Warning", Cond.FAILED_CREATE_POD.value, message))
    if first.permanent:
        new["phase"] = Phase.FAILED.value
        new["message"] = f"{message} (the job cannot start: fix the spec and recreate the DDPJob)"
        new["completionTime"] = format_time(now)
        conds.set(Cond.FAILED, True, Cond.FAILED_CREATE_POD.value, new["message"])
        conds.clear(Cond.RUNNING, Cond.FAILED_CREATE_POD.value, new["message"])
    else:
        new["phase"] = Phase.PENDING.value if status.get("phase") != Phase.RESTARTING.value else status["phase"]
        new["message"] = f"{message} (retrying; the job cannot start until the API server accepts its pods)"
    return new, events
