"""Which rank a hang or a failure is the fault of, by the ranks' stacks, and the ConfigMap that keeps
those stacks (pure).

Each pod's agent captures its workers' Python stacks before it kills a stalled worker, when a
rank has been idle for half its hang timeout, and for the peers still running when a worker failed
(ddpjob_trainer/stacks.py), and names each capture in a series (contract.STACK_CAPTURE): the
collective its main thread waits in (`waiting`, "" when none) and its innermost frames.

The culprit: in synchronous DDP every rank meets every other in each step's collectives, so when
one rank stops, the others wait for it inside the next collective, and it is the one that is not
there. Among the ranks' newest captures of one spell (`culprit`), the ranks outside any collective
are named, with the collective the rest wait in; where every rank waits in a collective, or none
does, the stacks name no one (the progress-based rule of decisions/health.py stands).

What is kept: the full captures are served by each pod's endpoint (contract.STACKS_PATH); the
operator keeps them in the ConfigMap contract.stacks_configmap(job) owned by the DDPJob
(builders/stacks.py), so they
outlive the pods (a group restart, the job's end) and go with the job. One key per capture
(`key`), redacted like status.failures and bounded (STACK_TEXT_BYTES each, KEPT_BYTES in all:
the oldest dropped first, the ConfigMap staying far below the API server's 1 MiB).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ddpjob_api import contract
from ddpjob_operator.decisions.redact import redact

KEPT_BYTES = 512 * 1024   # all captures a job's ConfigMap holds
CAPTURE_KEY = re.compile(r"^attempt-(\d+)\.restart-(\d+)\.rank-(\d+)\.(\w+)\.(\d+)$")


@dataclass(frozen=True)
class Culprit:
    """The ranks the stacks blame (the first is named), the collective the others wait in, and
    the first one's innermost frames (redacted)."""

    ranks: tuple[int, ...]
    waiting_in: str
    frames: str

    def entry(self, ranks: Mapping[int, Any]) -> dict[str, Any]:
        """status.restartHistory[].culprit."""
        first = ranks.get(self.ranks[0])
        out: dict[str, Any] = {"rank": self.ranks[0], "frames": self.frames, "waitingIn": self.waiting_in}
        if first is not None and getattr(first, "pod", None):
            out["pod"] = first.pod
        if first is not None and getattr(first, "node", None):
            out["node"] = first.node
        return out


def describe(culprit: Mapping[str, Any]) -> str:
    """'rank 1 (pod j-1 on node n2) is not in the backward its peers wait in: at debug.py:95 _block < ...'"""
    where = " ".join(([f"pod {culprit['pod']}"] if culprit.get("pod") else [])
                     + ([f"on node {culprit['node']}"] if culprit.get("node") else []))
    who = f"rank {culprit.get('rank')}" + (f" ({where})" if where else "")
    frames = f": at {culprit['frames']}" if culprit.get("frames") else ""
    return f"{who} is not in the {culprit.get('waitingIn')} its peers wait in{frames}"


def culprit(captures: Mapping[int, Mapping[str, Any]]) -> Culprit | None:
    """The culprit of one spell from each rank's capture in it ({rank: capture}); None where the
    stacks name no one (fewer than two ranks, all in a collective, or none in one)."""
    if len(captures) < 2:
        return None
    inside = {r: str(c.get("waiting") or "") for r, c in captures.items() if c.get("waiting")}
    outside = sorted(r for r in captures if r not in inside)
    if not inside or not outside:
        return None
    collective = Counter(inside.values()).most_common(1)[0][0]
    return Culprit(tuple(outside), collective, redact(str(captures[outside[0]].get("frames") or "")))


def _newest(sample: Any, *, restart: int | None, since: float) -> Mapping[str, Any] | None:
    found = [c for c in getattr(sample, "stack_captures", None) or []
             if float(c["time"]) >= since and (restart is None or str(c.get("restart")) == str(restart))]
    return found[-1] if found else None


def of_stall(ranks: Mapping[int, Any]) -> Culprit | None:
    """The culprit of a job that made no progress: each rank's newest capture taken since the job's
    last progress (any rank's last step or stage start), the spell it is stuck in."""
    last = max([t for s in ranks.values() for t in (s.last_step_timestamp, s.stage_started_at) if t] or [0.0])
    found = {r: c for r, s in ranks.items() if (c := _newest(s, restart=None, since=last)) is not None}
    return culprit(found)


def of_restart(ranks: Mapping[int, Any], *, restart: int, failed_at: float, window: float) -> Culprit | None:
    """The culprit of an in-place restart: each rank's newest capture of the worker start that
    failed (`restart`), taken within `window` seconds (the hang timeout) before it failed."""
    found = {r: c for r, s in ranks.items()
             if (c := _newest(s, restart=restart, since=failed_at - window)) is not None and float(c["time"]) <= failed_at + window}
    return culprit(found)


def key(capture: Mapping[str, Any]) -> str:
    """A capture's ConfigMap key: attempt, restart, rank, trigger, time (ms); sorts as it happened
    within a rank, and the CLI selects an attempt by it."""
    trigger = str(capture.get("trigger") or "")
    trigger = trigger if trigger in contract.STACK_TRIGGERS else "other"
    return (f"attempt-{int(capture.get('attempt') or 0)}.restart-{int(capture.get('restart') or 0)}."
            f"rank-{int(capture.get('rank') or 0)}.{trigger}.{int(float(capture.get('time') or 0) * 1000)}")


def _bounded(text: str, limit: int = contract.STACK_TEXT_BYTES) -> str:
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[:limit].decode(errors="ignore") + f"\n... (cut at {limit} bytes)\n"


def capture_text(capture: Mapping[str, Any], *, pod: str, node: str | None) -> str:
    """The value kept for one capture (contract.stack_capture_text: a header naming rank, pod,
    node, trigger and time, then the dump), redacted and bounded."""
    where = f" (pod {pod}" + (f" on node {node})" if node else ")")
    return _bounded(redact(contract.stack_capture_text(capture, where=where)))


def merged(existing: Mapping[str, str], captures: Iterable[tuple[Mapping[str, Any], str, str | None]]) -> dict[str, str]:
    """The ConfigMap's data with `captures` ((capture, pod, node) each, as a pod's endpoint served
    them) added: the newest kept within KEPT_BYTES. Keys that are not captures' are dropped."""
    data = {k: v for k, v in existing.items() if CAPTURE_KEY.match(k)}
    for capture, pod, node in captures:
        try:
            data.setdefault(key(capture), capture_text(capture, pod=pod, node=node))
        except (TypeError, ValueError):
            continue  # a record that is not an agent's: nothing of it is kept
    by_age = sorted(data, key=lambda k: int(CAPTURE_KEY.match(k).group(5)), reverse=True)  # type: ignore[union-attr]
    kept, size = {}, 0
    for k in by_age:
        size += len(k) + len(data[k].encode())
        if size > KEPT_BYTES:
            break
        kept[k] = data[k]
    return kept


def of_attempt(data: Mapping[str, str], attempt: int | None) -> list[tuple[tuple[int, int, int, int], str]]:
    """((attempt, restart, time, rank), text) of the kept captures of `attempt` (None: all), in order."""
    out = []
    for k, text in data.items():
        m = CAPTURE_KEY.match(k)
        if m and (attempt is None or int(m.group(1)) == attempt):
            out.append(((int(m.group(1)), int(m.group(2)), int(m.group(5)), int(m.group(3))), text))
    return sorted(out)
