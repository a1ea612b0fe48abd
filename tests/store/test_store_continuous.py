"""A continuous job in the store: groups launched as it goes, handed out whole and
once (a take call's id gets the same groups again), members restarted with their
tokens counted, the staleness bound applied at hand-out (flag, restart, cut), and
the job completed only once its plan is closed."""

from __future__ import annotations

import json

import pytest
from store_helpers import FakeClock

from treadle.store import Store
from treadle.store.jobs import PlannedTrajectory
from treadle.store.record import trajectory_to_record
from treadle.store.staleness import cut_record
from treadle.types import (
    GroupKey,
    StaleChoice,
    TokenSegment,
    Trajectory,
    TrajectoryStatus,
    Turn,
)


def _members(group: str, n: int = 2) -> list[PlannedTrajectory]:
    return [PlannedTrajectory(f"{group}/{r}", group, "task", r) for r in range(n)]


def _done(p: PlannedTrajectory, versions: tuple[int, ...] = (0, 0, 1, 1)) -> Trajectory:
    """A finished member whose 4 sampled tokens carry `versions`."""
    return Trajectory(p.trajectory_id, GroupKey(p.group_id, p.repetition), task_id="task",
                      prompt_tokens=2, status=TrajectoryStatus.COMPLETED, reward=1.0,
                      turns=[Turn(0, len(versions), policy_version=max(versions))],
                      segments=[TokenSegment([1, 2], [5, 6, 7, 8], [1] * len(versions),
                                             [-0.5] * len(versions), list(versions))])


def _store() -> Store:
    store = Store(":memory:", clock=FakeClock())
    store.create_job("j", {}, [], continuous=True)
    return store


def test_groups_are_handed_out_whole_and_once() -> None:
    with _store() as store:
        store.launch_group("j", "g0", _members("g0"))
        store.launch_group("j", "g1", _members("g1"))
        for p in _members("g1"):  # g1 whole first: handed out first
            store.finish("j", _done(p))
        store.finish("j", _done(_members("g0")[0]))
        assert [g.group_id for g in store.take("j", "a", 2)] == ["g1"]
        assert store.take("j", "b", 2) == []  # g0 is not whole
        store.finish("j", _done(_members("g0")[1]))
        assert [(g.taken, g.group_id) for g in store.take("j", "a", 2)] == [(1, "g1"), (2, "g0")]
        again = store.take("j", "a", 2)  # the same call: the same groups
        assert [g.group_id for g in again] == ["g1", "g0"]
        assert [len(g.members) for g in again] == [2, 2]
        assert store.take("j", "c", 1) == []  # another call: none of them
        assert [g.taken for g in store.taken_groups("j", after=1)] == [2]
        assert store.groups_launched("j") == (2, 2, 0)
        assert not store.job("j").status.terminal  # open: more groups may come
        store.close_plan("j")
        assert store.job("j").status.value == "completed"


def test_the_last_group_closes_the_plan() -> None:
    with _store() as store:
        store.launch_group("j", "g0", _members("g0", 1), close=True)
        store.finish("j", _done(_members("g0", 1)[0]))
        assert store.job("j").status.value == "completed"


def test_a_restart_supersedes_a_member_and_counts_its_tokens() -> None:
    with _store() as store:
        old, other = _members("g0")
        store.launch_group("j", "g0", [old, other])
        store.start("j", old.trajectory_id)
        store.finish("j", _done(other))
        new = PlannedTrajectory(f"{old.trajectory_id}~1", "g0", "task", 0)
        # Running: ended as aborted, the tokens it had sampled discarded.
        assert store.restart("j", old.trajectory_id, new, 3, sampled=17) == 17
        assert store.result("j", old.trajectory_id) is not None
        assert store.take("j", "a", 1) == []  # its group waits for the new member
        assert store.restart("j", old.trajectory_id, new, 3) is None  # superseded once
        newer = PlannedTrajectory(f"{other.trajectory_id}~1", "g0", "task", 1)
        assert store.restart("j", other.trajectory_id, newer, 3) == 4  # its record's
        store.finish("j", _done(new))
        store.finish("j", _done(newer))
        [group] = store.take("j", "a", 1)
        assert [d.trajectory_id for d in group.members] == [new.trajectory_id,
                                                            newer.trajectory_id]
        events = [e.payload for e in store.events("j") if e.kind == "stale_restart"]
        assert [(e["tokens_discarded"], e["policy_version"]) for e in events] == [(17, 3),
                                                                                 (4, 3)]
        assert store.restart("j", new.trajectory_id, PlannedTrajectory(
            f"{new.trajectory_id}~2", "g0", "task", 0), 4) is None  # taken: never


@pytest.mark.parametrize("choice", list(StaleChoice))
def test_the_bound_at_hand_out(choice: StaleChoice) -> None:
    """Members whose oldest token is version 0, taken with version 1 the oldest
    fresh one: flagged, left for a restart, or cut to their version-1 tokens."""
    with _store() as store:
        store.launch_group("j", "g0", _members("g0"))
        for p in _members("g0"):
            store.finish("j", _done(p))
        assert [d.trajectory_id for d, v in store.stale_members("j", 1)] == [
            "g0/0", "g0/1"]
        got = store.take("j", "a", 1, min_fresh=1, choice=choice)
        if choice is StaleChoice.RESTART:
            assert got == []
            return
        [group] = got
        assert group.stale is (choice is StaleChoice.FLAG)
        for d in group.members:
            seg = d.trajectory().segments[0]
            assert seg.response_ids == [5, 6, 7, 8]  # the ids as they were sampled
            if choice is StaleChoice.CUT:
                assert (seg.loss_mask, seg.logprobs) == ([0, 0, 1, 1], [0.0, 0.0, -0.5, -0.5])
            else:
                assert seg.loss_mask == [1, 1, 1, 1]
        assert store.take("j", "a", 1, min_fresh=1, choice=choice) == got  # as stored


def test_a_trajectory_with_nothing_fresh_or_no_tokens_cannot_be_cut() -> None:
    p = _members("g0")[0]
    old = json.dumps(_record(_done(p, (0, 0, 0, 0))))
    assert cut_record(old, 1) is None
    replay = Trajectory(p.trajectory_id, GroupKey("g0", 0), status=TrajectoryStatus.COMPLETED,
                        turns=[Turn(0, 9, policy_version=0)])
    assert cut_record(json.dumps(_record(replay)), 1) is None


def _record(t: Trajectory) -> dict[str, object]:
    return trajectory_to_record(t)
