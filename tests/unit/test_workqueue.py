"""WorkQueue: one pass per job at a time, at most `passes` jobs' passes at once."""
from __future__ import annotations

import asyncio

from ddpjob_operator.app.workqueue import WorkQueue


async def _ready() -> None:
    pass


def test_at_most_passes_run_at_once_and_kicks_while_waiting_fold_into_one_pass():
    async def main():
        release = asyncio.Event()
        busy, peak, runs = 0, 0, []

        async def run(key, scrape):
            nonlocal busy, peak
            busy += 1
            peak = max(peak, busy)
            runs.append(key)
            await release.wait()   # a pass waiting for the API server
            busy -= 1

        queue = WorkQueue(run, ready=_ready, failed=lambda: None, debounce=0, passes=4)
        for i in range(40):
            queue.kick("ns", f"job-{i}", at_once=True)
        while busy < 4:
            await asyncio.sleep(0)
        for i in range(40):        # a burst of events for every job, most still waiting for a slot
            queue.kick("ns", f"job-{i}")
        for _ in range(20):
            await asyncio.sleep(0)
        started = busy
        release.set()
        await asyncio.gather(*queue.workers.values())
        return started, peak, runs

    started, peak, runs = asyncio.run(main())
    assert (started, peak) == (4, 4)
    # The 4 running when the burst came run again; the 36 waiting take it in their one pass.
    assert len(runs) == 44 and set(runs) == {("ns", f"job-{i}") for i in range(40)}
    assert sorted(runs.count(k) for k in set(runs)) == [1] * 36 + [2] * 4


def test_a_failed_pass_waits_out_its_backoff_without_holding_a_slot():
    async def main():
        order = []
        other_ran = asyncio.Event()

        async def run(key, scrape):
            order.append(key[1])
            if key[1] == "bad" and not other_ran.is_set():
                raise RuntimeError("API server said no")
            if key[1] == "other":
                other_ran.set()

        failures = []
        queue = WorkQueue(run, ready=_ready, failed=lambda: failures.append(1), debounce=0, passes=1)
        queue.kick("ns", "bad", at_once=True)
        while not failures:
            await asyncio.sleep(0)
        queue.kick("ns", "other", at_once=True)   # the only slot is free during bad's backoff
        await asyncio.gather(*queue.workers.values())
        return order, failures

    assert asyncio.run(main()) == (["bad", "other", "bad"], [1])


def test_a_job_forgotten_while_it_waits_for_a_slot_runs_no_pass():
    async def main():
        release, runs = asyncio.Event(), []

        async def run(key, scrape):
            runs.append(key[1])
            await release.wait()

        queue = WorkQueue(run, ready=_ready, failed=lambda: None, debounce=0, passes=1)
        queue.kick("ns", "first", at_once=True)
        queue.kick("ns", "gone", at_once=True)
        while not runs:
            await asyncio.sleep(0)
        queue.forget(("ns", "gone"))           # deleted while it waited
        release.set()
        await asyncio.gather(*queue.workers.values())
        return runs, queue.workers

    assert asyncio.run(main()) == (["first"], {})
