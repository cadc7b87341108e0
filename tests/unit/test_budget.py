"""tests/support/budget.py: the suite keeps CI's wall-clock limit itself and prints a failure when
it happens. Each case runs a small pytest session of its own with the plugin loaded."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

TESTS = r'''
import pytest

def effective_timeout(request):
    marker = request.node.get_closest_marker("timeout")
    return marker.args[0] if marker else request.config.getini("timeout")

def test_first(request):
    print("\ntimeout", effective_timeout(request))

def test_fails():
    print("diagnosis: the operator pod is in CrashLoopBackOff")
    assert 1 == 2, "the job never ran"

@pytest.mark.timeout(5)
def test_short_marker(request):
    print("\ntimeout", effective_timeout(request))
'''


def run_session(tmp_path: Path, deadline: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 900\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("DDPJOB_TEST_DEADLINE", None)
    if deadline is not None:
        env["DDPJOB_TEST_DEADLINE"] = deadline
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.support.budget", "-s", "-q",
                           "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_passed_deadline_ends_the_session_with_a_summary_and_fails_it(tmp_path):
    proc = run_session(tmp_path, str(time.time() - 1))
    assert proc.returncode == 1, proc.stdout
    assert "DDPJOB_TEST_DEADLINE reached: 3 of 3 tests not run" in proc.stdout
    assert "timeout " not in proc.stdout  # no test started


def test_timeouts_are_capped_at_the_deadline_and_a_shorter_marker_kept(tmp_path):
    proc = run_session(tmp_path, str(time.time() + 300))
    capped = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("timeout ")]
    assert len(capped) == 2, proc.stdout
    assert 200 < capped[0] <= 300  # the ini's 900 s would run past the deadline
    assert capped[1] == 5


def test_without_a_deadline_the_configured_timeout_stands(tmp_path):
    proc = run_session(tmp_path, None)
    assert "timeout 900" in proc.stdout and "timeout 5" in proc.stdout, proc.stdout


def test_a_failure_is_printed_when_it_happens_with_its_captured_stdout(tmp_path):
    (tmp_path / "test_inner.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("DDPJOB_TEST_DEADLINE", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.support.budget", "-q",
                           "-p", "no:cacheprovider", "-k", "fails", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    head = proc.stdout.split("= FAILURES =")[0]  # before pytest's own report
    assert "details now" in head and "diagnosis: the operator pod is in CrashLoopBackOff" in head, proc.stdout


def test_a_malformed_deadline_is_a_usage_error_naming_the_variable(tmp_path):
    proc = run_session(tmp_path, "tomorrow")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR
    assert "DDPJOB_TEST_DEADLINE='tomorrow' is not a time" in proc.stdout + proc.stderr
