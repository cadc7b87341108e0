"""Fair sharing of the operator's API-request slots: between tenants first, then between jobs
(issue 12 item 7, issue 50).

A 3,000-node job creates its pods with up to 64 requests in flight; with one first-come queue a
small job's restart waited behind every one of them. Here each job (the key) has its own queue,
each tenant (the job's namespace) its own rotation of jobs, and free slots are handed out
round-robin over the tenants that are waiting and, within a tenant, over its waiting jobs. So a
request waits for at most one request per other busy tenant and, within its own tenant, one per
other busy job of it, whatever their backlog: a tenant that submits a hundred jobs gets the
operator's share of one tenant, not a hundred jobs' worth.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from typing import AsyncIterator, Callable, Hashable


def namespace_of(key: Hashable) -> Hashable:
    """A job's tenant: the namespace of a (namespace, name) key; any other key is its own tenant."""
    return key[0] if isinstance(key, tuple) and len(key) == 2 else key


class FairSlots:
    """At most `slots` requests in flight; waiting ones are served one tenant at a time, in turn,
    and within a tenant one job at a time, in turn.

    Runs on one event loop (not thread-safe); the requests themselves may run anywhere."""

    def __init__(self, slots: int, *, tenant: Callable[[Hashable], Hashable] = namespace_of) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.free = slots
        self._tenant = tenant
        # tenant -> job -> its waiting requests; both levels in serving order.
        self._waiting: OrderedDict[Hashable, OrderedDict[Hashable, deque[asyncio.Future[None]]]] = OrderedDict()

    def waiting(self) -> int:
        """Requests queued for a slot (all tenants and jobs)."""
        return sum(len(q) for jobs in self._waiting.values() for q in jobs.values())

    @contextlib.asynccontextmanager
    async def slot(self, key: Hashable) -> AsyncIterator[None]:
        """Hold one slot for the block; `key` names whose turn it is (a job: (namespace, name))."""
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
        self._waiting.setdefault(self._tenant(key), OrderedDict()).setdefault(key, deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot was handed over just as we were cancelled: pass it on
            else:
                self._forget(key, fut)
            raise

    def _forget(self, key: Hashable, fut: asyncio.Future[None]) -> None:
        tenant = self._tenant(key)
        jobs = self._waiting.get(tenant)
        queue = jobs.get(key) if jobs is not None else None
        if jobs is None or queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(fut)
        if not queue:
            del jobs[key]
        if not jobs:
            del self._waiting[tenant]

    def _release(self) -> None:
        while self._waiting:
            # The tenant at the head of the rotation is served and moves to its end; so does the
            # job at the head of that tenant's own rotation.
            tenant, jobs = next(iter(self._waiting.items()))
            key, queue = next(iter(jobs.items()))
            fut = queue.popleft()
            if queue:
                jobs.move_to_end(key)
            else:
                del jobs[key]
            if jobs:
                self._waiting.move_to_end(tenant)
            else:
                del self._waiting[tenant]
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to it: `free` is unchanged
                return
        self.free += 1
