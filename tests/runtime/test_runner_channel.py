"""RunnerChannel without Ray, against `ActorDouble` and a fake clock: under load every
message rides an exchange, once and in order, and no side push is made; messages
that an exchange in flight does not take within the gap go by a side push, and the
exchange's answer is heard after it; what an answer leads to rides the next
exchange; a failed call reports the loss once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import pytest

from treadle.runtime.batch_order import BatchOrder
from treadle.runtime.driver import Runtime
from treadle.runtime.runner_channel import RunnerChannel
from treadle.runtime.runner_wire import DropSuite, Held, Hold, Packed, ToRunner, pack, unpack
from treadle.testing import FakeClock

GAP = 0.03  # call_gap_s
NO_RUNTIME = cast(Runtime, None)  # no failed engine call is heard here: none is asked


class _Method:
    """A Ray actor method as its caller sees it: `.remote(...)` gives an awaitable."""

    def __init__(self, call: Callable[..., asyncio.Future[Any]]) -> None:
        self.remote = call


class ActorDouble:
    """A runner actor as `RunnerChannel` calls it: `exchange`, `push` and `where`,
    each `.remote(...)` a future this test controls. What it is sent is applied as
    the actor applies it (`BatchOrder`), into `applied`.

    An exchange waits in `exchanges` until the test answers it (`set_result` with a
    `pack`ed reply, or `set_exception`); a push returns at once (or raises
    `push_error`), its sequence number put in `pushed`."""

    def __init__(self, push_error: Exception | None = None) -> None:
        self.calls: list[tuple[str, int, list[ToRunner]]] = []  # (method, seq, batch)
        self.applied: list[ToRunner] = []
        self._order: BatchOrder[list[ToRunner]] = BatchOrder(self.applied.extend)
        self.exchanges: asyncio.Queue[asyncio.Future[list[Packed]]] = asyncio.Queue()
        self.pushed: asyncio.Queue[int] = asyncio.Queue()
        self.push_error = push_error
        self.exchange = _Method(self._exchange)
        self.push = _Method(self._push)
        self.where = _Method(self._where)

    def _arrive(self, method: str, seq: int, batch: list[Packed]) -> None:
        messages = unpack(batch)
        self.calls.append((method, seq, messages))
        self._order.arrive(seq, messages)

    def _exchange(self, seq: int, batch: list[Packed]) -> asyncio.Future[list[Packed]]:
        self._arrive("exchange", seq, batch)
        reply: asyncio.Future[list[Packed]] = asyncio.get_running_loop().create_future()
        self.exchanges.put_nowait(reply)
        return reply

    def _push(self, seq: int, batch: list[Packed]) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.push_error is not None:
            done.set_exception(self.push_error)
        else:
            self._arrive("push", seq, batch)
            done.set_result(None)
        self.pushed.put_nowait(seq)
        return done

    def _where(self) -> asyncio.Future[tuple[int, str]]:
        here: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        here.set_result((1234, "node-1"))
        return here


def channel_to(actor: ActorDouble, clock: FakeClock,
               lost: Callable[[RunnerChannel, str], None] = lambda *_: None,
               ) -> RunnerChannel:
    return RunnerChannel("r", actor, NO_RUNTIME, call_gap_s=GAP, lost=lost, clock=clock)


async def within(awaitable: Any) -> Any:
    """`awaitable`'s result; a generous real-time guard that fails a test which would
    otherwise hang (nothing here takes real time)."""
    return await asyncio.wait_for(awaitable, timeout=60)


def test_under_load_every_message_rides_an_exchange_once_in_order() -> None:
    """The actor answers each exchange within the gap, with events (the `Held` of
    the hold the exchange carried): no side push, and what was sent while one was
    in flight rides the next."""

    async def main() -> None:
        clock = FakeClock(100.0)
        actor = ActorDouble()
        channel = channel_to(actor, clock)
        await channel.open()
        in_flight = await within(actor.exchanges.get())  # the first: nothing to carry
        sent: list[ToRunner] = []
        holds: list[asyncio.Future[None]] = []
        for step in range(1, 21):
            messages: list[ToRunner] = [DropSuite(f"suite-{step}"), DropSuite("x")]
            for m in messages:
                channel.send(m)
            holds.append(channel.hold(step))
            sent += [*messages, Hold(step)]
            # Back within the gap; past the deadline of the last step's messages,
            # which an exchange took already.
            clock.advance(GAP / 2)
            in_flight.set_result(pack([Held(step - 1)] if step > 1 else []))
            if step > 1:
                await within(holds[step - 2])  # the answer was heard
            in_flight = await within(actor.exchanges.get())
            assert actor.calls[-1] == ("exchange", step + 1, [*messages, Hold(step)])
        in_flight.set_result(pack([Held(20)]))
        await within(holds[-1])
        await within(actor.exchanges.get())
        assert [(method, seq) for method, seq, _ in actor.calls] == [
            ("exchange", seq) for seq in range(1, 23)]  # no side push
        assert actor.pushed.empty()
        assert actor.applied == sent  # every message once, in order
        channel.close()

    asyncio.run(main())


def test_messages_an_exchange_in_flight_holds_go_by_a_side_push_after_the_gap() -> None:
    """The actor holds its exchange (nothing to say): what is sent meanwhile goes by
    a side push `call_gap_s` after it was sent, numbered after the exchange; the
    exchange's answer, when it comes, is heard."""

    async def main() -> None:
        clock = FakeClock(100.0, autojump=True)  # time passes only when all else waits
        actor = ActorDouble()
        channel = channel_to(actor, clock)
        await channel.open()
        held_exchange = await within(actor.exchanges.get())
        channel.send(DropSuite("a"))
        acknowledged = channel.hold(7)
        sent_at = clock.now()
        assert await within(actor.pushed.get()) == 2
        assert clock.now() == pytest.approx(sent_at + GAP)  # not before the gap
        assert actor.calls == [("exchange", 1, []), ("push", 2, [DropSuite("a"), Hold(7)])]
        assert not acknowledged.done()  # its Held comes back on an exchange only
        held_exchange.set_result(pack([Held(7)]))
        await within(acknowledged)
        await within(actor.exchanges.get())
        assert actor.calls[-1] == ("exchange", 3, [])  # the next long poll
        assert actor.applied == [DropSuite("a"), Hold(7)]
        channel.close()

    asyncio.run(main())


def test_what_an_answer_leads_to_in_a_later_callback_rides_the_next_exchange() -> None:
    """The scheduler decides on what an answer told it in a later callback of the same
    loop iteration (`control.DecisionLoop`); here a hold's done-callback sends. The
    next exchange waits for it rather than leave without it."""

    async def main() -> None:
        clock = FakeClock(100.0)
        actor = ActorDouble()
        channel = channel_to(actor, clock)
        acknowledged = channel.hold(1)  # sent before it opens: rides the first exchange
        acknowledged.add_done_callback(lambda _: channel.send(DropSuite("decided")))
        await channel.open()
        first = await within(actor.exchanges.get())
        assert actor.calls == [("exchange", 1, [Hold(1)])]
        first.set_result(pack([Held(1)]))
        await within(actor.exchanges.get())
        assert actor.calls[-1] == ("exchange", 2, [DropSuite("decided")])
        channel.close()

    asyncio.run(main())


def test_a_failed_call_reports_the_loss_once() -> None:
    """A side push fails, then the exchange in flight too (the actor gone): one loss."""

    async def main() -> None:
        clock = FakeClock(100.0, autojump=True)
        actor = ActorDouble(push_error=ConnectionError("the actor died"))
        reasons: list[str] = []
        reported = asyncio.Event()

        def lost(channel: RunnerChannel, why: str) -> None:
            reasons.append(why)
            reported.set()

        channel = channel_to(actor, clock, lost)
        await channel.open()
        held_exchange = await within(actor.exchanges.get())
        channel.send(DropSuite("a"))  # held past the gap: a side push, which fails
        await within(reported.wait())
        held_exchange.set_exception(ConnectionError("the actor died"))
        tasks = channel._tasks  # both calls' tasks: over once both failed
        await within(asyncio.gather(*tasks, return_exceptions=True))
        assert all(task.done() and not task.cancelled() for task in tasks)
        assert reasons == ["runner r lost: ConnectionError: the actor died"]
        channel.close()

    asyncio.run(main())
