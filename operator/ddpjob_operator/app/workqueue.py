"""The Reconciler's queue: passes of one job never overlap, bursts fold into one, failures retry.

A kick marks a job dirty and starts its worker unless one runs; the worker pauses `debounce`
seconds (a 64-pod group emits hundreds of pod events), unless the kick was `at_once` (a new job,
a job's own kick: no burst to fold), runs one pass, and goes on while kicks came in meanwhile.
At most `passes` jobs' passes run at once (a pass waits its turn for the API server's request
slots anyway; see `__init__`).
A failed pass is retried with a doubling backoff and never ends the operator.
While a live higher-priority peer exists (kopf's peering, `cluster/cache.PeerGate`) passes are held
back until that peer would be presumed dead, or until the peering object changes. One timer per job
keeps its soonest delayed pass. Runs on one event loop.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Awaitable, Callable

from ddpjob_operator.cluster.cache import PeerGate
from ddpjob_operator.cluster.fairqueue import FairSlots
from ddpjob_operator.cluster.k8s import IN_FLIGHT

log = logging.getLogger("ddpjob.controller")
Key = tuple[str, str]
MAX_BACKOFF = 30.0


class WorkQueue:
    """Runs `run(key, scrape)` for kicked jobs, one pass per job at a time."""

    def __init__(self, run: Callable[[Key, bool], Awaitable[None]], *, ready: Callable[[], Awaitable[None]],
                 failed: Callable[[], None], gate: PeerGate | None = None, debounce: float = 0.1,
                 passes: int = IN_FLIGHT):
        self._run = run
        self._ready = ready        # awaited before a worker's first pass (the pod cache's sync)
        self._failed = failed      # counts a failed pass
        self.gate = gate
        if gate is not None:
            gate.store.listeners.append(lambda *_: self._unblock())
        self.debounce = debounce
        # At most `passes` passes at a time, handed out between tenants and jobs in turn. A pass
        # holds its job's decoded pods, status and decision while it waits for the API server:
        # 1,000 jobs submitted at once all held theirs, and Python's small-object arenas keep what
        # such a peak filled. A pass waiting for a slot has read nothing yet.
        self.passes = FairSlots(passes)
        self.dirty: dict[Key, bool] = {}          # pending pass; True = also scrape
        self.workers: dict[Key, asyncio.Task] = {}
        self.timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}
        self.blocked: set[Key] = set()            # passes held back by a higher-priority peer
        self.at_once: set[Key] = set()            # the pending pass skips the debounce

    def kick(self, namespace: str, name: str, *, scrape: bool = False, at_once: bool = False) -> None:
        """Ask for a pass over this job (coalesced with any pass already pending); `at_once`: no
        pause to fold a burst of events in (a new job, the pass after a group restart)."""
        key = (namespace, name)
        self.dirty[key] = self.dirty.get(key, False) or scrape
        if at_once:
            self.at_once.add(key)
        if key not in self.workers:
            self.workers[key] = asyncio.get_running_loop().create_task(self._work(key))

    def kick_later(self, key: Key, delay: float) -> None:
        """One delayed pass (deadlines, TTL, unschedulable timeout); keeps only the soonest."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        old = self.timers.get(key)
        if old and old[0] <= when and not old[1].cancelled():
            return
        if old:
            old[1].cancel()
        self.timers[key] = (when, loop.call_at(when + 0.05, self._timer_fired, key))

    def _timer_fired(self, key: Key) -> None:
        self.timers.pop(key, None)
        self.kick(*key)

    def cancel_later(self, key: Key) -> None:
        """Drop the job's delayed pass (a pass that decided from everything it would see has run)."""
        timer = self.timers.pop(key, None)
        if timer:
            timer[1].cancel()

    def forget(self, key: Key) -> None:
        """Drop the pending pass and timer of a job that is gone (a running pass ends by itself)."""
        self.dirty.pop(key, None)
        self.blocked.discard(key)
        self.at_once.discard(key)
        self.cancel_later(key)

    async def shutdown(self) -> None:
        """Stop timers and in-flight passes (on operator exit)."""
        for _, handle in self.timers.values():
            handle.cancel()
        self.timers.clear()
        self.dirty.clear()
        tasks = [t for t in self.workers.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _work(self, key: Key) -> None:
        backoff = 1.0
        try:
            await self._ready()  # an unsynced cache would make launched pods look deleted
            while key in self.dirty:
                if key in self.at_once:
                    self.at_once.discard(key)
                    await asyncio.sleep(0)  # other jobs' passes still get their turn
                else:
                    await asyncio.sleep(self.debounce)
                failure = None
                async with self.passes.slot(key):
                    if key not in self.dirty:
                        break  # forgotten while it waited for a slot
                    scrape = self.dirty.pop(key)  # kicks that came while it waited ride along
                    wait = self.held_back()
                    if wait is not None:
                        # A higher-priority peer acts; retry when it would be presumed dead (its
                        # keep-alives move that time, and its leaving wakes us through the peer cache).
                        self.blocked.add(key)
                        self.kick_later(key, wait)
                        continue
                    try:
                        await self._run(key, scrape)
                        backoff = 1.0
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # noqa: BLE001  (retry with backoff; never crash the operator)
                        failure = exc
                if failure is not None:  # the backoff holds no slot
                    self._failed()
                    log.warning("reconcile %s/%s failed (retry in %.0fs): %s", *key, backoff, failure)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF)
                    self.dirty[key] = self.dirty.get(key, False) or scrape
        finally:
            if self.workers.get(key) is asyncio.current_task():
                del self.workers[key]

    def held_back(self) -> float | None:
        """Seconds until a live higher-priority peer would be presumed dead; None = act now."""
        until = self.gate.blocking_until() if self.gate is not None else None
        if until is None:
            return None
        return max(1.0, (until - dt.datetime.now(dt.timezone.utc)).total_seconds())

    def _unblock(self) -> None:
        """The peering object changed: passes held back may run now (or wait again)."""
        blocked, self.blocked = self.blocked, set()
        for key in blocked:
            self.kick(*key)
