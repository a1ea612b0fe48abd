"""The discrete-event kernel (`treadle.sim.kernel`): time order, deterministic
tie-breaks, cancellation and the guards against misuse and runaway programs."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from treadle.sim.kernel import Kernel


def _recorder(kernel: Kernel, log: list[tuple[float, str]]) -> Callable[[str], Callable[[], None]]:
    def make(name: str) -> Callable[[], None]:
        def fire() -> None:
            log.append((kernel.now, name))

        return fire

    return make


def test_callbacks_run_in_time_order_and_the_clock_follows() -> None:
    k = Kernel()
    log: list[tuple[float, str]] = []
    rec = _recorder(k, log)
    rng = random.Random(7)
    times = [round(rng.uniform(0.0, 100.0), 3) for _ in range(200)]
    for i, t in enumerate(times):
        k.at(t, rec(f"c{i}"))
    k.run()
    assert [t for t, _ in log] == sorted(times)
    assert k.now == max(times)
    assert k.fired == len(times)
    assert k.peek() is None
    assert not k.step()


def test_ties_break_by_order_then_by_scheduling_order() -> None:
    k = Kernel()
    log: list[tuple[float, str]] = []
    rec = _recorder(k, log)
    k.at(1.0, rec("late-order5-first"), order=5)
    k.at(1.0, rec("order0-first"), order=0)
    k.at(1.0, rec("late-order5-second"), order=5)
    k.at(1.0, rec("order0-second"), order=0)
    k.at(1.0, rec("negative-order"), order=-1)
    k.at(0.5, rec("earlier-time-high-order"), order=100)
    k.run()
    assert [name for _, name in log] == [
        "earlier-time-high-order",
        "negative-order",
        "order0-first",
        "order0-second",
        "late-order5-first",
        "late-order5-second",
    ]


def test_callback_scheduled_during_an_instant_with_lower_order_runs_before_pending_ones() -> None:
    k = Kernel()
    log: list[tuple[float, str]] = []
    rec = _recorder(k, log)

    def first() -> None:
        log.append((k.now, "first"))
        k.at(k.now, rec("urgent"), order=0)  # same instant, lower order than "second"
        k.at(k.now, rec("after-second"), order=5)  # same order as "second", scheduled later

    k.at(2.0, first, order=5)
    k.at(2.0, rec("second"), order=5)
    k.run()
    assert [name for _, name in log] == ["first", "urgent", "second", "after-second"]
    assert all(t == 2.0 for t, _ in log)


def test_same_program_gives_the_same_sequence() -> None:
    def program() -> list[tuple[float, str]]:
        k = Kernel()
        log: list[tuple[float, str]] = []
        rec = _recorder(k, log)
        rng = random.Random(3)
        for i in range(300):
            k.at(float(rng.randint(0, 20)), rec(f"c{i}"), order=rng.randint(0, 2))
        k.run()
        return log

    assert program() == program()


def test_cancel_skips_the_call_and_peek_ignores_it() -> None:
    k = Kernel()
    log: list[tuple[float, str]] = []
    rec = _recorder(k, log)
    h1 = k.at(1.0, rec("a"))
    k.at(2.0, rec("b"))
    h3 = k.at(3.0, rec("c"))
    h1.cancel()
    assert h1.cancelled
    assert k.peek() == 2.0
    h3.cancel()
    k.run()
    assert log == [(2.0, "b")]
    assert k.fired == 1
    assert k.now == 2.0  # a cancelled call never moves the clock


def test_cancel_from_inside_a_callback_at_the_same_instant() -> None:
    k = Kernel()
    log: list[tuple[float, str]] = []
    rec = _recorder(k, log)
    victim = k.at(1.0, rec("victim"), order=1)

    def killer() -> None:
        log.append((k.now, "killer"))
        victim.cancel()

    k.at(1.0, killer, order=0)
    k.run()
    assert log == [(1.0, "killer")]


def test_scheduling_in_the_past_raises() -> None:
    k = Kernel()
    k.at(5.0, lambda: None)
    k.run()
    assert k.now == 5.0
    with pytest.raises(ValueError, match="past"):
        k.at(4.999, lambda: None)
    k.at(5.0, lambda: None)  # the present is fine
    with pytest.raises(ValueError):
        k.at(float("nan"), lambda: None)


def test_after_is_relative_and_clamps_negative_delays_to_now() -> None:
    k = Kernel()
    log: list[tuple[float, str]] = []
    rec = _recorder(k, log)

    def at_three() -> None:
        k.after(1.5, rec("plus-1.5"))
        k.after(-2.0, rec("clamped"))

    k.at(3.0, at_three)
    k.run()
    assert log == [(3.0, "clamped"), (4.5, "plus-1.5")]


def test_run_until_stops_before_later_calls_and_resumes() -> None:
    k = Kernel()
    log: list[tuple[float, str]] = []
    rec = _recorder(k, log)
    for t in (1.0, 2.0, 3.0, 4.0):
        k.at(t, rec(str(t)))
    k.run(until=2.5)
    assert [n for _, n in log] == ["1.0", "2.0"]
    assert k.peek() == 3.0
    k.run(until=3.0)  # inclusive
    assert [n for _, n in log] == ["1.0", "2.0", "3.0"]
    k.run()
    assert len(log) == 4


def test_max_events_guard_raises_on_a_runaway_program() -> None:
    k = Kernel()

    def forever() -> None:
        k.after(1.0, forever)

    k.at(0.0, forever)
    with pytest.raises(RuntimeError, match="exceeded 50 events"):
        k.run(max_events=50)
    assert k.fired == 50


def test_max_events_is_not_tripped_by_a_program_of_exactly_that_size() -> None:
    k = Kernel()
    for t in range(10):
        k.at(float(t), lambda: None)
    k.run(max_events=10)
    assert k.fired == 10
    k2 = Kernel()
    for t in range(11):
        k2.at(float(t), lambda: None)
    with pytest.raises(RuntimeError):
        k2.run(max_events=10)
