"""BatchOrder without Ray: batches applied in sequence order whatever order they
arrive in, each once; and a runner actor applying a side push and an exchange that
arrive out of order in the order the service sent them."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from treadle.runtime.batch_order import BatchOrder
from treadle.runtime.runner_actor import RunnerWorker
from treadle.runtime.runner_wire import Held, Hold, Weights, pack, unpack


def test_batches_arriving_out_of_order_are_applied_in_order() -> None:
    for arrival in itertools.permutations(range(1, 6)):
        applied: list[str] = []
        order: BatchOrder[str] = BatchOrder(applied.append)
        arrived: set[int] = set()
        for seq in arrival:
            order.arrive(seq, f"batch {seq}")
            arrived.add(seq)
            # Applied as soon as every one before it is in, not before; the rest kept.
            ready = 0
            while ready + 1 in arrived:
                ready += 1
            assert applied == [f"batch {s}" for s in range(1, ready + 1)]
            assert order.waiting == len(arrived) - ready
        assert applied == [f"batch {s}" for s in range(1, 6)], arrival
        assert order.waiting == 0


def test_a_batch_arriving_again_is_refused_and_not_applied_twice() -> None:
    applied: list[str] = []
    order: BatchOrder[str] = BatchOrder(applied.append)
    order.arrive(1, "one")
    order.arrive(3, "three")  # early: kept
    with pytest.raises(RuntimeError, match="batch 1 arrived again"):
        order.arrive(1, "one again")  # applied already
    with pytest.raises(RuntimeError, match="batch 3 arrived again"):
        order.arrive(3, "three again")  # kept already
    with pytest.raises(RuntimeError):
        order.arrive(0, "none")  # numbers start at 1
    order.arrive(2, "two")
    assert applied == ["one", "two", "three"]


def test_an_actor_applies_a_side_push_before_the_exchange_sent_after_it() -> None:
    """The service held calls (push 1: `Hold`), then resumed them (exchange 2:
    `Weights(open)`); the exchange arrives first. Applied in arrival order, calls would
    stay held."""

    async def main() -> None:
        worker = RunnerWorker(1.0, 0.0, request_timeout_s=None, turn_retries=0)
        # Tasks start in the order they are made: the exchange arrives first.
        exchange = asyncio.ensure_future(
            worker.exchange(2, pack([Weights(3, "salt", open=True)])))
        push = asyncio.ensure_future(worker.push(1, pack([Hold(9)])))
        await asyncio.wait_for(push, timeout=60)
        assert worker.host.policy_version == 3
        assert worker.host.gate.is_set()  # the resume after the hold
        assert unpack(await asyncio.wait_for(exchange, timeout=60)) == [Held(9)]
        await worker.close()

    asyncio.run(main())
