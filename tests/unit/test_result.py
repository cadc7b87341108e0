"""status.result: the training's final numbers, from node 0's termination message."""
from __future__ import annotations

import functools
import json
import os
import sys

import pytest

from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions.result import parse_result, run_result
from tests.support.builders import make_pod

RESULT = {"steps": 276, "total_steps": 276, "epochs_completed": 12, "world_size": 2, "resumed_from_step": 100,
          "train_samples_per_second": 812.5, "eval_accuracy": 0.9666, "eval_loss": 0.11,
          "eval_samples": 359, "eval_dataset_size": 359, "last_checkpoint": "/ckpt/step-276"}


# A node's pod once its launcher has exited (0, unless a case says otherwise).
finished = functools.partial(make_pod, phase="Succeeded", exit_code=0)


def test_every_known_field_is_copied_under_its_status_name():
    assert parse_result(json.dumps(RESULT)) == {
        "steps": 276, "totalSteps": 276, "epochsCompleted": 12, "worldSize": 2, "resumedFromStep": 100,
        "trainSamplesPerSecond": 812.5, "evalAccuracy": 0.9666, "evalLoss": 0.11, "evalSamples": 359,
        "evalDatasetSize": 359}


@pytest.mark.parametrize("message", [None, "", "training exited with code 1", "[1, 2]", '{"steps": ',
                                     '{"unknown": 1}'])
def test_anything_that_is_not_a_result_gives_nothing(message):
    assert parse_result(message) == {}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, "0.9", True, None])
def test_non_finite_negative_or_non_numeric_values_are_dropped(bad):
    # json.dumps writes NaN/Infinity, which json.loads reads back: a pod could send them.
    out = parse_result(json.dumps({"eval_accuracy": bad, "steps": 5}))
    assert out == {"steps": 5}


@pytest.mark.parametrize("pods, attempt, want", [
    ([finished(message=json.dumps(RESULT))], 0, 359),
    # torchrun's c10d rendezvous may give rank 0 to another pod: its launcher reports the result.
    ([finished(rank=1, message=json.dumps(RESULT))], 0, 359),
    ([finished(attempt=0, message=json.dumps(RESULT))], 1, None),                   # an earlier attempt's pod
    ([finished(phase="Failed", exit_code=1, message=json.dumps(RESULT))], 0, None),  # failed: no result
    ([finished(message="done")], 0, None),
    ([finished(rank=1), finished(message=json.dumps(RESULT))], 0, 359),
])
def test_run_result_reads_rank_0s_pod_of_the_current_attempt_on_success(pods, attempt, want):
    assert run_result(Group.of(pods).at(attempt)).get("evalSamples") == want


def test_the_launcher_reports_the_result_file_as_its_termination_message(termination_log, monkeypatch):
    """The real launcher, a real child process that writes a result file like rank 0 does."""
    from ddpjob_trainer.launch.node import main

    term = termination_log
    monkeypatch.setenv("NODE_RANK", "0")
    script = ("import json, os; json.dump(" + repr(RESULT) + ", open(os.environ['DDPJOB_RESULT_FILE'], 'w'))")
    assert main(["--", sys.executable, "-c", script]) == 0
    assert parse_result(term.read_text())["evalSamples"] == 359


def test_a_command_that_writes_no_result_leaves_no_termination_message(termination_log, monkeypatch):
    from ddpjob_trainer.launch.node import main

    term = termination_log
    monkeypatch.setenv("NODE_RANK", "0")
    assert main(["--", sys.executable, "-c", "pass"]) == 0
    assert not os.path.exists(term)
