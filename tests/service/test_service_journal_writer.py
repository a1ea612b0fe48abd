"""The service's turn-journal writer: what is handed in is written, in order, by the
next batch or at close; a resume recorded before an attempt's turns drops the turns
it does not keep; a batch the store fails is logged and the writer goes on."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from treadle.agent.journal import JournaledTurn, decode
from treadle.agent.runner import TurnOutput
from treadle.service.journal import JournalWriter
from treadle.service.metrics import Metrics
from treadle.store import AsyncStore, PlannedTrajectory, Store
from treadle.types import ResumePoint


def _turn(index: int, n: int = 3) -> JournaledTurn:
    return JournaledTurn(index, TurnOutput(list(range(n)), [-0.5] * n, [0] * n, "stop", "e0"))


def _store() -> AsyncStore:
    store = Store(":memory:")
    store.create_job("j", {}, [PlannedTrajectory("j/t", "g", "q", 0)])
    return AsyncStore(store)


def test_turns_handed_in_are_written_in_order_by_close() -> None:
    async def go() -> tuple[Any, int]:
        astore = _store()
        assert await astore.start("j", "j/t") == 0
        writer = JournalWriter(astore, Metrics(), interval_s=3600.0)  # only close writes
        writer.start()
        journal = writer.attempt("j", "j/t", 0)
        journal.sampled(3)
        for i in range(3):
            journal.turn(_turn(i))
        assert writer.unjournaled == 9
        await writer.close()
        got = await astore.journaled("j", "j/t")
        return got, writer.unjournaled

    got, left = asyncio.run(go())
    assert [JournaledTurn.decode(b).index for b in got.turns] == [0, 1, 2]
    assert got.tokens == 9 and left == 0


def test_a_resume_drops_what_it_does_not_keep_before_the_new_turns() -> None:
    async def go() -> Any:
        astore = _store()
        await astore.start("j", "j/t")
        writer = JournalWriter(astore, Metrics(), interval_s=3600.0)
        writer.start()
        first = writer.attempt("j", "j/t", 0)
        for i in range(3):
            first.turn(_turn(i))
        await writer.close()
        await astore.call(astore.store.recover)
        assert await astore.start("j", "j/t") == 1
        writer = JournalWriter(astore, Metrics(), interval_s=3600.0)
        writer.start()
        second = writer.attempt("j", "j/t", 1)
        second.resumed(ResumePoint(1, 1))  # as a runner actor's resume comes back
        second.turn(_turn(1, n=5))
        await writer.close()
        return await astore.journaled("j", "j/t")

    got = asyncio.run(go())
    assert [len(JournaledTurn.decode(b).output.output_ids) for b in got.turns] == [3, 5]
    assert [decode(b)["turn"] for b in got.resumes] == [1]


def test_a_batch_the_store_fails_is_logged_and_the_writer_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> Any:
        astore = _store()
        await astore.start("j", "j/t")
        real = astore.store.write_journal
        calls = []
        tried = threading.Event()  # the first batch has been tried

        def flaky(entries: Any) -> Any:
            calls.append(len(entries))
            if len(calls) == 1:
                tried.set()
                raise OSError("disk full")
            return real(entries)

        astore.store.write_journal = flaky  # type: ignore[method-assign]
        writer = JournalWriter(astore, Metrics(), interval_s=0.0)
        writer.start()
        journal = writer.attempt("j", "j/t", 0)
        journal.turn(_turn(0))
        await asyncio.to_thread(tried.wait)
        journal.turn(_turn(1))
        await writer.close()
        return await astore.journaled("j", "j/t")

    got = asyncio.run(go())
    assert "could not write a batch" in caplog.text
    # Turn 0 was lost with its batch: turn 1 is kept but is no history without it.
    assert got.turns == () and got.tokens == 0
