"""Fair sharing of the operator's API-request slots between jobs (issue 12 item 7).

A 3,000-node job creates its pods with up to 64 requests in flight; with one first-come queue a
small job's restart waited behind every one of them. Here each job (the key) has
its own queue and free slots are handed out round-robin over the jobs that are waiting, so a
request waits for at most one request per other busy job, whatever their backlog.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from typing import AsyncIterator, Hashable


class FairSlots:
    """At most `slots` requests in flight; waiting ones are served one job at a time, in turn.

    Runs on one event loop (not thread-safe); the requests themselves may run anywhere."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.free = slots
        self._waiting: OrderedDict[Hashable, deque[asyncio.Future[None]]] = OrderedDict()

    def waiting(self) -> int:
        """Requests queued for a slot (all jobs)."""
        return sum(len(q) for q in self._waiting.values())

    @contextlib.asynccontextmanager
    async def slot(self, key: Hashable) -> AsyncIterator[None]:
        """Hold one slot for the block; `key` names whose turn it is (a job)."""
        await self._acquire(key)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, key: Hashable) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot was handed over just as we were cancelled: pass it on
            else:
                self._forget(key, fut)
            raise

    def _forget(self, key: Hashable, fut: asyncio.Future[None]) -> None:
        queue = self._waiting.get(key)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(fut)
            if not queue:
                del self._waiting[key]

    def _release(self) -> None:
        while self._waiting:
            # The job at the head of the rotation is served and moves to its end.
            key, queue = next(iter(self._waiting.items()))
            fut = queue.popleft()
            if queue:
                self._waiting.move_to_end(key)
            else:
                del self._waiting[key]
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to it: `free` is unchanged
                return
        self.free += 1
