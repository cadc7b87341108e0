"""Restarts in place, as status: the history of a job's restarts and the `Restarting` condition (pure).

A worker that dies is restarted where it is by torchrun's agent in its pod (and every other pod's
agent restarts its workers through the c10d rendezvous); the agent exports each failure on the
pod's metrics endpoint (contract.WORKER_FAILURE) and each worker process its first step
(contract.FIRST_STEP_TIMESTAMP). From one scrape's samples and the last status this module says:

- `status.restartHistory`: one entry per restart, newest last (HISTORY_LIMIT kept): kind `InPlace`
  (attempt, the pod's worker start that failed, rank, pod, node, exit code, signal, with
  failurePolicy.logTailInStatus the error's first line, the step the rank had finished; reason
  Stalled and the stall's line, always, for a worker its agent killed for a stall
  (failurePolicy.restartOnHang)), kind `Replace` (a lost pod of a rank recreated alone: rank, the
  lost pod, its node, the new pod, reason; the survivors' in-place restarts it causes are its
  `alsoFailed`, not restarts of their own) or kind `Group` (the attempt that ended, reason, the
  newest step scraped); once every rank stepped again after it, `resumedFromStep`, `stepsLost` and
  `recoverySeconds` (failure to the group's first step, on the pods' clocks);
- `status.inPlaceRestarts`: how many in-place restarts the job made, charged to
  failurePolicy.maxRestarts with the group restarts, never fewer than the pods' agents prove
  (`proven`: a status edit cannot grant restarts);
- `Restarting`: True while an in-place restart has not stepped again;
- `recoveries`: what the operator's recovery metrics observe, once per restart.

The samples are decisions/samples.RankSample's (read by attribute).
"""
from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ddpjob_api import contract
from ddpjob_api.contract import STALL_ERROR_RE
from ddpjob_api.phases import Reason, Recovery, RestartReason
from ddpjob_operator.base.objmeta import format_time
from ddpjob_operator.decisions import stacks
from ddpjob_operator.decisions.redact import redact
from ddpjob_operator.decisions.samples import ABSURD as MAX_STEP  # a step label beyond it is not believed

HISTORY_LIMIT = 20       # status.restartHistory entries kept (newest last)
MESSAGE_CHARS = 200
ALSO_LIMIT = 16          # peers' failures kept per in-place restart
_SIGNAL = re.compile(r"^SIG[A-Z0-9]{2,10}$")
# Reasons of the Restarting condition for an in-place restart (a group restart's is its cause).
# ... and for a lost pod replaced alone (the job's reason too, until the replacement runs).
STALLED = RestartReason.STALLED.value  # an entry's reason: the pod's agent killed the worker for a stall


def as_int(value: Any, default: int = 0) -> int:
    try:
        return int(str(value))
    except ValueError:
        return default


def _open(entry: Mapping[str, Any], kinds: tuple[str, ...] = (Recovery.IN_PLACE,)) -> bool:
    """A restart (in place unless `kinds` says) that has not stepped again and whose attempt still
    runs; a Group entry written before group recoveries were measured (no failedAt) never is."""
    return (entry.get("kind") in kinds and "failedAt" in entry and "recoverySeconds" not in entry
            and not entry.get("superseded"))


def is_open(entry: Mapping[str, Any]) -> bool:
    """A restart of any kind that has not stepped again, and whose attempt has not ended since."""
    return _open(entry, (Recovery.IN_PLACE, Recovery.GROUP, Recovery.REPLACE))


def key(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """What tells one restart's entry from another's (the same restart in two statuses has the same)."""
    return (entry.get("kind"), entry.get("attempt"), entry.get("pod"), entry.get("restart"), entry.get("rank"))



def observed(ranks: Mapping[int, Any], *, attempt: int, with_log: bool) -> list[dict[str, Any]]:
    """History entries for the failures the pods report that their agents restarted in place
    (a failure with the pod's budget spent fails the pod instead: a group restart records it)."""
    out = []
    for rank, sample in sorted(ranks.items()):
        for f in getattr(sample, "worker_failures", None) or []:
            if f.get("restarted") != "true":
                continue
            entry: dict[str, Any] = {
                "kind": Recovery.IN_PLACE, "attempt": attempt, "restart": as_int(f.get("restart")), "rank": rank,
                "pod": sample.pod or "", "exitCode": as_int(f.get("exit_code"), -1),
                "time": format_time(dt.datetime.fromtimestamp(float(f["time"]), dt.timezone.utc)),
                "failedAt": float(f["time"]),
            }
            if sample.node:
                entry["node"] = sample.node
            if 0 <= as_int(f.get("step"), -1) <= MAX_STEP:
                entry["stepAtFailure"] = as_int(f.get("step"))
            if _SIGNAL.match(str(f.get("signal") or "")):
                entry["signal"] = f["signal"]
            error = redact(str(f.get("error") or "")).strip()[:MESSAGE_CHARS]
            if STALL_ERROR_RE.match(error):
                # The agent's own words in a fixed form (no user's text): shown without logTailInStatus.
                entry["reason"], entry["message"] = STALLED, error
            elif with_log and error:
                entry["message"] = error
            out.append(entry)
    return out


def proven(ranks: Mapping[int, Any] | None, *, replaced: int = 0) -> int:
    """The in-place restarts the pods' own agents prove, which a status edit cannot change: an
    agent that restarted its pod's workers after their start R (the failure's `restart` label, the
    marker's R) went through R+1 rendezvous rounds, and in each every pod of the attempt restarted
    its workers. `replaced`: the lost pods replaced alone in the attempt, each of which took the
    survivors through a round too (charged as its replacement, not in place). A lower bound of
    status.inPlaceRestarts (which also counts earlier attempts'); a label beyond MAX_STEP is not
    believed."""
    starts = [as_int(f.get("restart"), -1) + 1 for s in (ranks or {}).values()
              for f in getattr(s, "worker_failures", None) or []
              if f.get("restarted") == "true" and as_int(f.get("restart"), -1) < MAX_STEP]
    return max(0, max(starts, default=0) - replaced)


def recovery(entry: Mapping[str, Any], ranks: Mapping[int, Any]) -> tuple[int, float] | None:
    """(step resumed from, seconds from the failure to the group's first step) once every rank
    reporting has a worker that stepped after the failure (a replacement: its new pod's among
    them); None before."""
    t = float(entry.get("failedAt") or 0)
    if entry.get("kind") == Recovery.REPLACE and not any(getattr(s, "pod", None) == entry.get("newPod") for s in ranks.values()):
        return None
    # A per-step replacement (mode perStep) is the only group that started again: the others never stopped.
    firsts = [(s.first_step_timestamp, s.resumed_from_step) for s in ranks.values()
              if not entry.get("mode") or getattr(s, "pod", None) == entry.get("newPod")]
    if not firsts or any(ts is None or ts <= t for ts, _ in firsts):
        return None
    return min(int(step or 0) for _, step in firsts), round(max(ts for ts, _ in firsts) - t, 3)


def _group_failure(ranks: Mapping[int, Any], prev_status: Mapping[str, Any], now: dt.datetime,
                   pod_steps: Sequence[int] = ()) -> dict[str, Any]:
    """When the ended attempt failed and the step it had reached, as well as this pass knows:
    the earliest failure an agent reported with its pod's budget spent, else now (the pass that
    saw the pod fail, was deleted or lost); the newest step its ranks reported (this scrape, the
    failed pods' termination messages: `pod_steps`), else progress's."""
    spent = [f for s in ranks.values() for f in getattr(s, "worker_failures", None) or [] if f.get("restarted") == "false"]
    out: dict[str, Any] = {"failedAt": min([float(f["time"]) for f in spent] + [now.timestamp()])}
    steps = [s.step for s in ranks.values() if s.step is not None] + [
        as_int(f.get("step"), -1) for f in spent if 0 <= as_int(f.get("step"), -1) <= MAX_STEP] + [
        step for step in pod_steps if 0 <= step <= MAX_STEP]
    step = max(steps, default=(prev_status.get("progress") or {}).get("step"))
    if step is not None:
        out["stepAtFailure"] = int(step)
    return out


@dataclass
class Update:
    """What one pass found about restarts."""

    history: list[dict[str, Any]]
    in_place_restarts: int
    new: list[dict[str, Any]] = field(default_factory=list)        # in-place restarts first seen now
    recovered: list[dict[str, Any]] = field(default_factory=list)  # entries that stepped again now

    @property
    def pending(self) -> dict[str, Any] | None:
        """The newest in-place restart or replacement that has not stepped again (None: none)."""
        return next((e for e in reversed(self.history) if _open(e, (Recovery.IN_PLACE, Recovery.REPLACE))), None)


def _precedes(entry: Mapping[str, Any], head: Mapping[str, Any]) -> bool:
    """True when `entry` rather than `head` is the cause of their one in-place restart: a worker a
    signal ended before one that failed by itself; of two ranks their agents killed for a stall,
    the one whose last step is older (it stopped first, its peers went on to the next collective;
    on a loaded node its agent may still kill later than theirs); else the earlier failure."""
    if ("signal" in entry) != ("signal" in head):
        return "signal" in entry
    mine, theirs = (contract.stall_step(e.get("message")) if e.get("reason") == STALLED else None
                    for e in (entry, head))
    if mine is not None and theirs is not None and mine != theirs:
        return mine < theirs
    return entry["failedAt"] < head["failedAt"]


def training_without(entry: Mapping[str, Any], ranks: Mapping[int, Any]) -> set[str] | None:
    """The pods training again without a replacement not yet among them (an elastic job's
    rendezvous completed with fewer nodes after its last call): every rank reporting, the new
    pod's aside, stepped after the loss. None while that is not so (they wait for it, or it joined)."""
    t = float(entry.get("failedAt") or 0)
    others = [s for s in ranks.values() if getattr(s, "pod", None) != entry.get("newPod")]
    if entry.get("kind") != Recovery.REPLACE or len(others) < len(ranks) or not others:
        return None
    # A per-step job's other groups never restarted: they stepped after the loss, without it.
    stamp = "last_step_timestamp" if entry.get("mode") else "first_step_timestamp"
    if any(getattr(s, stamp, None) is None or getattr(s, stamp) <= t for s in others):
        return None
    return {str(s.pod) for s in others}


def replace_entry(replacement: Any, *, attempt: int, ranks: Mapping[int, Any] | None,
                  prev_status: Mapping[str, Any], now: dt.datetime) -> dict[str, Any]:
    """The history entry of a lost pod replaced alone (a lifecycle.Replacement, read by attribute)."""
    entry = {"kind": Recovery.REPLACE, "attempt": attempt, "rank": replacement.rank, "pod": replacement.old_pod,
             "replacement": replacement.number, "newPod": replacement.new_pod, "reason": replacement.failure.reason,
             "message": replacement.failure.message[:MESSAGE_CHARS], "time": format_time(now),
             **_group_failure(ranks or {}, prev_status, now)}
    if replacement.node:
        entry["node"] = replacement.node
    if getattr(replacement, "mode", None):
        entry["mode"] = replacement.mode  # perStep: the other groups kept training, no rendezvous, no restart
    return entry


def _absorb(head: dict[str, Any], other: dict[str, Any]) -> None:
    """`other` failed in `head`'s restart: the earliest time, the newest step, its rank among alsoFailed."""
    head["failedAt"] = min(head["failedAt"], other["failedAt"])  # the group failed at the first one seen
    if "stepAtFailure" in other:  # the newest step any of them had finished
        head["stepAtFailure"] = max(other["stepAtFailure"], head.get("stepAtFailure", 0))
    also = [a for a in (other.pop("alsoFailed", None) or [])]
    head["alsoFailed"] = (list(head.get("alsoFailed") or []) + [
        {k: other[k] for k in ("rank", "pod", "restart", "exitCode", "attempt") if k in other}] + also)[:ALSO_LIMIT]


def update(prev_status: Mapping[str, Any], *, attempt: int, ranks: Mapping[int, Any] | None, with_log: bool,
           group: tuple[int, str, str] | None, now: dt.datetime, replaced: list[dict[str, Any]] = (),  # type: ignore[assignment]
           replacement_rounds: int = 0, group_steps: Sequence[int] = (),
           window: float = contract.STARTUP_HANG_TIMEOUT) -> Update:
    """The restart history and count after this pass. `ranks`: this scrape's samples (None: no
    scrape); `group`: (the attempt that ended, reason, message) when this pass restarts the group;
    `replaced`: replace_entry's of the lost pods this pass replaces alone; `replacement_rounds`: the
    rounds lost pods took the survivors through (Decision.replacement_rounds), left out of `proven`;
    `group_steps`: the steps the ended attempt's failed pods wrote in their termination messages
    (contract.failure_step), which outlive the pods' last scrape; `window`: the job's hang timeout,
    how long before a failure the ranks' stack captures still tell its culprit (`culprit`)."""
    history = [dict(e) for e in prev_status.get("restartHistory") or []]
    count = as_int(prev_status.get("inPlaceRestarts"))
    known = {key(e) for e in history} | {key({**a, "kind": Recovery.IN_PLACE}) for e in history for a in e.get("alsoFailed") or []}
    up = Update(history=history, in_place_restarts=count)
    for entry in map(dict, replaced):
        # The survivors' workers fail on their lost peer; an in-place restart seen before the loss
        # was (the scrape came first) is that, not a restart of its own: folded in, uncharged.
        for earlier in [e for e in history if _open(e) and e.get("attempt") == attempt]:
            history.remove(earlier)
            up.in_place_restarts = max(0, up.in_place_restarts - 1)
            _absorb(entry, earlier)
        history.append(entry)
    # A pod's agent reports its failures for as long as it lives; those before this attempt's last
    # recovery are settled, whether or not their entries are still kept.
    settled = max((float(e.get("failedAt") or 0) + float(e["recoverySeconds"]) for e in history
                   if e.get("attempt") == attempt and "recoverySeconds" in e), default=0.0)
    fresh = [e for e in observed(ranks or {}, attempt=attempt, with_log=with_log)
             if key(e) not in known and e["failedAt"] > settled]
    for entry in sorted(fresh, key=lambda e: e["failedAt"]):
        known.add(key(entry))
        head: dict[str, Any] | None = next(
            (e for e in reversed(history) if _open(e, (Recovery.IN_PLACE, Recovery.REPLACE)) and e.get("attempt") == attempt), None)
        if head is None:
            up.in_place_restarts += 1
            history.append(entry)
            up.new.append(entry)
            continue
        # One restart until every rank steps again: its peers' workers fail with it (a collective
        # with a dead peer), and their agents report those too. The cause is a worker a signal
        # ended (an OOM kill, a segfault, the watchdog's kill of a stalled rank: a peer's collective
        # never ends its worker so), else the earliest failure. Each time is when that pod's agent
        # saw the failure, so a peer's exception may be seen before the killed worker's death.
        if head["kind"] == Recovery.IN_PLACE and _precedes(entry, head):
            cause, other = entry, head
            history[history.index(head)] = cause
            if head in up.new:
                up.new[up.new.index(head)] = cause
        else:
            cause, other = head, entry
        _absorb(cause, other)
    for entry in history:
        # The rank the stacks blame (decisions/stacks.py), told once the captures are there: before
        # the recovery below closes the entry, which the same scrape may show (a fast restart).
        if entry.get("kind") == Recovery.IN_PLACE and entry.get("attempt") == attempt and "culprit" not in entry and _open(entry):
            blamed = stacks.of_restart(ranks or {}, restart=as_int(entry.get("restart")),
                                       failed_at=float(entry["failedAt"]), window=window)
            if blamed is not None:
                entry["culprit"] = blamed.entry(ranks or {})
    for entry in history:
        if not is_open(entry):
            continue
        # An in-place restart steps again in its own attempt, a group restart in the next one;
        # the last scrape of an attempt that ends now still counts (passes follow steps lazily).
        ours = entry["attempt"] + (entry["kind"] == Recovery.GROUP) == attempt
        found = recovery(entry, ranks or {}) if ours else None
        if found is None:
            if not ours or group is not None:
                entry["superseded"] = True  # that attempt ended (a group restart) before it stepped again
            continue
        entry["resumedFromStep"], entry["recoverySeconds"] = found
        if "stepAtFailure" in entry:
            entry["stepsLost"] = max(0, entry["stepAtFailure"] - found[0])
        if entry["kind"] in (Recovery.IN_PLACE, Recovery.REPLACE):
            up.recovered.append(entry)
    # Not below what the agents prove: an edit that lowered the count (or dropped the history
    # whose entries are counted once) grants no restart.
    up.in_place_restarts = max(up.in_place_restarts, proven(ranks, replaced=replacement_rounds))
    if group is not None:
        ended, reason, message = group
        history.append({"kind": Recovery.GROUP, "attempt": ended, "reason": reason, "message": message[:MESSAGE_CHARS],
                        "time": format_time(now), **_group_failure(ranks or {}, prev_status, now, group_steps)})
    up.history = history[-HISTORY_LIMIT:]
    return up


def newly_recovered(prev_status: Mapping[str, Any], status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The entries of the restarts that stepped again between two statuses: in
    status.restartHistory with their recovery, and not so in prev's."""
    done = {key(e) for e in prev_status.get("restartHistory") or [] if "recoverySeconds" in e}
    return [e for e in status.get("restartHistory") or [] if "recoverySeconds" in e and key(e) not in done]


def stopped_training(entry: Mapping[str, Any]) -> bool:
    """Whether a restart stopped the job's training until it recovered: every kind but a per-step
    job's replacement (mode perStep), which the other replica groups trained through."""
    return not entry.get("mode")


def recoveries(prev_status: Mapping[str, Any], status: Mapping[str, Any], *,
               training_stopped: bool = False) -> list[tuple[str, float, int | None]]:
    """(kind, recoverySeconds, stepsLost or None) of each restart that stepped again between two
    statuses (newly_recovered); with `training_stopped`, only those that stopped the job's
    training (the goodput's recovering). The status is written before the metrics record a pass,
    so a rescrape, a repeated pass or a restarted operator (its prev already holds the recovery)
    observes nothing twice."""
    return [(str(e["kind"]), float(e["recoverySeconds"]), e.get("stepsLost")) for e in newly_recovered(prev_status, status)
            if stopped_training(e) or not training_stopped]


def describe(entry: Mapping[str, Any]) -> str:
    """One line naming an in-place restart (rank, pod, node, exit code, signal, error) or a replacement."""
    where = f"pod {entry.get('pod')}" + (f" on node {entry['node']}" if entry.get("node") else "")
    if entry.get("kind") == Recovery.REPLACE:
        return f"rank {entry.get('rank')} ({where}) was lost ({entry.get('reason')}): replaced alone by pod {entry.get('newPod')}"
    how = f"exit code {entry.get('exitCode')}" + (f" ({entry['signal']})" if entry.get("signal") else "")
    blamed = f"; stacks: {stacks.describe(entry['culprit'])}" if entry.get("culprit") else ""
    if entry.get("reason") == STALLED:
        return f"rank {entry.get('rank')} ({where}) {entry.get('message')}: its agent killed the worker{blamed}"
    text = f"the worker of rank {entry.get('rank')} ({where}) failed with {how}"
    return text + (f": {entry['message']}" if entry.get("message") else "") + blamed


def restarting_message(entry: Mapping[str, Any], *, used: int, max_restarts: int) -> str:
    """What an in-place restart first seen says (the RestartingInPlace event, the local runner's log)."""
    return f"{describe(entry)}; restarting in place ({used}/{max_restarts} of failurePolicy.maxRestarts used)"


def recovered_message(entry: Mapping[str, Any]) -> str:
    """What a restart that stepped again says (the RestartedInPlace, PodReplaced event; the local
    runner's log): the step resumed from, the recovery time, what failed and the steps lost."""
    kind = entry.get("kind")
    what = (f"rank {entry.get('rank')}'s pod {entry.get('pod')} was replaced by {entry.get('newPod')}" if kind == Recovery.REPLACE
            else f"the worker of rank {entry.get('rank')} (pod {entry.get('pod')}) failed" if kind == Recovery.IN_PLACE
            else f"the group of attempt {entry.get('attempt')} restarted ({entry.get('reason')})")
    lost = f" ({entry['stepsLost']} step(s) lost)" if entry.get("stepsLost") is not None else ""
    return f"stepping again from step {entry.get('resumedFromStep')} {entry.get('recoverySeconds'):g}s after {what}{lost}"


def restarting(up: Update, *, budget_used: int, max_restarts: int) -> tuple[bool, str, str] | None:
    """The `Restarting` condition for in-place restarts: (status, reason, message); None when
    this job never restarted in place (the group restart's condition stands alone)."""
    pending = up.pending
    budget = f"({budget_used}/{max_restarts} of failurePolicy.maxRestarts used)"
    if pending is not None and pending["kind"] == Recovery.REPLACE:
        others = ("the other replica groups train on without it" if pending.get("mode")
                  else "the other pods' workers restart in place and wait for it")
        return True, Reason.REPLACING_POD, f"{describe(pending)}; {others} {budget}"
    if pending is not None:
        return True, Reason.RESTARTING_IN_PLACE, f"{describe(pending)}; restarting every pod's workers in place {budget}"
    done = next((e for e in reversed(up.history) if e.get("kind") in (Recovery.IN_PLACE, Recovery.REPLACE) and "recoverySeconds" in e), None)
    if done is None:
        return None
    return False, Reason.POD_REPLACED if done["kind"] == Recovery.REPLACE else Reason.RESTARTED_IN_PLACE, (
        f"{'replaced' if done['kind'] == Recovery.REPLACE else 'restarted in place'}: stepping again from step "
        f"{done['resumedFromStep']} {done['recoverySeconds']:g}s after {describe(done)}")
