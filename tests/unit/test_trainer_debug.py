"""The test knobs: a freeze happens once, in the job's first start of the rank, at its step."""
from __future__ import annotations

import pytest

from ddpjob_trainer import debug


class Frozen(Exception):
    pass


def _raise() -> None:
    raise Frozen


@pytest.mark.parametrize("env, rank, step, frozen", [
    ({"DDPJOB_DEBUG_FREEZE_RANK": "1:5"}, 1, 5, True),
    ({"DDPJOB_DEBUG_FREEZE_RANK": "1:5"}, 1, 4, False),
    ({"DDPJOB_DEBUG_FREEZE_RANK": "1:5"}, 0, 5, False),                          # another rank's
    ({"DDPJOB_DEBUG_FREEZE_RANK": "1:5", "DDPJOB_RESTART": "1"}, 1, 5, False),   # restarted in place
    ({"DDPJOB_DEBUG_FREEZE_RANK": "1:5", "DDPJOB_ATTEMPT": "1"}, 1, 5, False),   # restarted as a group
    # A first start that resumed past the step (a replacement pod's: its agent's first start, in
    # attempt 0) takes steps 24, 25, ... and never freezes: the hang was a one-off.
    ({"DDPJOB_DEBUG_FREEZE_RANK": "1:5"}, 1, 24, False),
])
def test_a_freeze_happens_at_its_step_in_the_ranks_first_start_only(monkeypatch, env, rank, step, frozen):
    monkeypatch.setattr(debug, "_freeze", _raise)
    knobs = debug.Knobs.from_env(rank=rank, env=env)
    if frozen:
        with pytest.raises(Frozen):
            knobs.after_step(step)
    else:
        knobs.after_step(step)


@pytest.mark.parametrize("env, step, waits", [
    ({"DDPJOB_DEBUG_AWAIT_SIGTERM": "4"}, 4, True),
    ({"DDPJOB_DEBUG_AWAIT_SIGTERM": "4"}, 3, False),
    ({"DDPJOB_DEBUG_AWAIT_SIGTERM": "4", "DDPJOB_ATTEMPT": "1"}, 4, False),   # the next attempt goes on
    ({}, 4, False),
])
def test_a_rank_waits_for_sigterm_at_its_step_in_the_first_start_only(capsys, env, step, waits):
    """Until SIGTERM is noted (here: the third look), announced on stderr for a test to wait on."""
    looks = []
    knobs = debug.Knobs.from_env(rank=1, env=env)
    knobs.before_stop_vote(step, sigterm_noted=lambda: looks.append(1) or len(looks) >= 3)
    assert len(looks) == (3 if waits else 0)
    line = debug.AWAIT_LINE.format(rank=1, step=4)
    assert (line in capsys.readouterr().err) is waits


def test_the_write_bandwidth_stand_in_is_read_on_every_start():
    assert debug.Knobs.from_env(rank=0, env={"DDPJOB_DEBUG_WRITE_BANDWIDTH": "1000",
                                             "DDPJOB_ATTEMPT": "2"}).write_bandwidth == 1000.0
    assert debug.Knobs.from_env(rank=0, env={}).write_bandwidth is None


@pytest.mark.parametrize("attempt, restart, held", [("1", "0", True), ("1", "2", True), ("0", "0", False),
                                                    ("2", "0", False)])
def test_a_hold_waits_for_its_file_in_its_attempt_renewing_the_stage(tmp_path, monkeypatch, capsys, attempt, restart,
                                                                      held):
    """In its attempt (any start), every step boundary waits until the file exists, calling `alive`
    meanwhile (the watchdogs' progress); once the file is there, or in another attempt, no wait."""
    monkeypatch.setattr(debug, "HOLD_RENEW_SECONDS", 0.0)
    release = tmp_path / "release"
    knobs = debug.Knobs.from_env(rank=1, env={"DDPJOB_DEBUG_HOLD": f"1:{release}", "DDPJOB_ATTEMPT": attempt,
                                              "DDPJOB_RESTART": restart})
    renewals = []

    def alive():  # the third renewal: the test creates the file
        renewals.append(1)
        if len(renewals) == 3:
            release.touch()
    assert knobs.hold(7, alive=alive) is held
    assert len(renewals) == (3 if held else 0)
    err = capsys.readouterr().err
    assert (debug.HOLD_LINE.format(rank=1, step=7, path=release) in err) is held
    assert (debug.RELEASED_LINE.format(rank=1, step=7) in err) is held
    release.touch()
    assert knobs.hold(8, alive=alive) is False  # released: the next boundaries go on
