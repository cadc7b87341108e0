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
