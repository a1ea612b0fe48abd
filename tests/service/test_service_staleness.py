"""`treadle serve --staleness S [--staleness-gate]`: the service's treadle policy
weighs staleness across weight updates (`core.policies.progressive.Staleness`, whose
behaviour tests/core/test_staleness.py checks); a bad combination is refused."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from treadle.cli import build_parser
from treadle.core.policies.progressive import Staleness
from treadle.service.cli import _staleness
from treadle.service.state import ServiceConfig, build_service


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_the_flags_give_the_services_policy_its_staleness() -> None:
    wanted = _staleness(_args("--staleness", "2", "--staleness-gate"))
    assert wanted == Staleness(2, finish_first=True, gate=True)
    service = build_service(ServiceConfig(db=":memory:", staleness=wanted))
    scheduler: Any = service.runtime.scheduler
    assert scheduler.staleness == wanted
    assert _staleness(_args()) is None
    assert build_service(ServiceConfig(db=":memory:")).runtime.scheduler.staleness is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("argv, problem", [
    (("--staleness-gate",), "needs --staleness"),
    (("--staleness", "0"), "versions >= 1"),
    (("--staleness", "1", "--policy", "verl"), "with --policy treadle"),
])
def test_a_bad_combination_is_refused(argv: tuple[str, ...], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        _staleness(_args(*argv))
