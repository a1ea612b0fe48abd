"""The shared policy: exclusions, group dropping, segments and their rewards."""

from __future__ import annotations

import pytest
from client_helpers import error, traj

from treadle.client import (
    ConversionError,
    exclusion_reason,
    group_advantages,
    in_group_order,
    training_sequences,
)
from treadle.types import TrajectoryStatus


def test_errors_and_aborts_are_excluded_other_endings_train() -> None:
    batch = [traj("a", "g", 0, 1.0), error("b", "g", 1),
             traj("c", "g", 2, 0.0, status=TrajectoryStatus.TIMEOUT),
             traj("d", "g", 3, 0.0, status=TrajectoryStatus.TRUNCATED),
             traj("e", "g", 4, 0.0, status=TrajectoryStatus.MAX_TURNS),
             traj("f", "g", 5, None, status=TrajectoryStatus.ABORTED)]
    out = training_sequences(batch)
    assert [s.trajectory_id for s in out.sequences] == ["a", "c", "d", "e"]
    assert [(e.trajectory_id, e.status) for e in out.exclusions] == \
        [("b", TrajectoryStatus.ERROR), ("f", TrajectoryStatus.ABORTED)]
    assert out.exclusions[0].reason == "infra_failure (tool): error"
    assert exclusion_reason(batch[5]) == "aborted: aborted"
    assert exclusion_reason(batch[2]) is None


def test_the_baseline_is_over_the_members_that_ran() -> None:
    batch = [traj("a", "g", 0, 1.0), traj("b", "g", 1, 0.0), error("c", "g", 2),
             traj("d", "g", 3, 0.5)]
    out = training_sequences(batch)
    expected = group_advantages([1.0, 0.0, 0.5], ["g"] * 3)
    assert [s.advantage for s in out.sequences] == expected


def test_drop_group_on_failure_excludes_the_siblings() -> None:
    batch = [traj("a", "g", 0, 1.0), error("b", "g", 1), traj("c", "h", 0, 1.0),
             traj("d", "h", 1, 0.0)]
    out = training_sequences(batch, drop_group_on_failure=True)
    assert [s.trajectory_id for s in out.sequences] == ["c", "d"]
    assert [(e.trajectory_id, e.reason) for e in out.exclusions] == [
        ("a", "group member b excluded"), ("b", "infra_failure (tool): error")]


def test_kept_failures_are_masked_with_no_reward() -> None:
    batch = [traj("a", "g", 0, 1.0), error("b", "g", 1), error("c", "g", 2, with_tokens=False)]
    out = training_sequences(batch, drop_failed=False)
    rows = {s.trajectory_id: s for s in out.sequences}
    assert set(rows) == {"a", "b", "c"}
    for tid in ("b", "c"):
        row = rows[tid]
        assert row.reward is None and row.advantage is None and row.excluded
        assert set(row.loss_mask) <= {0} and set(row.logprobs) <= {0.0}
        assert len(row.loss_mask) == len(row.response_ids) == len(row.logprobs)
    assert rows["c"].response_ids == [] and rows["c"].is_last_segment
    assert rows["b"].response_ids == batch[1].segments[0].response_ids
    assert rows["a"].advantage == 0.0  # alone among the trained: no baseline


def test_each_segment_carries_the_trajectory_reward_and_advantage() -> None:
    batch = [traj("a", "g", 0, 1.0, segments=3), traj("b", "g", 1, 0.0)]
    out = training_sequences(batch)
    assert [(s.trajectory_id, s.segment_index, s.num_segments) for s in out.sequences] == \
        [("a", 0, 3), ("a", 1, 3), ("a", 2, 3), ("b", 0, 1)]
    assert [s.is_last_segment for s in out.sequences] == [False, False, True, True]
    assert [s.reward for s in out.sequences] == [1.0, 1.0, 1.0, 0.0]
    # The trajectory counts once in the baseline, not once per segment.
    once = group_advantages([1.0, 0.0], ["g", "g"])
    assert [s.advantage for s in out.sequences] == [once[0]] * 3 + [once[1]]
    for s, seg in zip(out.sequences[:3], batch[0].segments, strict=True):
        assert (s.prompt_ids, s.response_ids, s.loss_mask, s.logprobs, s.policy_versions) == \
            (seg.prompt_ids, seg.response_ids, seg.loss_mask, seg.logprobs, seg.policy_versions)


def test_refuses_what_cannot_train() -> None:
    running = traj("a", "g", 0)
    running.status = TrajectoryStatus.RUNNING
    with pytest.raises(ConversionError, match="not finished"):
        training_sequences([running])
    with pytest.raises(ConversionError, match="has no reward"):
        training_sequences([traj("a", "g", 0, None, status=TrajectoryStatus.TIMEOUT)])
    with pytest.raises(ConversionError, match="appears twice"):
        training_sequences([traj("a", "g", 0), traj("a", "g", 1)])
    with pytest.raises(ConversionError, match="repetition 0 twice"):
        training_sequences([traj("a", "g", 0), traj("b", "g", 0)])
    assert isinstance(ConversionError("x"), ValueError)


def test_in_group_order_follows_the_prompt_list() -> None:
    batch = [traj("h1", "h", 1), traj("g0", "g", 0), traj("h0", "h", 0), traj("g1", "g", 1)]
    assert [t.trajectory_id for t in in_group_order(batch, ["h", "g"])] == \
        ["h0", "h1", "g0", "g1"]
    with pytest.raises(ConversionError, match="not listed"):
        in_group_order(batch, ["h"])
    with pytest.raises(ConversionError, match="same number"):
        in_group_order(batch[:3], ["h", "g"])
    with pytest.raises(ConversionError, match="same number"):
        in_group_order(batch, ["h", "g", "k"])
