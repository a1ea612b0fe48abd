"""Frozen sub-agents and segment starts in the shared policy, the stream and groups.

A frozen sub-agent (``trainable`` false) is excluded like an aborted trajectory but is
no failure: it needs no reward, never enters its group's baseline and never drops its
group. Each segment's `start_reason` reaches its training sequence.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from client_helpers import error, traj

from treadle.client import ConversionError, exclusion_reason, group_advantages, training_sequences
from treadle.client.groups import GroupCollector
from treadle.client.stream import StreamCursor
from treadle.client.wire import Delivered, decode_trajectory
from treadle.store.record import dumps_record, trajectory_to_record
from treadle.types import Trajectory, TrajectoryStatus


def frozen(tid: str, group: str, rep: int, parent: str | None = "p0", *,
           reward: float | None = None,
           status: TrajectoryStatus = TrajectoryStatus.COMPLETED) -> Trajectory:
    """A frozen sub-agent as the runtime records it: every token at mask 0."""
    t = traj(tid, group, rep, reward, status=status)
    t.trainable, t.parent_id = False, parent
    for seg in t.segments:
        seg.loss_mask = [0] * len(seg.response_ids)
        seg.logprobs = [0.0] * len(seg.response_ids)
    return t


def test_a_frozen_sub_agent_is_excluded_with_its_parent_named() -> None:
    child, orphan = frozen("c0", "sub", 0, "p0"), frozen("c1", "sub", 1, None)
    assert exclusion_reason(child) == "frozen sub-agent (of p0)"
    assert exclusion_reason(orphan) == "frozen"
    out = training_sequences([traj("p0", "g", 0, 1.0), child, orphan])
    assert [s.trajectory_id for s in out.sequences] == ["p0"]
    assert [(e.trajectory_id, e.group_id, e.status, e.reason) for e in out.exclusions] == [
        ("c0", "sub", TrajectoryStatus.COMPLETED, "frozen sub-agent (of p0)"),
        ("c1", "sub", TrajectoryStatus.COMPLETED, "frozen")]


def test_frozen_comes_before_the_status_in_the_reason() -> None:
    # Frozen whatever happened to it: an error or an abort among frozen sub-agents
    # is still no training data for the same reason.
    for status in (TrajectoryStatus.ERROR, TrajectoryStatus.ABORTED):
        t = frozen("c0", "sub", 0, status=status)
        if status is TrajectoryStatus.ERROR:
            t.failure_stage = error("x", "g", 0).failure_stage
        assert exclusion_reason(t) == "frozen sub-agent (of p0)"


def test_a_frozen_sub_agent_needs_no_reward() -> None:
    out = training_sequences([traj("a", "g", 0, 1.0), frozen("c", "g", 1, reward=None)])
    assert [e.trajectory_id for e in out.exclusions] == ["c"]
    # The same trajectory trainable and unscored is refused.
    unscored = frozen("c", "g", 1, reward=None)
    unscored.trainable = True
    with pytest.raises(ConversionError, match="has no reward"):
        training_sequences([traj("a", "g", 0, 1.0), unscored])
    # It must still be finished: a batch is of terminal trajectories.
    running = frozen("c", "g", 1)
    running.status = TrajectoryStatus.RUNNING
    with pytest.raises(ConversionError, match="not finished"):
        training_sequences([running])


def test_a_frozen_member_does_not_change_its_groups_advantages() -> None:
    members = [traj("a", "g", 0, 1.0), traj("b", "g", 1, 0.0), traj("d", "g", 3, 0.5)]
    without = training_sequences(members)
    # Scored, even with the reward that would move the baseline most: it is not counted.
    with_frozen = training_sequences([*members[:2], frozen("c", "g", 2, reward=100.0),
                                      members[2]])
    assert [s.advantage for s in with_frozen.sequences] == \
        [s.advantage for s in without.sequences] == \
        group_advantages([1.0, 0.0, 0.5], ["g"] * 3)
    assert [e.trajectory_id for e in with_frozen.exclusions] == ["c"]


def test_a_frozen_member_does_not_drop_its_group_on_failure() -> None:
    batch = [traj("a", "g", 0, 1.0), frozen("b", "g", 1), traj("c", "g", 2, 0.0),
             frozen("e", "h", 0, status=TrajectoryStatus.ERROR), traj("f", "h", 1, 0.5),
             traj("i", "h", 2, 0.25)]
    batch[3].failure_stage = error("x", "g", 0).failure_stage
    out = training_sequences(batch, drop_group_on_failure=True)
    assert [s.trajectory_id for s in out.sequences] == ["a", "c", "f", "i"]
    assert [(e.trajectory_id, e.reason) for e in out.exclusions] == [
        ("b", "frozen sub-agent (of p0)"), ("e", "frozen sub-agent (of p0)")]
    # A real failure still drops the group, and the frozen member keeps its own reason.
    batch.append(error("j", "g", 3))
    out = training_sequences(batch, drop_group_on_failure=True)
    assert [s.trajectory_id for s in out.sequences] == ["f", "i"]
    assert {e.trajectory_id: e.reason for e in out.exclusions} == {
        "a": "group member j excluded", "b": "frozen sub-agent (of p0)",
        "c": "group member j excluded", "e": "frozen sub-agent (of p0)",
        "j": "infra_failure (tool): error"}


def test_a_kept_frozen_row_is_masked_like_an_aborted_one() -> None:
    aborted = traj("x", "g", 1, None, status=TrajectoryStatus.ABORTED)
    child = frozen("c", "g", 2, reward=1.0)
    out = training_sequences([traj("a", "g", 0, 1.0), aborted, child], drop_failed=False)
    rows = {s.trajectory_id: s for s in out.sequences}
    for tid in ("x", "c"):
        assert rows[tid].reward is None and rows[tid].advantage is None
        assert set(rows[tid].loss_mask) == {0} and set(rows[tid].logprobs) == {0.0}
        assert rows[tid].excluded == exclusion_reason(aborted if tid == "x" else child)
    assert rows["c"].response_ids == child.segments[0].response_ids


def test_each_segment_gives_a_sequence_with_its_start_reason() -> None:
    t = traj("a", "g", 0, 1.0, segments=2)
    t.segments[1].start_turn, t.segments[1].start_reason = 1, "messages_edited"
    out = training_sequences([t, traj("b", "g", 1, 0.0)])
    assert [(s.trajectory_id, s.segment_index, s.start_reason) for s in out.sequences] == \
        [("a", 0, "start"), ("a", 1, "messages_edited"), ("b", 0, "start")]
    assert out.sequences[1].response_ids == t.segments[1].response_ids
    # A masked row without tokens has no segment: it reads as a start.
    kept = training_sequences([error("e", "g", 0, with_tokens=False)], drop_failed=False)
    assert [s.start_reason for s in kept.sequences] == ["start"]


def _wire(t: Trajectory) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(dumps_record(trajectory_to_record(t)))
    return value


def test_the_stream_carries_the_sub_agent_fields() -> None:
    parent = traj("p0", "g", 0, 1.0, segments=2)
    parent.children = ["c0", "c1"]
    parent.metadata = {"harness": "claude-code", "depth": 0, "tags": ["a", None, 1.5]}
    parent.segments[1].start_turn, parent.segments[1].start_reason = 1, "system_changed"
    child = frozen("c0", "p0/sub", 0)
    cursor = StreamCursor("j", 0)
    data = b"".join(f'{{"seq":{i + 1},"trajectory":{dumps_record(trajectory_to_record(t))}}}\n'
                    .encode() for i, t in enumerate([parent, child]))
    delivered = cursor.feed(data)
    assert [d.trajectory for d in delivered] == [parent, child]
    assert delivered[1].trajectory.trainable is False
    assert delivered[1].trajectory.parent_id == "p0"


def test_a_version_1_record_from_an_older_service_reads_with_the_defaults() -> None:
    record = _wire(traj("a", "g", 0, 1.0))
    record["version"] = 1
    for key in ("parent_id", "children", "trainable", "metadata", "reward_source",
                "policy_span", "kv_across_updates", "rewards", "judgements", "resumed"):
        del record[key]
    for seg in record["segments"]:
        del seg["start_turn"], seg["start_reason"]
    t = decode_trajectory(record, "test")
    assert (t.parent_id, t.children, t.trainable, t.metadata) == (None, [], True, {})
    assert t == traj("a", "g", 0, 1.0)


def test_a_group_names_its_frozen_members_among_the_excluded() -> None:
    collector = GroupCollector(3)
    members = [traj("a", "g", 0, 1.0), frozen("b", "g", 1), traj("c", "g", 2, 0.0)]
    group = None
    for i, t in enumerate(members):
        group = collector.add(Delivered(i + 1, t))
    assert group is not None
    assert group.excluded == {"b": "frozen sub-agent (of p0)"}
    assert group.infra_failures == []
    assert [t.trajectory_id for t in group.trainable] == ["a", "c"]
    assert [s.trajectory_id for s in group.batch(drop_group_on_failure=True).sequences] == \
        ["a", "c"]
