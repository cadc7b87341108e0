"""Where a job's wall time went (pure): one ledger per job, every second from its creation to its
end in exactly one category (contract.GOODPUT_CATEGORIES; docs/goodput.md says what each holds).
The operator keeps it in status.goodput (decisions/status.py), the local runner in its summary
(cli local.py); both call `advance`.

A pass accounts the time since the last account that was kept (`accounting.asOf`) and never
further back: what a later pass cannot see again (an ended attempt's pods and counters, a restart
fallen out of the 20 restartHistory keeps) is in the running totals the ledger carries
(`accounting`). So the ledger follows from the last written one and what one pass observes: a pass
whose status is not written changes nothing, and a later pass accounts the same seconds, for every
boundary is a timestamp (a pod's PodScheduled, the ranks' first step, a failure), never the time a
pass happened to run (but for a suspension, which the pass that sees spec.suspend acts on at once).

- **Modes** tile the wall time: suspended (the phase last written), else the current attempt's
  queued until all its pods are scheduled, starting until its first step, then running. An attempt
  that a group restart began is recovering instead until its first step (`restarting`).
- **Overlays** are cut out of the running time: recovering (status.restartHistory: each restart's
  failedAt to its recovery, of which a group restart's part in the new attempt's start is already
  its mode; not a per-step job's replacement, which the other groups train through), stalled (a
  stall's time without progress until it was detected), checkpointing and evaluating (rank 0's
  own counters, contract.GOODPUT_SECONDS), recomputing (the restarts' stepsLost, counted when each
  steps again, x the step time last measured); training is what is left.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ddpjob_api import contract
from ddpjob_api.contract import GOODPUT_CATEGORIES
from ddpjob_operator.base import podinfo
from ddpjob_operator.base.objmeta import parse_time
from ddpjob_operator.decisions import inplace
from ddpjob_operator.decisions.progress import human_duration

MODES = ("queued", "starting", "running")
# What the modes added up (they tile [creation, asOf)); `restarting`: a restarted attempt's start.
TILES = ("queued", "starting", "running", "suspended", "restarting")
# Overlays of ended restarts, stalls and attempts, carried because nothing shows them again.
CARRIED = ("recovered", "stepsLost", "stalled", "checkpointing", "evaluating")
# The current attempt's rank counters at its latest scrape (they restart at 0 with its pods).
RANK_COUNTED = {"checkpointing": "attemptCheckpointing", "evaluating": "attemptEvaluating"}
# A step time is measured once the ranks timed this many steps (a new attempt's first ones are slow).
MIN_TIMED_STEPS = 5


@dataclass(frozen=True)
class Observed:
    """What one pass knows of the job's time: Unix seconds, on the clocks that reported them."""

    now: float
    created: float                      # the job's creation (the local runner: its start)
    ended: float | None = None          # a finished job's completion: no time after it
    suspended: bool = False             # the time since the last account was suspended (the phase written)
    attempt: int = 0                    # the current attempt
    restarted: bool = False             # a group restart began it (its start is recovering)
    scheduled_at: float | None = None   # every pod of the current attempt scheduled
    stepped_at: float | None = None     # the current attempt's first step
    history: Sequence[Mapping[str, Any]] = ()              # status.restartHistory after this pass
    recovered: Sequence[tuple[str, float, Any]] = ()       # restarts that stopped training and stepped again now
    #                                                        (inplace.recoveries, training_stopped)
    stalls: Sequence[float] = ()        # seconds without progress of the stalls restarted now
    stall_since: float | None = None    # an open stall's last progress (the Stalled condition holds)
    ranks: Mapping[str, float] | None = None  # the current attempt's rank counters (rank_counters)
    step_seconds: float | None = None   # the step time now (step_seconds; None: not measured)


def _num(value: Any, default: float = 0.0) -> float:
    """A finite number >= 0, else `default` (a status edit cannot put NaN or a negative into sums)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) and v >= 0 else default


def _open_seconds(history: Sequence[Mapping[str, Any]], at: float) -> float:
    """Seconds of the restarts that stopped training and have not stepped again by `at`, each from
    its failure (a per-step job's replacement stops no one: the other groups train on)."""
    return sum(max(0.0, at - _num(e.get("failedAt"), at)) for e in history
               if inplace.is_open(e) and inplace.stopped_training(e))


def advance(prev: Mapping[str, Any] | None, obs: Observed) -> dict[str, Any]:
    """status.goodput after this pass, from the last one kept (`prev`, None: none yet)."""
    kept = (prev or {}).get("accounting") or {}
    acc = {k: _num(kept.get(k)) for k in (*TILES, *CARRIED, *RANK_COUNTED.values(), "stepSeconds")}
    start = max(obs.created, _num(kept.get("asOf"), obs.created)) if kept else obs.created
    attempt = int(_num(kept.get("attempt"), obs.attempt)) if kept else obs.attempt
    mode: str = kept["mode"] if kept.get("mode") in MODES else MODES[0]
    after_restart = bool(kept.get("afterRestart")) if kept else obs.restarted
    end = max(start, obs.now if obs.ended is None else min(obs.now, obs.ended))

    def add(m: str, seconds: float) -> None:
        if seconds > 0:
            acc["restarting" if after_restart and m != "running" else m] += seconds

    t = start
    if obs.suspended:
        acc["suspended"] += end - t
    else:
        # The same attempt's boundaries split the time; an attempt that ended since (this pass
        # restarts the group) spent it in the mode it was last seen in.
        for boundary, following in ((obs.scheduled_at, "starting"), (obs.stepped_at, "running")):
            if attempt == obs.attempt and boundary is not None and MODES.index(mode) < MODES.index(following):
                upto = min(max(boundary, t), end)
                add(mode, upto - t)
                t = upto
                if boundary <= end:
                    mode = following
        add(mode, end - t)
    if obs.ranks is not None:  # the latest scrape is of the attempt last accounted
        for category, key in RANK_COUNTED.items():
            acc[key] = max(acc[key], _num(obs.ranks.get(category)))
    if obs.attempt != attempt:
        for category, key in RANK_COUNTED.items():
            acc[category] += acc[key]
            acc[key] = 0.0
        # The pass that begins an attempt (a restart, a resume) has none of its pods yet: what it
        # scraped is the ended attempt's.
        attempt, mode, after_restart = obs.attempt, MODES[0], obs.restarted
    if obs.step_seconds:
        acc["stepSeconds"] = _num(obs.step_seconds)
    for _kind, took, lost in obs.recovered:
        acc["recovered"] += _num(took)
        acc["stepsLost"] += _num(lost)
    acc["stalled"] += sum(_num(s) for s in obs.stalls)
    # An open stall counts until it is detected and restarted (its restart's own seconds then) or
    # steps again; no stall is counted while a restart is open (that time is recovering).
    stalled_since = _num(kept.get("stallSince"), -1.0)
    since = obs.stall_since

    def restarted_for(at: float) -> bool:
        return any(e.get("reason") == inplace.STALLED and _num(e.get("failedAt")) >= at for e in obs.history)

    if since is not None and (obs.stalls or restarted_for(since) or any(inplace.is_open(e) for e in obs.history)):
        since = None
    if stalled_since >= 0 and since is None and not obs.stalls and not restarted_for(stalled_since):
        acc["stalled"] += max(0.0, end - stalled_since)

    # The ledger at `end`: the overlays cut out of the running time, in this order, training the rest.
    running = acc["running"]
    recovering = acc["restarting"] + min(max(0.0, acc["recovered"] + _open_seconds(obs.history, end)
                                             - acc["restarting"]), running)
    running -= recovering - acc["restarting"]
    cut: dict[str, float] = {}
    for category, total in (("stalled", acc["stalled"] + (max(0.0, end - since) if since is not None else 0.0)),
                            ("checkpointing", acc["checkpointing"] + acc["attemptCheckpointing"]),
                            ("evaluating", acc["evaluating"] + acc["attemptEvaluating"]),
                            ("recomputing", acc["stepsLost"] * acc["stepSeconds"])):
        cut[category] = min(total, running)
        running -= cut[category]
    seconds = {"queued": acc["queued"], "starting": acc["starting"], "training": running,
               "recovering": recovering, "suspended": acc["suspended"], **cut}
    wall = sum(acc[k] for k in TILES)
    accounting: dict[str, Any] = {"asOf": round(end, 3), "attempt": attempt, "mode": mode, "afterRestart": after_restart,
                                  **{k: round(v, 3) for k, v in acc.items()}}
    if since is not None:
        accounting["stallSince"] = round(since, 3)
    ratio = min(1.0, max(0.0, seconds["training"] / wall)) if wall > 0 else 0.0
    return {"ratio": round(ratio, 4), "display": f"{100 * ratio:.0f}%", "wallSeconds": round(wall, 3),
            "seconds": {c: round(max(0.0, seconds[c]), 3) for c in GOODPUT_CATEGORIES}, "accounting": accounting}


def mode(goodput: Mapping[str, Any] | None, attempt: int) -> str:
    """Where `attempt` stood at the last account (MODES; "queued" for an attempt not accounted yet):
    a boundary it passed need not be looked up again (a large job's pods are many)."""
    kept = (goodput or {}).get("accounting") or {}
    same = kept.get("attempt") == attempt and kept.get("mode") in MODES
    return str(kept["mode"]) if same else MODES[0]


def summary(goodput: Mapping[str, Any] | None) -> str:
    """'83% of 1h02m: training 51m40s, checkpointing 1m02s, recovering 12s' (the categories that
    hold time, in contract order); '' without a ledger."""
    if not goodput or not goodput.get("seconds"):
        return ""
    parts = [f"{c} {human_duration(float(s))}" for c in GOODPUT_CATEGORIES
             if (s := _num(goodput["seconds"].get(c))) >= 0.5]
    return (f"{goodput.get('display', '?')} training of {human_duration(_num(goodput.get('wallSeconds')))}"
            + (": " + ", ".join(parts) if parts else ""))


# --- what a pass observes ---------------------------------------------------------------------------

def scheduled_at(pods: Sequence[dict[str, Any]], nodes: int) -> float | None:
    """When the last of an attempt's `nodes` pods was scheduled (their PodScheduled), None until all were."""
    times = [podinfo.scheduled_at(p) for p in pods]
    if len(times) < nodes or any(t is None for t in times):
        return None
    return max(t.timestamp() for t in times if t is not None)


# The samples are decisions/samples.RankSample's, read by attribute.
def stepped_at(ranks: Mapping[int, Any] | None) -> float | None:
    """The attempt's first step as its ranks report it (each worker's first step; the earliest)."""
    firsts = [t for s in (ranks or {}).values() if (t := getattr(s, "first_step_timestamp", None))]
    return min(firsts) if firsts else None


def step_seconds(ranks: Mapping[int, Any] | None) -> float | None:
    """The ranks' step time: the median of their mean steps, once each timed MIN_TIMED_STEPS."""
    means = [s.step_seconds_sum / s.step_seconds_count for s in (ranks or {}).values()
             if getattr(s, "step_seconds_count", 0) >= MIN_TIMED_STEPS]
    return statistics.median(means) if means else None


def rank_counters(ranks: Mapping[int, Any] | None) -> dict[str, float] | None:
    """The rank counters the ledger takes (RANK_COUNTED): rank 0's, whose pod is never replaced
    alone (a replaced pod's counters restart at 0), else the largest; None without any."""
    counted = {r: c for r, s in (ranks or {}).items() if (c := getattr(s, "goodput", None))}
    if not counted:
        return None
    if 0 in counted:
        return dict(counted[0])
    return {c: max(v.get(c, 0.0) for v in counted.values()) for c in RANK_COUNTED}


def new_stalls(prev_history: Sequence[Mapping[str, Any]], history: Sequence[Mapping[str, Any]],
               last_step: float | None) -> list[float]:
    """Seconds without progress of the restarts for a stall first recorded now: an in-place one's
    from its agent's words (contract.stall_seconds), a group restart's from the last step."""
    known = {inplace.key(e) for e in prev_history}
    out = []
    for e in history:
        if e.get("reason") != inplace.STALLED or inplace.key(e) in known:
            continue
        idle = contract.stall_seconds(e.get("message"))
        if idle is None and last_step is not None:
            idle = max(0.0, _num(e.get("failedAt")) - last_step)
        if idle:
            out.append(idle)
    return out


def timestamp(value: Any) -> float | None:
    """An API time (RFC 3339) as Unix seconds."""
    t = parse_time(value) if isinstance(value, str) else None
    return t.timestamp() if t is not None else None
