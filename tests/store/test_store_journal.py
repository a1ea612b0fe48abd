"""The turn journal in the store: only live attempts' turns are kept, a finished,
cancelled or failed trajectory has none, and a resume drops the turns it does not
keep so that no later resume mixes two histories."""

from __future__ import annotations

import random

import pytest
from store_helpers import FakeClock, plan, random_trajectory

from treadle.store import JournalRow, Store
from treadle.store.journal import JournalResume
from treadle.types import TrajectoryStatus


@pytest.fixture
def store() -> Store:
    return Store(":memory:", clock=FakeClock())


def _row(tid: str, attempt: int, turn: int, tokens: int = 5) -> JournalRow:
    return JournalRow("j", tid, attempt, turn, tokens, f"{turn}@{attempt}".encode())


def test_a_live_attempts_turns_read_back_in_order(store: Store) -> None:
    planned = plan(1, 2)
    store.create_job("j", {}, planned)
    tid = planned[0].trajectory_id
    assert store.start("j", tid) == 0
    assert store.write_journal([_row(tid, 0, 1), _row(tid, 0, 0), _row(tid, 0, 3)]).rows == 3
    got = store.journaled("j", tid)
    # Turn 3 follows a gap (turn 2 never reached the store): not part of the history.
    assert got.turns == (b"0@0", b"1@0")
    assert got.tokens == 10 and got.resumes == ()
    # Not started, or an attempt a restart has replaced: nothing is written.
    other = planned[1].trajectory_id
    assert store.write_journal([_row(other, 0, 0)]).rows == 0
    store.recover()
    assert store.start("j", tid) == 1
    assert store.write_journal([_row(tid, 0, 2)]).rows == 0  # the dead attempt's late turn
    assert store.write_journal([_row(tid, 1, 2)]).rows == 1


def test_a_resume_drops_the_turns_it_does_not_keep(store: Store) -> None:
    planned = plan(1, 1)
    store.create_job("j", {}, planned)
    tid = planned[0].trajectory_id
    store.start("j", tid)
    store.write_journal([_row(tid, 0, n) for n in range(4)])
    store.recover()
    store.start("j", tid)
    store.write_journal([JournalResume("j", tid, 1, 2, b"point 1")])
    store.write_journal([_row(tid, 1, 2, tokens=7)])
    got = store.journaled("j", tid)
    assert got.turns == (b"0@0", b"1@0", b"2@1")
    assert got.resumes == (b"point 1",) and got.tokens == 17


@pytest.mark.parametrize("end", ["finish", "cancel", "fail"])
def test_a_trajectory_that_ends_has_no_journal(store: Store, end: str) -> None:
    planned = plan(1, 2)
    store.create_job("j", {}, planned)
    for p in planned:
        store.start("j", p.trajectory_id)
        store.write_journal([_row(p.trajectory_id, 0, 0)])
    p = planned[0]
    if end == "finish":
        store.finish("j", random_trajectory(random.Random(0), p, TrajectoryStatus.COMPLETED))
    elif end == "cancel":
        store.cancel("j")
    else:
        store.fail("j", "gone")
    assert store.journaled("j", p.trajectory_id).turns == ()
    # A late batch of the ended trajectory is not written.
    assert store.write_journal([_row(p.trajectory_id, 0, 1)]).rows == 0
    left = store.journaled("j", planned[1].trajectory_id).turns
    assert len(left) == (1 if end == "finish" else 0)
