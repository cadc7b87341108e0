"""The few-threads helper behind the checkpoint writer and the stager."""
from __future__ import annotations

import threading

import pytest

from ddpjob_trainer.checkpointing.parallel import run_each, split_by_size


@pytest.mark.parametrize("n, want", [(1, [[9, 5, 4, 1]]), (2, [[9, 1], [5, 4]]), (3, [[9], [5], [4, 1]]),
                                     (8, [[9], [5], [4], [1]])])
def test_parts_are_balanced_by_size_and_never_empty(n, want):
    assert split_by_size([4, 9, 1, 5], n, size=lambda x: x) == want


def test_results_in_order_and_every_part_on_its_own_thread():
    seen = []
    out = run_each(lambda part: seen.append(threading.current_thread().name) or sum(part), [[1, 2], [3], [4, 5]])
    assert out == [3, 3, 9] and len(set(seen)) == 3
    assert threading.current_thread().name in seen  # the first part runs on the caller's thread


def test_an_error_on_a_helper_thread_is_raised_to_the_caller():
    def fn(part):
        if part == "bad":
            raise ValueError("part failed")
        return part
    with pytest.raises(ValueError, match="part failed"):
        run_each(fn, ["ok", "bad"])
    assert run_each(fn, []) == []
