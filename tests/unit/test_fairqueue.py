"""FairSlots: API-request slots shared out round-robin between jobs."""
from __future__ import annotations

import asyncio

import pytest

from ddpjob_operator.cluster.fairqueue import FairSlots
from tests.support.builders import make_pod


async def _run(slots: FairSlots, requests: list[str], *, hold: float = 0.01) -> list[str]:
    """Start `requests` (job keys) in this order, all at once; the order in which they got a slot."""
    order: list[str] = []

    async def one(key: str) -> None:
        async with slots.slot(key):
            order.append(key)
            await asyncio.sleep(hold)

    await asyncio.gather(*(one(k) for k in requests))
    return order


@pytest.mark.parametrize("slots, requests, want", [
    # A small job's two requests queued behind a big job's backlog are served in turn, not last.
    (1, ["big"] * 6 + ["small"] * 2, ["big", "big", "small", "big", "small", "big", "big", "big"]),
    # Three jobs: round-robin; FIFO within a job.
    (1, ["a", "a", "a", "b", "c", "c"], ["a", "a", "b", "c", "a", "c"]),
    # Free slots at once: first come, first served.
    (4, ["a", "a", "b"], ["a", "a", "b"]),
    (2, ["big"] * 4 + ["small"], ["big", "big", "big", "small", "big"]),
])
def test_waiting_requests_are_served_one_job_at_a_time(slots, requests, want):
    assert asyncio.run(_run(FairSlots(slots), requests)) == want


def test_never_more_in_flight_than_slots_and_every_slot_comes_back():
    async def main():
        slots, busy, peak = FairSlots(3), 0, 0

        async def one(key: str) -> None:
            nonlocal busy, peak
            async with slots.slot(key):
                busy += 1
                peak = max(peak, busy)
                await asyncio.sleep(0.001)
                busy -= 1

        await asyncio.gather(*(one(f"job-{i % 5}") for i in range(200)))
        return peak, slots.free, slots.waiting()

    assert asyncio.run(main()) == (3, 3, 0)


def test_a_failed_request_gives_its_slot_back():
    async def main():
        slots = FairSlots(1)
        with pytest.raises(RuntimeError):
            async with slots.slot("a"):
                raise RuntimeError("API said no")
        async with slots.slot("b"):
            return slots.free

    assert asyncio.run(main()) == 0


def test_a_cancelled_waiter_leaves_the_queue_and_loses_no_slot():
    async def main():
        slots = FairSlots(1)
        gate = asyncio.Event()

        async def holder():
            async with slots.slot("a"):
                await gate.wait()

        async def waiter(key):
            async with slots.slot(key):
                return key

        h = asyncio.create_task(holder())
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(waiter("b"))
        served = asyncio.create_task(waiter("c"))
        await asyncio.sleep(0)
        assert slots.waiting() == 2
        cancelled.cancel()
        await asyncio.sleep(0)
        assert slots.waiting() == 1
        gate.set()
        await h
        got = await served
        return got, slots.free, slots.waiting(), cancelled.cancelled()

    assert asyncio.run(main()) == ("c", 1, 0, True)


def test_zero_slots_is_refused():
    with pytest.raises(ValueError, match="slots must be >= 1"):
        FairSlots(0)


def test_the_k8s_facade_queues_requests_per_job():
    """K8s itself: with one request thread busy, a small job's status write overtakes a big job's
    queued pod creations after at most one of them."""
    import time

    from ddpjob_operator.cluster.k8s import K8s

    k8s = K8s(api=object(), workers=1)
    made: list[str] = []

    def request(method, path, **kwargs):
        time.sleep(0.01)
        made.append(f"{method} {path.rsplit('/', 1)[-1]}")
        return {}

    k8s._request = request  # the facade's one blocking call; everything above it is what we test

    async def main():
        creates = [asyncio.create_task(k8s.create(make_pod(i, job="big"))) for i in range(6)]
        await asyncio.sleep(0)
        await asyncio.gather(k8s.patch_status("ns", "small", {"phase": "Restarting"}), *creates)

    try:
        asyncio.run(main())
    finally:
        k8s.close()
    assert made.index("PATCH status") <= 2, made


@pytest.mark.parametrize("status, gone", [(404, True), (403, False), (500, False)])
def test_the_k8s_facade_reads_a_gone_object_as_none(status, gone):
    """K8s' reads (the job, a child, a node): a 404 is None, any other error the caller's."""
    from kubernetes.client.rest import ApiException

    from ddpjob_operator.cluster.k8s import K8s

    k8s = K8s(api=object(), workers=1)
    paths: list[str] = []

    def request(method, path, **kwargs):
        paths.append(f"{method} {path}")
        raise ApiException(status=status)

    k8s._request = request

    async def main():
        reads = (k8s.get_job("ns", "j"), k8s.get_child("Pod", "ns", "j-0", job="j"), k8s.get_node("n1"))
        return await asyncio.gather(*reads, return_exceptions=True)

    try:
        got = asyncio.run(main())
    finally:
        k8s.close()
    assert paths == ["GET /apis/ddpjob.dev/v1alpha1/namespaces/ns/ddpjobs/j", "GET /api/v1/namespaces/ns/pods/j-0",
                     "GET /api/v1/nodes/n1"]
    assert all(r is None for r in got) if gone else all(isinstance(r, ApiException) and r.status == status for r in got)


# --- tenants first: (namespace, job) keys ------------------------------------------------------

@pytest.mark.parametrize("slots, requests, want", [
    # Tenant a floods with three jobs, b has one: b gets every other slot, not every fourth.
    (1, [("a", "1")] * 2 + [("a", "2")] * 2 + [("a", "3")] * 2 + [("b", "x")] * 3,
     ["a/1", "a/1", "b/x", "a/2", "b/x", "a/3", "b/x", "a/2", "a/3"]),
    # Within a tenant, its jobs take turns as before.
    (1, [("a", "1")] * 3 + [("a", "2")] * 2, ["a/1", "a/1", "a/2", "a/1", "a/2"]),
    # Three tenants, one job each: round-robin.
    (1, [("a", "1")] * 3 + [("b", "1")] + [("c", "1")] * 2, ["a/1", "a/1", "b/1", "c/1", "a/1", "c/1"]),
])
def test_waiting_requests_are_served_one_tenant_at_a_time_then_one_job_at_a_time(slots, requests, want):
    async def main():
        fair, order = FairSlots(slots), []

        async def one(key):
            async with fair.slot(key):
                order.append("/".join(key))
                await asyncio.sleep(0.001)

        await asyncio.gather(*(one(k) for k in requests))
        return order

    assert asyncio.run(main()) == want


def test_a_tenant_with_many_jobs_gets_one_tenants_share():
    """Ten busy jobs in one namespace against one job in another: the lone tenant's requests are
    served at least as fast as the other tenant's all together (half the slots), while a per-job
    rotation would give it one in eleven."""
    async def main():
        fair, order = FairSlots(2), []

        async def one(key):
            async with fair.slot(key):
                order.append(key[0])
                await asyncio.sleep(0.001)

        flood = [("crowd", f"j{i}") for i in range(10) for _ in range(10)]
        lone = [("lone", "j")] * 20
        await asyncio.gather(*(one(k) for k in flood + lone))
        return order

    order = asyncio.run(main())
    first_forty = order[:40]
    assert first_forty.count("lone") >= 19, first_forty


def test_a_cancelled_waiter_of_a_tenant_leaves_no_empty_turn():
    async def main():
        slots = FairSlots(1)
        gate = asyncio.Event()

        async def holder():
            async with slots.slot(("a", "h")):
                await gate.wait()

        async def waiter(key):
            async with slots.slot(key):
                return key

        h = asyncio.create_task(holder())
        await asyncio.sleep(0)
        gone = asyncio.create_task(waiter(("b", "1")))
        served = asyncio.create_task(waiter(("c", "1")))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        waiting = slots.waiting()
        gate.set()
        await h
        return waiting, await served, slots.free, slots.waiting()

    assert asyncio.run(main()) == (1, ("c", "1"), 1, 0)
