"""`sandbox.autoscale.decide`, row by row of its table."""

from __future__ import annotations

import pytest

from treadle.sandbox.autoscale import ScaleDecision, Scaling, ServerLoad, decide

SCALING = Scaling(min_servers=1, max_servers=4, scale_up_at=0.8, scale_down_at=0.5, idle_s=60)


def _server(name: str, open_: int, *, idle_since: float | None = None,
            retiring: bool = False) -> ServerLoad:
    return ServerLoad(f"http://{name}:8790", open_, 10, idle_since, retiring)


def _decide(loads: list[ServerLoad], waiting: int = 0, now: float = 1000.0,
            scaling: Scaling = SCALING) -> ScaleDecision:
    return decide(loads, waiting=waiting, scaling=scaling, now=now, server_max_live=10)


def test_below_the_minimum_starts_up_to_it() -> None:
    assert _decide([]) == ScaleDecision(start=1)
    assert _decide([], scaling=Scaling(min_servers=3, max_servers=4)) == ScaleDecision(start=3)
    # A retiring server does not count towards the minimum.
    assert _decide([_server("a", 2, retiring=True)]) == ScaleDecision(start=1)


def test_over_the_threshold_starts_enough_servers_within_the_maximum() -> None:
    assert _decide([_server("a", 8)]) == ScaleDecision()  # 80% full: not over
    assert _decide([_server("a", 8)], waiting=1) == ScaleDecision(start=1)
    # 10 open + 30 waiting = 40 wanted; at 80% that is 50 of capacity: 4 more servers,
    # of which the maximum leaves room for 3.
    assert _decide([_server("a", 10)], waiting=30) == ScaleDecision(start=3)
    full = [_server(n, 10) for n in "abcd"]
    assert _decide(full, waiting=50) == ScaleDecision()  # at the maximum


def test_an_idle_server_retires_only_after_idle_s_and_if_the_rest_has_room() -> None:
    busy, idle = _server("a", 4), _server("b", 0, idle_since=900.0)
    assert _decide([busy, idle], now=959.0) == ScaleDecision()  # idle 59 s
    assert _decide([busy, idle], now=960.0) == ScaleDecision(retire=(idle.url,))
    # 6 wanted would be over 50% of the 10 left without it: it stays.
    assert _decide([busy, idle], waiting=2, now=960.0) == ScaleDecision()


def test_the_longest_idle_retires_first_one_at_a_time_never_below_the_minimum() -> None:
    loads = [_server("a", 0, idle_since=500.0), _server("b", 0, idle_since=100.0),
             _server("c", 0, idle_since=300.0)]
    assert _decide(loads) == ScaleDecision(retire=("http://b:8790",))
    assert _decide([_server("a", 0, idle_since=0.0)]) == ScaleDecision()  # the minimum
    gone = [_server("a", 0, idle_since=0.0), _server("b", 0, idle_since=0.0, retiring=True)]
    assert _decide(gone) == ScaleDecision()


@pytest.mark.parametrize("kwargs", [dict(min_servers=3, max_servers=2), dict(max_servers=0),
                                    dict(scale_down_at=0.9), dict(scale_up_at=1.5),
                                    dict(idle_s=-1.0)])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Scaling(**kwargs)  # type: ignore[arg-type]
