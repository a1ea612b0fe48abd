"""An engine's turn queue: order, one entry per trajectory, taking entries out."""

from __future__ import annotations

import random

from treadle.core.turn_queue import TurnQueue


def test_turns_come_out_by_priority_then_first_come_first_served() -> None:
    q = TurnQueue()
    for prio, seq, tid in ((1.0, 3, "c"), (0.0, 5, "e"), (1.0, 1, "a"), (-2.0, 9, "z")):
        q.push(prio, seq, tid)
    assert len(q) == 4 and "a" in q and q.peek() == (-2.0, 9, "z")
    assert [q.pop() for _ in range(5)] == [(-2.0, 9, "z"), (0.0, 5, "e"), (1.0, 1, "a"),
                                           (1.0, 3, "c"), None]
    assert len(q) == 0 and q.peek() is None


def test_a_discarded_or_replaced_entry_is_never_seen_again() -> None:
    q = TurnQueue()
    q.push(0.0, 1, "a")
    q.push(0.0, 2, "b")
    q.push(0.0, 3, "c")
    assert q.discard("a") and not q.discard("a") and not q.discard("nobody")
    q.push(5.0, 4, "b")  # b moves back: its first entry goes
    assert len(q) == 2 and q.peek() == (0.0, 3, "c")
    assert q.drain() == [(0.0, 3, "c"), (5.0, 4, "b")]
    assert len(q) == 0 and q.pop() is None
    q.push(0.0, 1, "a")  # its old entry, taken out before the drain, stays out
    assert q.drain() == [(0.0, 1, "a")]


def test_it_agrees_with_a_sorted_list_under_random_use() -> None:
    rng = random.Random(7)
    q, model = TurnQueue(), {}  # model: trajectory -> (priority, seq)
    for seq in range(3000):
        op = rng.random()
        tid = f"t{rng.randrange(40)}"
        if op < 0.5:
            prio = float(rng.randrange(5))
            q.push(prio, seq, tid)
            model[tid] = (prio, seq)
        elif op < 0.7:
            assert q.discard(tid) == (model.pop(tid, None) is not None)
        else:
            want = min(((p, s, t) for t, (p, s) in model.items()), default=None)
            if op < 0.8:
                got = q.pop()
            else:
                got = q.peek()
                if got is not None and op < 0.9:
                    q.pop_peeked()  # what `pop` does, once peeked
            assert got == want
            if want is not None and op < 0.9:
                del model[want[2]]
        assert len(q) == len(model)
    assert q.drain() == sorted((p, s, t) for t, (p, s) in model.items())
