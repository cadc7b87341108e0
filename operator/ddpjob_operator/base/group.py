"""A job's pods as one pass sees them, classified once (pure).

A job's pods span attempts: the current attempt's, an older one's failed pods kept for their logs,
pods still terminating after a group restart. Which attempt a pod belongs to is read here and
nowhere else (tests/unit/test_group.py): a pass builds one Group and the decisions, the status and
the builders ask it for the attempt they mean.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ddpjob_operator.base import podinfo

Pod = dict[str, Any]


@dataclass(frozen=True)
class Attempt:
    """The pods of one attempt."""

    number: int
    pods: tuple[Pod, ...] = ()                                   # as listed, terminating ones too
    by_rank: Mapping[int, Pod] = field(default_factory=dict)     # each rank's (>= 0) newest replacement
    active: tuple[Pod, ...] = ()                                 # not being deleted
    departed: Mapping[str, Pod] = field(default_factory=dict)    # last state of those that vanished

    @property
    def replacements(self) -> int:
        """Lost pods replaced alone in this attempt, as its pods show (each rank's newest `-r<n>`)."""
        newest: dict[int, int] = {}
        for p in self.pods:
            newest[podinfo.rank(p)] = max(newest.get(podinfo.rank(p), 0), podinfo.replacement(p))
        return sum(newest.values())


@dataclass(frozen=True)
class Group:
    """Every pod of one job, every attempt, and the last state of those that vanished since."""

    pods: tuple[Pod, ...] = ()
    names: frozenset[str] = frozenset()
    live: tuple[Pod, ...] = ()                                   # not being deleted, any attempt
    attempts: Mapping[int, Attempt] = field(default_factory=dict)  # by attempt label (-1: none)

    @classmethod
    def of(cls, pods: Iterable[Pod], departed: Iterable[Pod] = ()) -> Group:
        """`departed`: the last state seen of pods that are gone (a pod listed again is not gone)."""
        pods = tuple(pods)
        names = frozenset(podinfo.name(p) for p in pods)
        listed: dict[int, list[Pod]] = {}
        for p in pods:
            listed.setdefault(podinfo.attempt(p), []).append(p)
        gone: dict[int, dict[str, Pod]] = {}
        for p in departed:
            if podinfo.name(p) not in names:
                gone.setdefault(podinfo.attempt(p), {})[podinfo.name(p)] = p
        attempts = {}
        for n in sorted(listed.keys() | gone.keys()):
            mine = tuple(listed.get(n, ()))
            by_rank: dict[int, Pod] = {}
            for p in mine:
                # A lost pod's replacement stands for its rank; the old one may still be listed
                # (terminating, or Failed and kept for its logs). Else the first listed.
                r = podinfo.rank(p)
                if r >= 0 and (r not in by_rank or podinfo.replacement(p) > podinfo.replacement(by_rank[r])):
                    by_rank[r] = p
            attempts[n] = Attempt(n, mine, by_rank, tuple(p for p in mine if not podinfo.terminating(p)),
                                  gone.get(n, {}))
        return cls(pods, names, tuple(p for p in pods if not podinfo.terminating(p)), attempts)

    def at(self, attempt: int) -> Attempt:
        return self.attempts.get(attempt) or Attempt(attempt)

    @property
    def newest(self) -> int | None:
        """The newest attempt a listed pod carries (None: no pod carries one)."""
        return max((n for n, a in self.attempts.items() if n >= 0 and a.pods), default=None)

    def between(self, first: int, end: int | None = None) -> tuple[Pod, ...]:
        """The pods of attempts `first` up to, not including, `end` (None: the newest included)."""
        return tuple(p for n, a in self.attempts.items() if first <= n and (end is None or n < end) for p in a.pods)

    def running(self) -> tuple[int, tuple[Pod, ...]]:
        """(attempt, its pods running and not being deleted) for the newest attempt that has any;
        (-1, ()) when none runs. An older attempt's pods may still run while they are deleted."""
        for n in sorted(self.attempts, reverse=True):
            up = tuple(p for p in self.attempts[n].active if podinfo.phase(p) == "Running")
            if up:
                return n, up
        return -1, ()
