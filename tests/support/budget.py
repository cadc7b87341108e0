"""CI's wall-clock limit, kept by the suite itself.

CI kills the whole run at its limit, and a pytest killed by a signal prints nothing of why its
tests failed: stop 21's run spent its time on real-pod tests that each waited out a 40-minute
timeout, was killed in the trainer tier, and left only a row of F's. So:

- a failed test's report is printed the moment it fails, not only in the final summary;
- with DDPJOB_TEST_DEADLINE (seconds since the epoch; .ci/run sets it a margin before CI's
  limit), no test's timeout runs past it, and once it has passed the session ends cleanly, with
  its summary, naming how many tests did not run and failing the run.
"""
from __future__ import annotations

import os
import time

import pytest

DEADLINE_ENV = "DDPJOB_TEST_DEADLINE"
# Below this many seconds left, starting another test only gets it killed half-way.
MIN_TEST_SECONDS = 30
TRACE_LINES = 40
OUTPUT_LINES = 60


def _deadline(config) -> float | None:
    raw = os.environ.get(DEADLINE_ENV, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise pytest.UsageError(f"{DEADLINE_ENV}={raw!r} is not a time in seconds since the epoch") from None


def _item_timeout(item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        return float(value) if value else None
    ini = item.config.getini("timeout")
    return float(ini) if ini else None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # A wrapper, and the outermost one, so the timeout marker is capped before pytest-timeout's
    # own wrapper reads it.
    deadline = _deadline(item.config)
    if deadline is not None:
        left = deadline - time.time()
        if left < MIN_TEST_SECONDS:
            session = item.session
            not_run = len(session.items) - session.items.index(item)
            pytest.exit(f"{DEADLINE_ENV} reached: {not_run} of {len(session.items)} tests not run "
                        "(the run is failed, not cut off without a summary)", returncode=1)
        current = _item_timeout(item)
        if current is None or current > left:
            item.add_marker(pytest.mark.timeout(int(left)), append=False)
    yield


def pytest_runtest_logreport(report) -> None:
    if not report.failed:
        return
    reporter = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    if reporter is None:
        return
    lines = report.longreprtext.splitlines()[-TRACE_LINES:]
    for name, text in report.sections:
        if name.startswith("Captured stdout"):  # where the real-pod tiers print their diagnosis
            lines += [f"--- {name}", *text.splitlines()[-OUTPUT_LINES:]]
    reporter.write_line("")
    reporter.write_sep("!", f"FAILED ({report.when}) {report.nodeid}: details now, the summary repeats them")
    for line in lines:
        reporter.write_line(line)

_config = None


def pytest_configure(config) -> None:
    global _config
    _deadline(config)  # a malformed value stops the run before any test
    _config = config
