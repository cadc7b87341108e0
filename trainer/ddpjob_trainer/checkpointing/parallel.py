"""Splitting I/O-bound work across a few threads: the checkpoint writer's files, the stager's copies."""
from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def split_by_size(items: Sequence[T], n: int, size: Callable[[T], int]) -> list[list[T]]:
    """Items in up to n non-empty parts of about equal total size (largest first, each to the lightest part)."""
    parts: list[list[T]] = [[] for _ in range(max(1, n))]
    load = [0] * len(parts)
    for item in sorted(items, key=size, reverse=True):
        i = load.index(min(load))
        parts[i].append(item)
        load[i] += size(item)
    return [p for p in parts if p]


def run_each(fn: Callable[[T], R], parts: Sequence[T]) -> list[R]:
    """fn(part) for every part, each on its own thread (the first on the caller's), results in order.

    The first exception of any thread is raised here: an exception in a plain thread is only
    printed, and its share of the work would be silently missing.
    """
    results: list[R | None] = [None] * len(parts)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(parts[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"ddpjob-io-{i}") for i in range(1, len(parts))]
    for t in threads:
        t.start()
    if parts:
        run(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]
