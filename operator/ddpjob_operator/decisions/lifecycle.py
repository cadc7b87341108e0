"""What to do next for a DDPJob, decided from observed pods and the last written status (pure).

Level-based: every pass starts from what exists. The status carries only what pods cannot
tell (restart counters, the current attempt, whether the attempt's pods were all created),
and it is written *before* pods are deleted for a restart, so an operator killed at any
moment resumes the same plan: pods whose attempt label differs from status.attempt are stale.

decide asks small policies in order (POLICIES), each over one pass's reading (Seen, from
observe); the first answer wins, and when all pass the job is in its steady state (_steady).
"""
from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

from ddpjob_api import labels
from ddpjob_api.names import pod_name
from ddpjob_api.phases import Cond, FailReason, Phase, Reason, Recovery, RestartReason
from ddpjob_api.spec import JobSpec
from ddpjob_operator.builders import kueue
from ddpjob_operator.base import objmeta, podinfo
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.base.group import Attempt, Group
from ddpjob_operator.builders.envvars import inplace_budget, own_rendezvous
from ddpjob_operator.decisions import inplace
from ddpjob_operator.decisions.redact import redact


@dataclass(frozen=True)
class Failure:
    """One reason to restart (or fail) the group."""

    reason: str          # a RestartReason, or BadConfiguration (fatal)
    message: str
    counted: bool        # counts against failurePolicy.maxRestarts
    fatal: bool = False  # fails the job at once (no restart helps)


class Verdict(str, enum.Enum):
    """What a pod's end means for the group."""

    FAIL = "fail"                   # the job fails: no restart can help
    RESTART = "restart"             # group restart, charged to failurePolicy.maxRestarts
    RESTART_FREE = "restart-free"   # group restart, not the training's fault: free


# DisruptionTarget condition reasons (Kubernetes sets them before it takes a pod away) -> our reason.
R = RestartReason
DISRUPTION_REASONS = {
    "DeletionByPodGC": R.NODE_LOST,             # the pod's node object is gone
    "DeletionByTaintManager": R.NODE_LOST,      # NoExecute taint: node unreachable / not ready
    "PreemptionByScheduler": R.POD_PREEMPTED,
    "EvictionByEvictionAPI": R.POD_EVICTED,     # drain, descheduler, autoscaler scale-down
    "TerminationByKubelet": R.POD_EVICTED,      # node pressure, graceful node shutdown
}
# What a pod of rank > 0 may be lost to and be replaced alone (the cluster took it, or someone
# deleted it): its launcher did not fail, so its peers' agents restart their workers in place and
# wait in the attempt's rendezvous for the replacement's (docs/restarts.md).
REPLACEABLE = frozenset({R.POD_DELETED.value, R.POD_EVICTED.value, R.POD_PREEMPTED.value, R.NODE_LOST.value})
# pod status.reason values the kubelet and node lifecycle write for the same cases.
STATUS_REASONS = {"Evicted": R.POD_EVICTED, "Preempting": R.POD_PREEMPTED, "Preempted": R.POD_PREEMPTED,
                  "NodeLost": R.NODE_LOST, "Shutdown": R.POD_EVICTED, "NodeShutdown": R.POD_EVICTED,
                  "Terminated": R.POD_EVICTED, "OutOfcpu": R.POD_EVICTED, "OutOfmemory": R.POD_EVICTED,
                  "UnexpectedAdmissionError": R.POD_EVICTED}


def disruption(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(our reason, what Kubernetes said) when the cluster, not the training, ended this pod."""
    st = pod.get("status") or {}
    for c in st.get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            why = str(c.get("reason") or "")
            return DISRUPTION_REASONS.get(why, R.POD_EVICTED).value, str(c.get("message") or why)
        if c.get("type") == kueue.TERMINATION_TARGET and c.get("status") == "True":
            # Kueue evicted the admitted group (preemption, fair-share reclaim, a stopped queue).
            why = str(c.get("reason") or "")
            return R.POD_PREEMPTED.value, f"Kueue: {c.get('message') or why}"
    if st.get("reason") in STATUS_REASONS:
        return STATUS_REASONS[st["reason"]].value, str(st.get("reason"))
    return None


def _exit_text(pod: dict[str, Any], *, with_log: bool) -> str:
    """'exit code 1 (Error)': reason and exit code only; the container's own words (its termination
    message: the launcher's reason, else the log's end) only when the job opted in, redacted."""
    code = podinfo.exit_code(pod)
    reasons = {str(t.get("reason")) for t in podinfo.terminated_states(pod)
               if t.get("reason") and int(t.get("exitCode") or 0) != 0}
    text = f"exit code {code}" + (f" ({', '.join(sorted(reasons))})" if reasons else "")
    if with_log:
        msg = redact(podinfo.failure_message(pod))
        if msg:
            text += f": {msg}"
    return text


# The rules, first match wins: (test on the pod's last known state, verdict, reason, message).
# `gone` = the pod vanished (force-deleted: PodGC after its node was deleted, or a user).
_Rule = tuple[Callable[[dict[str, Any], bool], bool], Verdict, Callable[[dict[str, Any], bool], str],
              Callable[[dict[str, Any], str, bool], str]]
RULES: list[_Rule] = [
    (lambda p, gone: podinfo.bad_config(p), Verdict.FAIL, lambda p, gone: FailReason.BAD_CONFIGURATION,
     lambda p, n, log: f"pod {n} exited with code {podinfo.EXIT_BAD_CONFIG} (bad configuration)"
                       + (f": {redact(podinfo.failure_message(p))}" if log and podinfo.failure_message(p)
                          else f"; see `kubectl logs {n}`")),
    (lambda p, gone: disruption(p) is not None, Verdict.RESTART_FREE,
     lambda p, gone: disruption(p)[0],  # type: ignore[index]  # not None: the test above
     lambda p, n, log: f"pod {n} was taken away by the cluster: {redact(disruption(p)[1])}"),  # type: ignore[index]
    (lambda p, gone: podinfo.phase(p) == "Failed", Verdict.RESTART, lambda p, gone: R.POD_FAILED.value,
     lambda p, n, log: f"pod {n} failed with {_exit_text(p, with_log=log)}"),
    (lambda p, gone: gone or podinfo.terminating(p), Verdict.RESTART, lambda p, gone: R.POD_DELETED.value,
     lambda p, n, log: f"pod {n} is being deleted" if podinfo.terminating(p) else f"pod {n} disappeared"),
]


def verdict(pod: dict[str, Any], *, gone: bool = False, with_log: bool = False) -> Failure | None:
    """What this pod's end means (None: it has not ended). The rule table above decides."""
    name = podinfo.name(pod)
    for test, v, reason, message in RULES:
        if test(pod, gone):
            return Failure(reason(pod, gone), message(pod, name, with_log),
                           counted=v is Verdict.RESTART, fatal=v is Verdict.FAIL)
    return None


# Container waiting reasons that do not clear by themselves: the kubelet retries forever (Kubernetes
# leaves such a pod Pending), so without a condition the job would look merely slow.
START_ERRORS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
                          "CreateContainerConfigError", "CreateContainerError"})
# An init container (or native sidecar) that keeps crashing blocks the pod the same way; the
# training container itself never crash-loops (restartPolicy: Never).
INIT_START_ERRORS = START_ERRORS | {"CrashLoopBackOff", "RunContainerError"}


@dataclass(frozen=True)
class StartError:
    """A container of one pod stuck before it could start."""

    pod: str
    container: str
    reason: str
    message: str
    init: bool = False

    def describe(self) -> str:
        kind = "init container" if self.init else "container"
        text = f"pod {self.pod} {kind} {self.container}: {self.reason}"
        return f"{text}: {self.message}" if self.message else text


def start_errors(pods: list[dict[str, Any]]) -> list[StartError]:
    """Every container of these pods waiting in a start error, in pod order."""
    out: list[StartError] = []
    for pod in pods:
        if podinfo.terminating(pod) or podinfo.phase(pod) not in ("Pending", "Running"):
            continue
        status = pod.get("status") or {}
        for key, reasons, init in (("initContainerStatuses", INIT_START_ERRORS, True),
                                   ("containerStatuses", START_ERRORS, False)):
            for cs in status.get(key) or []:
                waiting = (cs.get("state") or {}).get("waiting") or {}
                if waiting.get("reason") in reasons:
                    out.append(StartError(pod=podinfo.name(pod), container=str(cs.get("name") or ""),
                                          reason=waiting["reason"],
                                          message=redact(" ".join(str(waiting.get("message") or "").split()))[:300],
                                          init=init))
    return out


def condition(status: dict[str, Any] | None, type: str) -> dict[str, Any] | None:
    """The condition of this type in a status, when it is True."""
    return next((c for c in (status or {}).get("conditions") or []
                 if c.get("type") == type and c.get("status") == "True"), None)


@dataclass(frozen=True)
class Replacement:
    """A lost pod of one rank, recreated alone in the same attempt (its peers keep their pods)."""

    rank: int
    old_pod: str
    number: int          # the n-th replacement of this rank in the attempt: the new pod's `-r<n>`
    new_pod: str
    node: str            # the lost pod's node ('' when never scheduled)
    failure: Failure
    # spec.faultTolerance.mode of a per-step job (restartHistory's `mode`): the other groups kept training.
    mode: str | None = None


def per_step(job: JobSpec) -> bool:
    """spec.faultTolerance: each pod is a torchft replica group, a world of its own (its torchrun's
    store is its own), and the others train on through its loss and take in its replacement at
    their next quorum, which recovers its state from a peer."""
    return job.spec.fault_tolerance is not None


def group_only(job: JobSpec) -> str | None:
    """Why a lost pod of this job restarts the whole group (None: it is replaced alone). The
    survivors' agents must restart their workers in place (an in-place budget) and meet the
    replacement in pod 0's c10d store (the operator's rendezvous, not a user's own endpoint); a
    Kueue pod group is admitted whole, and a new pod of it would wait for an admission of its own.
    A per-step job's survivors neither restart nor rendezvous: only the Kueue reason holds there."""
    if per_step(job):
        return "a Kueue pod group is admitted as a whole" if kueue.queue_name(job) is not None else None
    if inplace_budget(job) <= 0:
        return "no in-place restarts (PET_MAX_RESTARTS=0): the other pods' workers cannot wait for a new peer"
    if kueue.queue_name(job) is not None:
        return "a Kueue pod group is admitted as a whole"
    if own_rendezvous(job):
        return "the job's own PET_RDZV_ENDPOINT: which pod hosts its rendezvous is not the operator's to know"
    return None


def replacements_of(prev: Mapping[str, Any], attempt: int) -> dict[str, Mapping[str, Any]]:
    """This attempt's replacements so far (status.restartHistory), by the lost pod's name."""
    return {str(e.get("pod")): e for e in prev.get("restartHistory") or []
            if e.get("kind") == Recovery.REPLACE and e.get("attempt") == attempt}


@dataclass(frozen=True)
class Decision:
    """The outcome of one pass: target phase, counters, and the actions to take."""

    phase: Phase
    reason: str
    message: str
    attempt: int
    launched_attempt: int
    restarts: int
    counted_restarts: int
    start_time: dt.datetime | None
    completion_time: dt.datetime | None
    create_ranks: list[int] = field(default_factory=list)
    replacement: dict[int, int] = field(default_factory=dict)   # rank -> n: create_ranks' `-r<n>` pods
    replaced: list[Replacement] = field(default_factory=list)   # lost pods this pass replaces alone
    delete_pods: list[str] = field(default_factory=list)
    delete_job: bool = False
    unschedulable: str | None = None          # scheduler message once past the timeout
    requeue_after: float | None = None        # seconds until a deadline needs another pass
    restarted: Failure | None = None          # set in the pass that starts a group restart
    start_errors: list[StartError] = field(default_factory=list)   # containers that cannot start
    # Rounds of the attempt's rendezvous that lost pods took the survivors through (not in place).
    replacement_rounds: int = 0
    create_lighthouse: bool = False           # a per-step job's Lighthouse pod is missing: make it (and its Service)
    lighthouse_ready: bool | None = None      # ... and whether it serves (None: no Lighthouse expected now)


def _iso(value: Any) -> dt.datetime | None:
    return objmeta.parse_time(value) if isinstance(value, str) else value


def _sooner(a: float | None, b: float | None) -> float | None:
    vals = [v for v in (a, b) if v is not None]
    return max(0.0, min(vals)) if vals else None


def _finished_deletes(job: JobSpec, live: Iterable[dict[str, Any]]) -> list[str]:
    """Pods (of those not being deleted) that cleanPodPolicy removes once the job finished."""
    policy = job.spec.clean_pod_policy
    if policy == "None":
        return []
    return [podinfo.name(p) for p in live if not (policy == "Running" and podinfo.ended(p))]


def _failures(job: JobSpec, current: dict[int, dict], attempt: int, launched: bool,
              departed: Mapping[str, dict[str, Any]], numbers: Mapping[int, int],
              ) -> list[tuple[int, dict[str, Any], Failure]]:
    """(rank, the pod's last state, what its end means) of each rank whose pod ended or vanished.
    `numbers`: each rank's newest replacement decided in this attempt: a rank whose replacement
    is not created yet is not lost (it is about to be), one whose replacement vanished is."""
    log = job.spec.failure_policy.log_tail_in_status
    out = [(r, pod, f) for r, pod in sorted(current.items()) if (f := verdict(pod, with_log=log)) is not None]
    for r in [r for r in range(job.spec.nodes) if r not in current] if launched else []:
        name = pod_name(job.name, r, attempt, numbers.get(r, 0))
        if numbers.get(r) and name not in departed:
            continue
        last = departed.get(name) or {"metadata": {"name": name}}
        # never None with gone=True: the table's last rule matches every departed pod
        out.append((r, last, verdict(last, gone=True, with_log=log)))  # type: ignore[arg-type]
    return out


def _replacements(s: Seen) -> list[Replacement]:
    """A new pod for each lost one (replace_lost): its rank's next `-r<n>` in the attempt."""
    out = []
    for r, pod, f in s.lost:
        n = max([s.numbers.get(r, 0)] + [podinfo.replacement(p) for p in s.this.pods if podinfo.rank(p) == r]) + 1
        out.append(Replacement(rank=r, old_pod=podinfo.name(pod), number=n,
                               new_pod=pod_name(s.job.name, r, s.this.number, n),
                               node=str((pod.get("spec") or {}).get("nodeName") or ""), failure=f,
                               mode=s.job.spec.fault_tolerance.mode if s.job.spec.fault_tolerance else None))
    return out


# Bounds the schema also enforces on status; a counter beyond them is an edit, never ours.
MAX_ATTEMPT = 1_000_000


def _count(value: Any, default: int = 0, *, low: int = 0) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return default
    return min(max(n, low), MAX_ATTEMPT)


def _annotation(pod: dict[str, Any], key: str) -> int:
    return _count(((pod.get("metadata") or {}).get("annotations") or {}).get(key), -1, low=-1)


def trusted_counters(prev: dict[str, Any], group: Group) -> tuple[int, int, int]:
    """(attempt, restarts, counted restarts), from what the operator wrote into its pods as well
    as from the status: anyone allowed to patch ddpjobs/status may edit the status, not our pods.
    Counters a status edit cannot lower (to grant restarts) or inflate (to wedge the job or
    make every pod stale): the attempt is at most one past the newest pod's (a restart writes
    attempt+1 before it deletes the old pods), and the restart counters never fall below what
    the current attempt's pods carry."""
    newest, claimed = group.newest, _count(prev.get("attempt"))
    attempt = claimed if newest is None else max(newest, min(claimed, newest + 1))
    ours = group.at(attempt).pods
    restarts = max([_count(prev.get("restarts"))] + [_annotation(p, labels.RESTARTS) for p in ours])
    counted = max([_count(prev.get("countedRestarts"))] + [_annotation(p, labels.COUNTED_RESTARTS) for p in ours])
    return attempt, max(restarts, counted), counted


def in_place_restarts(prev: dict[str, Any], ranks: Mapping[int, Any] | None = None, *, replaced: int = 0) -> int:
    """Restarts in place so far (status.inPlaceRestarts, decisions/inplace.py): charged to
    failurePolicy.maxRestarts with the counted group restarts. Never below what the pods' agents
    prove in `ranks` (the latest scrape's samples, inplace.proven): a status edit that lowers it
    grants no restart; one that raises it is bounded as the other counters are."""
    return _count(max(_count(prev.get("inPlaceRestarts")), inplace.proven(ranks, replaced=replaced)))


def finished_claim_holds(job: JobSpec, prev_phase: Phase | None, group: Group, attempt: int) -> bool:
    """A finished phase in the status is believed unless every rank of its attempt still has a
    live pod: a status edited to Succeeded must not get a healthy group deleted. (Every way the
    operator finishes a job leaves a rank ended, missing or never created, except a deadline,
    which deciding again from the pods finds anyway.)"""
    if prev_phase is None or not prev_phase.finished:
        return False
    active = {podinfo.rank(p) for p in group.at(attempt).active if podinfo.phase(p) in ("Pending", "Running")}
    return not all(r in active for r in range(job.spec.nodes))


@dataclass(frozen=True)
class Seen:
    """One pass's reading of the job, the status and the pods: what the policies below answer from."""

    job: JobSpec
    group: Group
    now: dt.datetime
    config: OperatorConfig
    prev: dict[str, Any]
    base: Decision             # the status' phase and counters (a finished claim that does not hold: Running)
    active: Decision           # base resumed, its deadline clock started, back at the deadline
    this: Attempt              # the current attempt's pods
    current: dict[int, dict[str, Any]]   # the pod standing for each rank
    numbers: dict[int, int]    # each rank's newest replacement decided in this attempt
    lost: list[tuple[int, dict[str, Any], Failure]]   # (rank, last state, verdict) of each pod that ended
    failures: list[Failure]    # those, and a stall the agents did not restart in place
    finished: bool             # the status' finished phase holds (finished_claim_holds)
    elapsed: float             # seconds since the deadline clock started
    in_place: int              # restarts in place so far: charged with the counted group restarts

    @property
    def cause(self) -> Failure | None:
        """The failure a group restart would name: the first that costs the budget, else the first."""
        return next((f for f in self.failures if f.counted), self.failures[0]) if self.failures else None


def observe(job: JobSpec, group: Group, prev: dict[str, Any], *, now: dt.datetime, hang_overdue: bool = False,
            ranks: Mapping[int, Any] | None = None, config: OperatorConfig | None = None) -> Seen:
    """What decide reads of one pass (its docstring says what the arguments are)."""
    prev_phase = Phase.parse(prev.get("phase"))
    attempt, restarts, counted = trusted_counters(prev, group)
    base = Decision(
        phase=prev_phase or Phase.PENDING, reason=str(prev.get("reason") or ""),
        message=str(prev.get("message") or ""), attempt=attempt,
        launched_attempt=min(_count(prev.get("launchedAttempt"), -1, low=-1), attempt),
        restarts=restarts, counted_restarts=counted,
        start_time=_iso(prev.get("startTime")), completion_time=_iso(prev.get("completionTime")),
    )
    finished = finished_claim_holds(job, prev_phase, group, attempt)
    if prev_phase is not None and prev_phase.finished and not finished:
        # Claimed finished while its pods still run: decide from the pods instead.
        prev_phase, base = Phase.RUNNING, replace(base, phase=Phase.RUNNING, completion_time=None)
    active = base
    if prev_phase is Phase.SUSPENDED and not job.spec.suspend:
        # Resume: a fresh attempt (the old pods are gone, not failed), deadline clock restarts.
        active = replace(base, attempt=base.attempt + 1, start_time=now, phase=Phase.PENDING, reason=Reason.RESUMED,
                         message="spec.suspend is false: pods recreated")
    this = group.at(active.attempt)
    # Queued by Kueue, the pods hold nothing yet: the deadline counts from admission, as a Job's
    # startTime does when Kueue unsuspends it.
    queued = kueue.queue_name(job) is not None and any(kueue.gated(p) for p in this.pods)
    start = now if active.start_time is None or queued else active.start_time
    limit = job.spec.active_deadline_seconds

    # A lost pod being replaced stands for its rank no more: its replacement is created once it is gone.
    replacing = replacements_of(prev, active.attempt)
    numbers: dict[int, int] = {}
    for e in replacing.values():
        numbers[inplace.as_int(e.get("rank"))] = max(numbers.get(inplace.as_int(e.get("rank")), 0),
                                                   inplace.as_int(e.get("replacement")))
    # (Only a pod that did end or is being deleted: a status edit naming a live pod must not get it deleted.)
    current = {r: p for r, p in this.by_rank.items()
               if r < job.spec.nodes and not (podinfo.name(p) in replacing and verdict(p) is not None)}
    lost = _failures(job, current, active.attempt, launched=active.launched_attempt == active.attempt,
                     departed=this.departed, numbers=numbers)
    failures = [f for _, _, f in lost]
    if hang_overdue and job.spec.failure_policy.restart_on_hang and prev_phase is Phase.RUNNING:
        # The pods' agents restart a stalled rank's workers in place at one hang timeout; still
        # stalled a timeout later, that did not work (a user's own torchrun, an agent stuck in its
        # rendezvous): the group restart is what is left.
        failures.append(Failure(R.STALLED.value, "training stalled (no progress for twice the hang timeout) and "
                                "not restarted in place; failurePolicy.restartOnHang", counted=True))
    # The survivors' round for a pod the cluster or a user took now is part of what answers that
    # loss (its replacement or the group restart), not an in-place restart of its own.
    # Counted: the replacements the attempt's pods show, those decided and not created yet (their
    # rank has no pod standing for it: at most one per rank, so an edited history cannot inflate
    # it), and pods taken in this pass.
    # A per-step job's survivors go through none: their agents' restarts are all in place.
    rounds = 0 if per_step(job) else (this.replacements + sum(1 for r in numbers if r not in current)
                                      + sum(1 for _, _, f in lost if f.reason in REPLACEABLE))
    elapsed = (now - start).total_seconds()
    active = replace(active, start_time=start, replacement_rounds=rounds,
                     requeue_after=None if limit is None else limit - elapsed)
    return Seen(job, group, now, config or OperatorConfig(), prev, base, active, this, current, numbers, lost,
                failures, finished, elapsed, in_place_restarts(prev, ranks, replaced=rounds))


def decide(job: JobSpec, group: Group, *, now: dt.datetime, prev_status: dict[str, Any] | None,
           config: OperatorConfig | None = None, hang_overdue: bool = False,
           ranks: Mapping[int, Any] | None = None, lighthouse: dict[str, Any] | None = None) -> Decision:
    """The next step for `job` given its pods (all attempts) and the previous status: the first
    policy that answers (POLICIES), else the steady state.

    The group's departed pods (the last state seen of those that vanished: a pod force-deleted by
    PodGC after its node went away is Failed with a DisruptionTarget condition just before) tell a
    lost node apart from a deleted pod. `hang_overdue`: the job has been Stalled for
    health.GROUP_RESTART_TIMEOUTS hang timeouts (MonitorReport.hang_overdue); `ranks`: the latest
    scrape's samples (MonitorReport.ranks), whose agents' failures bound the in-place restarts;
    `lighthouse`: a per-step job's Lighthouse pod as listed (None: there is none), which
    `keep_lighthouse` keeps beside whatever the group does."""
    seen = observe(job, group, prev_status or {}, now=now, hang_overdue=hang_overdue, ranks=ranks, config=config)
    d = next((d for policy in POLICIES if (d := policy(seen)) is not None), None) or _steady(seen)
    return keep_lighthouse(job, d, lighthouse)


def keep_lighthouse(job: JobSpec, d: Decision, pod: dict[str, Any] | None) -> Decision:
    """A per-step job's Lighthouse (builders/lighthouse.py) outlives attempts, restarts and lost
    pods: it is made when missing while the job may run, and goes only where the training pods
    would: a suspended job's, and a finished job's as cleanPodPolicy says (it never ends by itself,
    so Running and All both delete it; None keeps it, like the pods, until the job is deleted). An
    ended one (evicted: restartPolicy Always keeps it up otherwise) is deleted; its DELETED event
    brings the pass that makes the next."""
    if job.spec.fault_tolerance is None:
        return d
    live = [pod] if pod is not None and not podinfo.terminating(pod) else []
    if d.phase.finished:
        gone = _finished_deletes(job, live)
    elif d.phase is Phase.SUSPENDED:
        gone = [podinfo.name(p) for p in live]
    elif pod is None:
        return replace(d, create_lighthouse=True, lighthouse_ready=False)
    else:
        gone = [podinfo.name(p) for p in live if podinfo.ended(p)]
        d = replace(d, lighthouse_ready=podinfo.ready(pod))
    return replace(d, delete_pods=d.delete_pods + gone) if gone else d


# --- the policies: each answers with the pass's decision, or None to pass ----------------------------

def keep_finished(s: Seen) -> Decision | None:
    """A finished job stays so: only cleanPodPolicy and the TTL act."""
    return _finish(s, s.base) if s.finished else None


def suspend(s: Seen) -> Decision | None:
    """Delete the pods, keep the counters."""
    if not s.job.spec.suspend:
        return None
    return replace(s.base, phase=Phase.SUSPENDED, reason=Reason.SUSPENDED, message="spec.suspend is true: pods deleted",
                   delete_pods=[podinfo.name(p) for p in s.group.live])


def _fail(s: Seen, reason: str, message: str) -> Decision:
    return _finish(s, replace(s.active, phase=Phase.FAILED, reason=reason, message=message))


def deadline(s: Seen) -> Decision | None:
    limit = s.job.spec.active_deadline_seconds
    if limit is None or s.elapsed < limit:
        return None
    return _fail(s, FailReason.DEADLINE_EXCEEDED, f"the job ran longer than spec.activeDeadlineSeconds={limit}")


def bad_configuration(s: Seen) -> Decision | None:
    """A pod exited 78 (verdict): no restart can help."""
    fatal = next((f for f in s.failures if f.fatal), None)
    return _fail(s, fatal.reason, fatal.message) if fatal else None


def budget(s: Seen) -> Decision | None:
    """Each pod's agent restarts in place within its own budget; the job's is spent when they
    together, with the group restarts, made more than failurePolicy.maxRestarts, or when the
    restart (or replacement) a counted failure asks for would. What the cluster did is free."""
    cause, counted, limit = s.cause, s.active.counted_restarts, s.job.spec.failure_policy.max_restarts
    if (cause is not None and not cause.counted) or counted + s.in_place + (cause is not None) <= limit:
        return None
    if cause is None:
        return _fail(s, FailReason.RESTART_LIMIT_EXCEEDED, f"{s.in_place} restart(s) in place and {counted} "
                     f"group restart(s): more than failurePolicy.maxRestarts={limit}")
    return _fail(s, FailReason.RESTART_LIMIT_EXCEEDED, f"{cause.message}; failurePolicy.maxRestarts={limit} "
                 "restart(s) already used" + (f" ({s.in_place} of them in place)" if s.in_place else ""))


def replace_lost(s: Seen) -> Decision | None:
    """Lost pods are recreated alone, unless one failed (its launcher or agent, or a spent in-place
    budget: its peers' agents may be failing too), rank 0 is lost (it hosts the c10d store every
    agent's rendezvous goes through), or the job is one group_only names. In a per-step job
    (per_step) every pod is a group of its own: whatever ended one, failed too, and whichever rank,
    the others do not fail with it, so it is replaced alone; the budget policy before this one has
    charged a failure as the group restart would have been. Unless every group is lost: no peer is
    left to take the state from, and the group restart resumes from the checkpoints."""
    if not s.lost or group_only(s.job) is not None:
        return None
    if any(f.fatal for _, _, f in s.lost) or (per_step(s.job) and len(s.lost) >= s.job.spec.nodes):
        return None
    if not per_step(s.job) and any(r == 0 or f.reason not in REPLACEABLE for r, _, f in s.lost):
        return None
    return _steady(s, _replacements(s))


def restart_group(s: Seen) -> Decision | None:
    """A new attempt of the whole group: its restart counted as the cause says; the pods of the
    attempt that failed go but for those kept_pods keeps for their logs."""
    if (cause := s.cause) is None:
        return None
    d, kept = s.active, kept_pods(s.job, s.group, s.active.attempt + 1)
    return replace(d, attempt=d.attempt + 1, restarts=d.restarts + 1, counted_restarts=d.counted_restarts + cause.counted,
                   phase=Phase.RESTARTING, reason=cause.reason, message=cause.message, restarted=cause,
                   delete_pods=[podinfo.name(p) for p in s.group.live if podinfo.name(p) not in kept])


# First answer wins: a finished job stays so, a suspended one waits; time and a bad configuration
# end the job whatever its pods did; the budget is checked before anything would spend it.
POLICIES: tuple[Callable[[Seen], Decision | None], ...] = (
    keep_finished, suspend, deadline, bad_configuration, budget, replace_lost, restart_group)


def _steady(s: Seen, alone: list[Replacement] | None = None) -> Decision:
    """No policy ended or restarted the group: the pods to delete and create, and the phase they show."""
    job, now, d, numbers, current = s.job, s.now, s.active, dict(s.numbers), dict(s.current)
    if alone:
        # Charged as the group restart would have been (a deletion counts, the cluster's doing is
        # free); the survivors' in-place restart it causes is part of it (inplace.update), not another.
        d = replace(d, replaced=alone, restarts=d.restarts + len(alone),
                    counted_restarts=d.counted_restarts + sum(a.failure.counted for a in alone))
        numbers.update({a.rank: a.number for a in alone})
        current = {r: p for r, p in current.items() if r not in {a.rank for a in alone}}
    d = _children(job, s.group, s.this, d, current, numbers, now)
    phases = [podinfo.phase(current[r]) for r in sorted(current)]
    if len(current) == job.spec.nodes and all(ph == "Succeeded" for ph in phases):
        return _finish(s, replace(d, phase=Phase.SUCCEEDED, reason=Reason.SUCCEEDED,
                                  message=f"all {job.spec.nodes} node(s) exited 0"))
    d = _phase(job, d, current, numbers, s.prev)
    d = replace(d, start_errors=start_errors([current[r] for r in sorted(current)]))
    if d.start_errors:
        d = _start_error(job, d, s.prev, now)
        if d.phase is Phase.FAILED:
            return _finish(s, d)
    # Pods the scheduler cannot place: a condition (not a failure) after the timeout.
    stuck = [u for u in (podinfo.unschedulable_since(p) for p in current.values()) if u]
    if stuck:
        waited = (now - min((u[0] for u in stuck if u[0] is not None), default=now)).total_seconds()
        if waited >= s.config.unschedulable_timeout:
            d = replace(d, unschedulable=stuck[0][1] or "the scheduler cannot place the pods")
        else:
            d = replace(d, requeue_after=_sooner(d.requeue_after, s.config.unschedulable_timeout - waited))
    return d


def _children(job: JobSpec, group: Group, this: Attempt, d: Decision, current: dict[int, dict[str, Any]],
              numbers: Mapping[int, int], now: dt.datetime) -> Decision:
    """Remove stale pods; create the missing ranks once no pod of an older attempt is left.

    Per-name readiness is not enough: a master still terminating serves its rendezvous store on the
    job's DNS name, and a new worker that reaches it joins the old attempt (seen: a new rank 1
    "finished" with the dying master while the new master waited in rendezvous). A failed attempt's
    ended pods stay for their logs (kept_pods); ended, they hold up nothing. So do this attempt's
    replaced pods that ended Failed (an evicted pod); a lost one still terminating holds up its
    replacement: while it exists the headless Service (it publishes not-ready addresses) may
    resolve its hostname, which its replacement takes over."""
    # A set built once: a 10,000-pod job made this quadratic (9 s per pass at 5,000 pods).
    current_names = {podinfo.name(c) for c in current.values()}
    kept = kept_pods(job, group, d.attempt) | {podinfo.name(p) for p in this.pods if podinfo.phase(p) == "Failed"}
    d = replace(d, delete_pods=[podinfo.name(p) for p in group.live
                                if podinfo.name(p) not in current_names and podinfo.name(p) not in kept])
    if len(current) == job.spec.nodes:
        d = replace(d, launched_attempt=d.attempt)
    blocking = [when for when in (_leftover_until(p, now) for p in group.pods if podinfo.name(p) not in current_names)
                if when is not None]
    if blocking:
        return replace(d, requeue_after=_sooner(d.requeue_after, max(0.1, (min(blocking) - now).total_seconds())))
    create = [r for r in range(job.spec.nodes)
              if r not in current and pod_name(job.name, r, d.attempt, numbers.get(r, 0)) not in group.names]
    return replace(d, create_ranks=create, replacement={r: numbers[r] for r in create if numbers.get(r)})


def _phase(job: JobSpec, d: Decision, current: dict[int, dict[str, Any]], numbers: Mapping[int, int],
           prev: dict[str, Any]) -> Decision:
    """The phase the pods show while the group neither ended nor restarts."""
    if len(current) == job.spec.nodes and all(podinfo.phase(p) in ("Running", "Succeeded") for p in current.values()):
        d = replace(d, phase=Phase.RUNNING, reason=Reason.RUNNING, message=f"all {job.spec.nodes} node(s) running")
    elif d.phase is Phase.RUNNING and (waiting := [r for r in sorted(numbers) if podinfo.phase(current.get(r) or {})
                                                   != "Running"]):
        # The others keep their pods and wait in the rendezvous: the job still runs.
        names = ", ".join(pod_name(job.name, r, d.attempt, numbers[r]) for r in waiting)
        d = replace(d, reason=Reason.REPLACING_POD, message=f"replacing the lost pod(s) of rank(s) {waiting} with {names}")
    elif d.phase is Phase.RUNNING:
        d = replace(d, phase=Phase.PENDING)  # cannot really happen (pods never go back to Pending); stay honest
    elif d.phase is not Phase.RESTARTING and d.reason != Reason.RESUMED:
        d = replace(d, phase=Phase.PENDING, reason=Reason.CREATED, message=f"waiting for {job.spec.nodes} node(s) to start")
    refused = condition(prev, Cond.FAILED_CREATE_POD)
    if refused and d.create_ranks and d.phase is Phase.PENDING:
        # The API server refused a pod (status.create_refused); say so until every pod exists.
        d = replace(d, reason=Cond.FAILED_CREATE_POD.value, message=str(refused.get("message") or ""))
    return d


def kept_pods(job: JobSpec, group: Group, attempt: int) -> set[str]:
    """Names of the pods of earlier attempts that stay for inspection while `attempt` is current:
    the Failed ones (they hold no node resources) of the last spec.failurePolicy.keepFailedAttempts
    attempts. Pods still running or pending when their attempt failed are deleted with it (that
    frees their GPUs), so a running job has at most one pod per rank that has not ended; so is a
    rank that had exited 0, whose log tells nothing of the failure, and which a gang scheduler
    counting finished members (Volcano) could count towards the next attempt's gang."""
    return {podinfo.name(p) for p in group.between(attempt - job.keep_failed_attempts, attempt)
            if podinfo.phase(p) == "Failed" and not podinfo.terminating(p)}


# A terminating pod still there this long after its grace period ended is on a node whose kubelet
# stopped reporting: it no longer holds up the next attempt (its processes, if any still run,
# are cut off with their node).
LEFTOVER_SLACK = dt.timedelta(seconds=30)


def _leftover_until(pod: dict[str, Any], now: dt.datetime) -> dt.datetime | None:
    """Until when a pod of another attempt holds up the creation of new pods (None: it does not).
    A pod not yet terminating is deleted this pass; wait for it like for any other. An ended pod
    (Succeeded, Failed) holds up nothing: its processes, the old master's rendezvous store among
    them, are gone, and the headless Service no longer lists it."""
    if podinfo.ended(pod):
        return None
    gone_by = podinfo.gone_by(pod)
    if gone_by is None:
        return now + LEFTOVER_SLACK
    until = gone_by + LEFTOVER_SLACK
    return until if until > now else None


def _start_error(job: JobSpec, d: Decision, prev: dict[str, Any], now: dt.datetime) -> Decision:
    """Name the first stuck container in the job's reason; Failed when podStartTimeoutSeconds is over.

    The clock is the ContainersNotStarting condition's lastTransitionTime: it survives operator
    restarts and resets once every container started."""
    err = d.start_errors[0]
    timeout = job.spec.failure_policy.pod_start_timeout_seconds
    since = _iso((condition(prev, Cond.CONTAINERS_NOT_STARTING) or {}).get("lastTransitionTime")) or now
    waited = max(0.0, (now - since).total_seconds())
    if timeout is not None and waited >= timeout:
        return replace(d, phase=Phase.FAILED, reason=err.reason, message=f"{err.describe()} (for {waited:.0f}s; "
                       f"spec.failurePolicy.podStartTimeoutSeconds={timeout})")
    if d.phase is Phase.PENDING:
        policy = (f"failing after spec.failurePolicy.podStartTimeoutSeconds={timeout}" if timeout is not None
                  else "waiting (set spec.failurePolicy.podStartTimeoutSeconds to fail instead)")
        d = replace(d, reason=err.reason, message=f"{err.describe()}; {policy}")
    return d if timeout is None else replace(d, requeue_after=_sooner(d.requeue_after, timeout - waited))


def _finish(s: Seen, d: Decision) -> Decision:
    """Terminal phase: completion time, cleanPodPolicy deletes, TTL."""
    done = d.completion_time or s.now
    ttl = s.job.spec.ttl_seconds_after_finished
    left = None if ttl is None else ttl - (s.now - done).total_seconds()
    return replace(d, completion_time=done, delete_pods=_finished_deletes(s.job, s.group.live), create_ranks=[],
                   requeue_after=left if left is not None and left > 0 else None,
                   delete_job=d.delete_job or (left is not None and left <= 0))
