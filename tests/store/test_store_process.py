"""StoreProcess: the store in a process of its own answers as a Store would, survives
its process's loss, and never outlives its parent."""

from __future__ import annotations

import asyncio
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from store_helpers import newer_schema_file, plan, random_trajectory

from treadle.store import AsyncStore, JobStatus, NotFound, SchemaError, Store, StoreConflict
from treadle.store.calls import StoreCall
from treadle.store.child import portable
from treadle.store.errors import StoreError, StoreProcessLost
from treadle.store.journal import JournalResume, JournalRow
from treadle.store.process import StoreProcess
from treadle.types import TrajectoryStatus

pytestmark = pytest.mark.xdist_group("store-process")  # each test starts a python


def _run(coro: object) -> object:
    async def bounded() -> object:
        return await asyncio.wait_for(coro, timeout=120)  # type: ignore[arg-type]
    return asyncio.run(bounded())


def _wait_exited(pid: int) -> None:
    """Until `pid` has exited (its pidfd readable), without reaping it."""
    fd = os.pidfd_open(pid)
    try:
        select.select([fd], [], [], 120)
    finally:
        os.close(fd)


@pytest.fixture
def other_writer(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A second connection to the tests' store file (`tmp_path / "s.db"`): holding its
    write lock keeps a batch waiting in the child."""
    conn = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    yield conn
    conn.close()


def _sent(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set each time the running loop has written a batch to a store's socket (its
    `sock_sendall`, wrapped): the batch is then the child's."""
    loop = asyncio.get_running_loop()
    sent = asyncio.Event()
    real = loop.sock_sendall

    async def sendall(sock: Any, data: Any) -> None:
        await real(sock, data)
        sent.set()

    monkeypatch.setattr(loop, "sock_sendall", sendall)
    return sent


def test_a_job_through_the_process_is_the_same_as_through_a_store(tmp_path: Path) -> None:
    planned = plan(4, 8)
    rng = random.Random(5)
    results = [random_trajectory(rng, p, TrajectoryStatus.COMPLETED) for p in planned]

    async def through(side: Store | StoreProcess) -> tuple[object, ...]:
        astore = AsyncStore(side)
        await astore.create_job("j", {"n": 32}, planned)
        attempts = await asyncio.gather(*(astore.start("j", p.trajectory_id)
                                          for p in planned))
        # Calls queued together run as one batch over there too.
        finishes = await asyncio.gather(*(astore.finish("j", t) for t in results))
        again = await astore.finish("j", results[3])
        journal = await astore.write_journal([])
        records = [d.record_json async for d in astore.iter_results("j", page_size=5)]
        info = await astore.job("j")
        with pytest.raises(NotFound):
            await astore.job("nope")
        with pytest.raises(StoreConflict):
            await astore.create_job("j", {}, planned)
        await astore.aclose()
        return (attempts, [f.seq for f in finishes], again, journal.rows, records,
                info.status, info.delivered)

    here = _run(through(Store(tmp_path / "here.db")))
    there = _run(through(StoreProcess(str(tmp_path / "there.db"))))
    assert there == here
    assert here[1] == list(range(1, 33)) and here[2].duplicate and here[5] is JobStatus.COMPLETED


def test_the_journal_keeps_its_order_across_the_process(tmp_path: Path) -> None:
    planned = plan(1, 1)
    tid = planned[0].trajectory_id

    async def main() -> tuple[int, tuple[bytes, ...], tuple[bytes, ...]]:
        astore = AsyncStore(StoreProcess(str(tmp_path / "j.db")))
        await astore.create_job("j", {}, planned)
        await astore.start("j", tid)
        await astore.start("j", tid)  # attempt 1, the live one
        rows = [JournalRow("j", tid, 1, n, 1, f"t{n}".encode()) for n in range(3)]
        written = await astore.write_journal([
            *rows, JournalResume("j", tid, 1, 1, b"resume"),
            JournalRow("j", tid, 1, 1, 2, b"t1 again")])
        journaled = await astore.journaled("j", tid)
        await astore.aclose()
        return written.rows, journaled.turns, journaled.resumes

    # The resume drops the turns before it past the first, not the turn after it.
    assert _run(main()) == (4, (b"t0", b"t1 again"), (b"resume",))


def test_opening_fails_from_the_constructor_as_a_store_would(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="newer than this treadle"):
        StoreProcess(str(newer_schema_file(tmp_path / "newer.db")))
    with pytest.raises(ValueError, match="memory"):
        StoreProcess(":memory:")


def test_a_local_call_is_refused_alone(tmp_path: Path) -> None:
    store = StoreProcess(str(tmp_path / "l.db"))

    async def main() -> None:
        outcomes = await store.run([StoreCall("job_ids"), StoreCall("", local=lambda: 1),
                                    StoreCall("job_ids")], grouped=True)
        assert [ok for ok, _ in outcomes] == [True, False, True]
        assert isinstance(outcomes[1][1], TypeError)
        assert isinstance((await store.run([StoreCall("_conn")], False))[0][1], TypeError)
        await store.aclose()

    _run(main())


class _Keyed(Exception):
    def __init__(self, *, key: str) -> None:
        super().__init__(key)


def test_an_exception_that_cannot_cross_arrives_as_a_store_error_naming_it() -> None:
    crossed = portable(_Keyed(key="k"))
    assert isinstance(crossed, StoreError) and "_Keyed" in str(crossed)
    conflict = StoreConflict("taken")
    assert portable(conflict) is conflict


def test_a_lost_process_fails_its_batch_and_the_next_starts_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planned = plan(1, 4)
    store = StoreProcess(str(tmp_path / "k.db"))

    async def main() -> None:
        await store.run([StoreCall("create_job", ("j", {}, planned))], False)
        first = store.pid
        os.kill(first, signal.SIGKILL)
        _wait_exited(first)
        # Lost during a batch: the process looked alive when the batch was sent.
        monkeypatch.setattr(store._proc, "poll", lambda: None)
        with pytest.raises(StoreProcessLost, match="exited"):
            await store.run([StoreCall("job_ids")], False)
        monkeypatch.undo()
        # The next batch finds it gone and starts another, on the same file.
        [(ok, ids)] = await store.run([StoreCall("job_ids")], False)
        assert ok and ids == ["j"] and store.pid != first
        os.kill(store.pid, signal.SIGKILL)
        _wait_exited(store.pid)
        [(ok, info)] = await store.run([StoreCall("job", ("j",))], False)
        assert ok and info.planned == 4
        await store.aclose()
        with pytest.raises(StoreError, match="closed"):
            await store.run([StoreCall("job_ids")], False)

    _run(main())


def test_a_batch_cut_off_midway_costs_the_process_not_the_next_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_writer: sqlite3.Connection
        ) -> None:
    store = StoreProcess(str(tmp_path / "s.db"))
    other = other_writer  # it holds the file: the batch waits in the child

    async def main() -> None:
        sent = _sent(monkeypatch)
        other.execute("BEGIN IMMEDIATE")
        first = store.pid
        cut = asyncio.ensure_future(store.run([StoreCall("create_job", ("j", {}, []))],
                                              False))
        await sent.wait()  # the batch is the child's, its answer awaited (the lock)
        assert not cut.done()
        cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut
        other.execute("ROLLBACK")
        [(ok, ids)] = await store.run([StoreCall("job_ids")], False)
        assert ok and ids == [] and store.pid != first
        await store.aclose()

    _run(main())


def test_the_process_exits_when_its_parent_is_gone(tmp_path: Path) -> None:
    script = ("import sys, threading\n"
              "from treadle.store.process import StoreProcess\n"
              f"s = StoreProcess({str(tmp_path / 'p.db')!r})\n"
              "print(s.pid, flush=True)\n"
              "threading.Event().wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        fd = os.pidfd_open(child)
    finally:
        parent.kill()
        parent.wait()
    try:
        readable, _, _ = select.select([fd], [], [], 120)
        assert readable, "the store's process outlived its parent"
    finally:
        os.close(fd)


def test_a_finish_the_lost_process_left_unanswered_is_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_writer: sqlite3.Connection
        ) -> None:
    planned = plan(1, 1)
    [done] = [random_trajectory(random.Random(3), p, TrajectoryStatus.COMPLETED)
              for p in planned]
    store = StoreProcess(str(tmp_path / "s.db"))
    astore = AsyncStore(store)
    other = other_writer  # it holds the file: the batch waits in the child until killed

    async def main() -> None:
        await astore.create_job("j", {}, planned)
        await astore.start("j", done.trajectory_id)
        other.execute("BEGIN IMMEDIATE")
        first = store.pid
        sent = _sent(monkeypatch)
        finishing = asyncio.ensure_future(astore.finish("j", done))
        listing = asyncio.ensure_future(astore.job_ids())  # the same batch
        await sent.wait()
        os.kill(first, signal.SIGKILL)
        other.execute("ROLLBACK")
        with pytest.raises(StoreProcessLost):
            await listing  # a read is not made again: its caller repeats it if it will
        finish = await finishing  # made again, on the next process
        assert (finish.seq, finish.duplicate) == (1, False) and store.pid != first
        assert (await astore.job("j")).status is JobStatus.COMPLETED
        await astore.aclose()

    _run(main())


def test_a_call_whose_arguments_do_not_pickle_fails_alone(tmp_path: Path) -> None:
    store = StoreProcess(str(tmp_path / "u.db"))
    astore = AsyncStore(store)

    async def main() -> None:
        await astore.create_job("j", {}, plan(1, 1))
        first = store.pid
        bad, good = await asyncio.gather(
            astore.add_event("j", "note", {"f": lambda: 1}), astore.job_ids(),
            return_exceptions=True)
        assert isinstance(bad, Exception) and good == ["j"] and store.pid == first
        await astore.aclose()

    _run(main())


@pytest.mark.parametrize("side", ["thread", "process"])
def test_aclose_waits_for_the_batch_under_way_and_refuses_later_calls(
        tmp_path: Path, side: str) -> None:
    path = tmp_path / "a.db"
    astore = AsyncStore(Store(path) if side == "thread" else StoreProcess(str(path)))

    async def main() -> None:
        # gather starts them in order: the call is queued, then aclose begins (before
        # the drain has run its batch).
        created, _ = await asyncio.gather(astore.create_job("j", {}, plan(2, 4)),
                                          astore.aclose())
        assert created.planned == 8
        with pytest.raises(StoreError, match="closed"):
            await astore.job_ids()

    _run(main())
    with Store(path) as again:
        assert again.job_ids() == ["j"]


@pytest.mark.parametrize("side", ["thread", "process"])
def test_loops_in_turn_and_one_closed_with_its_batch_under_way(
        tmp_path: Path, side: str, monkeypatch: pytest.MonkeyPatch,
        other_writer: sqlite3.Connection) -> None:
    path = tmp_path / "s.db"
    astore = AsyncStore(Store(path) if side == "thread" else StoreProcess(str(path)))
    _run(astore.create_job("j", {}, plan(1, 2)))
    assert _run(astore.job_ids()) == ["j"]  # a second loop, after the first
    # The batch of a third loop stays under way: on the worker thread (held), or in
    # the child (the file locked by another writer).
    began, release = threading.Event(), threading.Event()
    other = other_writer
    left: list[asyncio.Future[Any]] = []

    async def leave() -> None:
        if side == "thread":
            left.append(asyncio.ensure_future(astore.call(lambda: (began.set(),
                                                                   release.wait(60)))))
            await asyncio.to_thread(began.wait)
        else:
            sent = _sent(monkeypatch)
            other.execute("BEGIN IMMEDIATE")
            left.append(asyncio.ensure_future(astore.job_ids()))
            await sent.wait()

    stuck = asyncio.new_event_loop()
    try:
        stuck.run_until_complete(leave())
    finally:
        stuck.close()  # its drain never runs again: the next loop's must not wait on it
        monkeypatch.undo()
        release.set()
        if other.in_transaction:
            other.execute("ROLLBACK")
    assert _run(astore.job_ids()) == ["j"]
    _run(astore.aclose())
