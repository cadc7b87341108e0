"""Ctrl-C ends `ddpjob top` and `ddpjob wait` wherever it lands (jobs.CtrlC). Python's own
KeyboardInterrupt, raised inside a finalizer, is printed as "Exception ignored" and lost: a CI run's
`ddpjob top` refreshed on after Ctrl-C until the test's timeout. The finalizer below stands in for
the API client's objects that every refresh frees."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from ddpjob_cli.jobs import CtrlC


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """Python's own Ctrl-C handler for each test, whatever this run inherited: a test session started
    in the background of a non-interactive shell ignores SIGINT (rehearsal 8 failed these so)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class _FreedDuringCtrlC:
    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs here, inside the finalizer


def test_python_loses_a_ctrl_c_that_lands_in_a_finalizer(monkeypatch):
    lost = []  # what Python prints as "Exception ignored in: ..."
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: lost.append(unraisable.exc_type))
    _FreedDuringCtrlC()   # no KeyboardInterrupt comes out of here, nor later
    time.sleep(0.2)
    assert lost == [KeyboardInterrupt]


def test_a_ctrl_c_that_lands_in_a_finalizer_still_ends_the_loop_at_its_next_sleep(monkeypatch):
    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: lost.append(unraisable.exc_type))
    before = signal.getsignal(signal.SIGINT)
    with CtrlC() as ctrl_c:
        _FreedDuringCtrlC()
        assert lost == [KeyboardInterrupt] and ctrl_c.pressed.is_set()  # the raise lost, the flag kept
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.sleep(600)   # raises at once
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_interrupts_a_blocking_call_at_once():
    with CtrlC() as ctrl_c:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(600)  # a request in flight, say: the handler raises before this returns
        assert ctrl_c.pressed.is_set()


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with CtrlC() as ctrl_c:
            os.kill(os.getpid(), signal.SIGINT)
            ctrl_c.sleep(0)
            assert not ctrl_c.pressed.is_set()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
