"""`ddpjob operator`'s flags: what to watch must be said, log levels and formats are choices."""
from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner

from ddpjob_cli import main as cli
from ddpjob_operator.app import operator_main


@pytest.fixture
def started(monkeypatch):
    """The configs run_operator would have been started with (it is not started)."""
    seen = []
    monkeypatch.setattr(operator_main, "run_operator", lambda cfg: seen.append(cfg) or 0)
    return seen


def invoke(*args):
    return CliRunner().invoke(cli.main, ["operator", *args], env={"DDPJOB_NAMESPACES": None,
                                                                 "DDPJOB_ALL_NAMESPACES": None})


@pytest.mark.parametrize("args, needle", [
    ((), "--all-namespaces"),                          # no silent "default"
    (("-n", "a", "-A"), "exclude each other"),
    (("-A", "--log-level", "VERBOSE"), "VERBOSE"),
    (("-A", "--log-format", "xml"), "xml"),
])
def test_refused_before_anything_starts(started, args, needle):
    res = invoke(*args)
    assert res.exit_code == 2 and needle in res.output and started == [], res.output


@pytest.mark.parametrize("args, namespaces, everywhere, level, fmt", [
    (("-n", "a,b", "-n", "c"), ("a", "b", "c"), False, "INFO", "text"),
    (("-A", "--log-level", "debug", "--log-format", "json"), (), True, "DEBUG", "json"),
])
def test_accepted(started, args, namespaces, everywhere, level, fmt):
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    (cfg,) = started
    assert (cfg.namespaces, cfg.all_namespaces, cfg.log_level, cfg.log_format) == (namespaces, everywhere, level, fmt)


def test_the_default_mlflow_tracking_uri_is_a_flag_and_an_env_var(started, monkeypatch):
    assert invoke("-A", "--mlflow-tracking-uri", "http://mlflow.mlops:5000").exit_code == 0
    monkeypatch.setenv("DDPJOB_MLFLOW_TRACKING_URI", "http://from-env:5000")   # as every flag
    assert invoke("-A").exit_code == 0
    assert [c.mlflow_tracking_uri for c in started] == ["http://mlflow.mlops:5000", "http://from-env:5000"]


def test_json_logs_are_one_object_per_line():
    handler = operator_main.log_handler("json")
    record = logging.LogRecord("ddpjob.reconcile", logging.WARNING, __file__, 1, "job %s restarted", ("ns/a",), None)
    line = handler.format(record)
    assert "\n" not in line
    obj = json.loads(line)
    assert (obj["level"], obj["logger"], obj["message"]) == ("WARNING", "ddpjob.reconcile", "job ns/a restarted")
    assert obj["time"]
    assert not operator_main.log_handler("text").format(record).startswith("{")
