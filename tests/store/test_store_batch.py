"""Batches: calls that commit together, each still atomic (`treadle.store.transactions`),
and the async store's group commit of the calls made while its worker was busy."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from store_helpers import plan, random_trajectory

from treadle.store import AsyncStore, NotFound, Store
from treadle.store.errors import StoreError
from treadle.store.transactions import Transactions
from treadle.types import TrajectoryStatus

_T = TypeVar("_T")


@pytest.fixture
def tx(tmp_path: Path) -> Iterator[Transactions]:
    conn = sqlite3.connect(tmp_path / "t.db", isolation_level=None,
                           check_same_thread=False)
    conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY)")
    yield Transactions(conn)
    conn.close()


class _Hold:
    """A store call that holds the worker until released, so that the calls made
    meanwhile queue behind it (and run as one batch after it)."""

    def __init__(self) -> None:
        self._entered = threading.Event()
        self._gate = threading.Event()

    def __call__(self) -> None:
        self._entered.set()
        self._gate.wait(60)

    async def entered(self) -> None:
        await asyncio.to_thread(self._entered.wait, 60)

    def release(self) -> None:
        self._gate.set()


async def _queued(calls: list[Coroutine[Any, Any, _T]]) -> list[asyncio.Task[_T]]:
    """The store calls started as tasks, in order, once each has queued its call (a
    call queues in its task's first step, before it first waits)."""
    left = len(calls)
    started = asyncio.Event()

    async def start(call: Coroutine[Any, Any, _T]) -> _T:
        nonlocal left
        left -= 1
        if not left:
            started.set()
        return await call  # queues in this step; the waiter wakes after it
    tasks = [asyncio.ensure_future(start(c)) for c in calls]
    await started.wait()
    return tasks


def _keys(tx: Transactions) -> list[str]:
    return [k for (k,) in tx.conn.execute("SELECT k FROM t ORDER BY k")]


def test_a_call_that_raises_in_a_batch_undoes_its_own_writes_only(tx: Transactions) -> None:
    with tx.batch():
        with tx.write():
            tx.conn.execute("INSERT INTO t VALUES ('a')")
        with pytest.raises(ZeroDivisionError), tx.write():
            tx.conn.execute("INSERT INTO t VALUES ('b')")
            raise ZeroDivisionError
        with tx.read():  # a later call sees the earlier ones' writes
            assert _keys(tx) == ["a"]
        with tx.write():
            tx.conn.execute("INSERT INTO t VALUES ('c')")
    assert _keys(tx) == ["a", "c"] and not tx.conn.in_transaction


def test_a_batch_whose_transaction_was_lost_commits_nothing(tx: Transactions) -> None:
    with pytest.raises(StoreError), tx.batch():
        with tx.write():
            tx.conn.execute("INSERT INTO t VALUES ('a')")
        tx.conn.execute("ROLLBACK")  # as SQLite does itself on some errors
        with tx.write():  # not a transaction of its own, apart from the batch's
            tx.conn.execute("INSERT INTO t VALUES ('b')")
    assert _keys(tx) == [] and not tx.conn.in_transaction


def test_a_batch_that_raises_commits_none_of_its_calls(tx: Transactions) -> None:
    with pytest.raises(KeyError), tx.batch():
        with tx.write():
            tx.conn.execute("INSERT INTO t VALUES ('a')")
        raise KeyError("the batch's own failure")
    with tx.write():  # and the connection is usable after
        tx.conn.execute("INSERT INTO t VALUES ('z')")
    assert _keys(tx) == ["z"]


def test_calls_made_while_the_worker_is_busy_commit_together(tmp_path: Path) -> None:
    p = plan(1, 8)
    rng = random.Random(3)
    done = [random_trajectory(rng, q, TrajectoryStatus.COMPLETED) for q in p]
    wrong = random_trajectory(rng, plan(1, 1, job="other")[0], TrajectoryStatus.COMPLETED)

    async def main() -> None:
        store = Store(tmp_path / "s.db")
        commits: list[str] = []
        store._conn.set_trace_callback(
            lambda sql: commits.append(sql) if sql == "COMMIT" else None)
        astore = AsyncStore(store)
        await astore.create_job("j", {}, p)
        hold = _Hold()
        blocker = asyncio.ensure_future(astore.call(hold))
        await hold.entered()  # the worker is held while the finishes queue
        finishes = await _queued([*(astore.finish("j", t) for t in done[:4]),
                                  astore.finish("j", wrong),  # fails alone
                                  *(astore.finish("j", t) for t in done[4:])])
        refused = finishes.pop(4)
        before = len(commits)
        hold.release()
        await blocker
        seqs = [(await f).seq for f in finishes]
        with pytest.raises(NotFound):  # a trajectory job j does not have
            await refused
        assert seqs == list(range(1, 9))  # in call order, each delivered once
        assert len(commits) - before == 1  # eight finishes, one commit
        info = await astore.job("j")
        assert info.delivered == 8
        await astore.aclose()
        with Store(tmp_path / "s.db") as again:  # durable
            assert again.job("j").delivered == 8

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_a_batch_lost_fails_every_call_of_it_and_stores_none(tmp_path: Path) -> None:
    """SQLite rolling the batch's transaction back (as on a full disk; here a call does
    it) fails every call of the batch, those that had succeeded included; a call that
    failed on its own keeps its own error."""
    p = plan(1, 2)
    rng = random.Random(5)
    done = [random_trajectory(rng, q, TrajectoryStatus.COMPLETED) for q in p]

    def refuse() -> None:
        raise ValueError("its own")

    async def main() -> None:
        store = Store(tmp_path / "s.db")
        astore = AsyncStore(store)
        await astore.create_job("j", {}, p)
        hold = _Hold()
        blocker = asyncio.ensure_future(astore.call(hold))
        await hold.entered()
        calls = await _queued([
            astore.finish("j", done[0]), astore.call(refuse),
            astore.call(store._conn.execute, "ROLLBACK"), astore.finish("j", done[1])])
        hold.release()
        await blocker
        got = await asyncio.gather(*calls, return_exceptions=True)
        assert [type(g) for g in got] == [StoreError, ValueError, StoreError, StoreError]
        assert (await astore.job("j")).delivered == 0
        assert not (await astore.finish("j", done[0])).duplicate  # a retry delivers it
        await astore.aclose()

    asyncio.run(asyncio.wait_for(main(), timeout=60))
