"""A bad record never fails a batch: a trajectory with no token segments (a session
ended before any call) is skipped by every converter, logged, and counted where the
caller reads it (`Batch.skipped`, `Converted.skipped`), and the rest trains as if it
were not there."""

from __future__ import annotations

import logging

import pytest
from client_helpers import traj

from treadle.client.samples import NO_TOKENS, training_sequences
from treadle.client.skyrl import to_skyrl
from treadle.client.trl import to_trl
from treadle.client.verl import to_verl
from treadle.types import Trajectory


def _batch() -> list[Trajectory]:
    empty = traj("empty", "g", 2, reward=1.0)
    empty.segments = []  # stored `completed`, reward 1.0, no turn: the probe's record
    return [traj("a", "g", 0, 1.0), traj("b", "g", 1, 0.0), empty]


def test_training_sequences_skip_a_record_without_tokens_and_say_so(
        caplog: pytest.LogCaptureFixture) -> None:
    batch = _batch()
    with caplog.at_level(logging.WARNING, logger="treadle.client.samples"):
        out = training_sequences(batch)
    assert [s.trajectory_id for s in out.sequences] == ["a", "b"]
    assert out.skipped == 1
    (skipped,) = out.exclusions
    assert (skipped.trajectory_id, skipped.reason, skipped.skipped) == ("empty", NO_TOKENS, True)
    assert "skipped 1 trajectories with no token segments" in caplog.text
    assert "empty" in caplog.text
    # Its reward is in no baseline: the group's advantages are those of a and b alone.
    alone = training_sequences(batch[:2])
    assert [s.advantage for s in out.sequences] == [s.advantage for s in alone.sequences]
    # It is no failure: its group is not dropped for it.
    kept = training_sequences(batch, drop_group_on_failure=True)
    assert [s.trajectory_id for s in kept.sequences] == ["a", "b"]


def test_every_converter_converts_the_rest() -> None:
    batch = _batch()
    verl = to_verl(batch)
    assert [r["extra_fields"]["treadle_trajectory_id"] for r in verl.data] == ["a", "b"]
    assert verl.skipped == 1
    masked = to_verl(batch, drop_failed=False)  # positional: a masked row stands for it
    assert masked.skipped == 1
    assert masked.data[-1]["extra_fields"]["treadle_excluded"] == NO_TOKENS
    trl = to_trl(batch, pad_token_id=0)
    assert trl.data["treadle_excluded"] == [None, None, NO_TOKENS]
    assert trl.data["env_mask"][-1] == [0] and trl.skipped == 1
    skyrl = to_skyrl(batch, step_wise=True)
    assert skyrl.skipped == 1 and len(skyrl.data["response_ids"]) == 2
