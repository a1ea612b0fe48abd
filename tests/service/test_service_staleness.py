"""`treadle serve --staleness S [--staleness-gate]`: the service's treadle policy
weighs staleness across weight updates (`core.policies.progressive.Staleness`, whose
behaviour tests/core/test_staleness.py checks); a bad combination is refused; a
continuous job's own bound reaches the scheduler with each of its trajectories."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, ClassVar

import pytest

from runtime.runtime_helpers import FakeEngine
from treadle.cli import build_parser
from treadle.core.events import Event, TrajectoryArrived
from treadle.core.policies.baselines import Slime
from treadle.core.policies.progressive import Staleness
from treadle.runtime.driver import Runtime
from treadle.runtime.rollout import replay_task
from treadle.service.cli import _staleness
from treadle.service.planning import Planner, ReplayWork
from treadle.service.schemas import JobRequest
from treadle.service.state import ServiceConfig, build_service
from treadle.testing import FakeClock
from treadle.types import GroupKey


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


class ArrivalsSeen(Slime):
    """A spy: slime, and every trajectory arrival it was told."""

    arrivals: ClassVar[list[TrajectoryArrived]] = []

    def on_event(self, event: Event, now: float) -> None:
        if isinstance(event, TrajectoryArrived):
            self.arrivals.append(event)
        super().on_event(event, now)


def test_a_continuous_jobs_bound_reaches_the_scheduler_with_each_trajectory() -> None:
    """The job's `continuous.max_staleness`, through the planner's work and the
    runtime's runner, arrives with each of its trajectories (a plain job's: None),
    for a policy weighing staleness to schedule it by (tests/core/test_staleness.py)."""
    planner = Planner(tokenizer=None, sandbox_backend=None, max_context=1 << 16)
    tasks = {"workload": "short", "trajectories": 2, "group_size": 2, "seed": 1}
    bounded = planner.resolve("j", JobRequest.model_validate(
        {"tasks": tasks, "continuous": {"in_flight": 1, "max_staleness": 2}}))
    plain = planner.resolve("p", JobRequest.model_validate({"tasks": tasks}))
    assert {w.max_staleness for w in bounded} == {2}
    assert {w.max_staleness for w in plain} == {None}

    async def main() -> None:
        engine = FakeEngine("a", FakeClock(autojump=True), tokens_per_s=1000)
        rt = Runtime(ArrivalsSeen(1, 1), clock=engine.clock)
        rt.register_engine(engine, label="a")
        await rt.start()
        try:
            for w in (bounded[0], plain[0]):
                assert isinstance(w, ReplayWork)
                p = w.planned
                await replay_task(rt, w.spec, traj_id=p.trajectory_id,
                                  key=GroupKey(p.group_id, p.repetition),
                                  max_staleness=w.max_staleness)
        finally:
            await rt.close()

    asyncio.run(asyncio.wait_for(main(), 60))  # (a hang bound, not a timing)
    assert [a.max_staleness for a in ArrivalsSeen.arrivals] == [2, None]


def test_the_service_merges_engines_only_when_asked_and_able_to_launch() -> None:
    """Tail merges (`core.policies.tail_merge`) drain engines and launch one: a
    service without a launcher would only lose the drained ones."""
    assert build_service(ServiceConfig(db=":memory:")).runtime.scheduler.reconfigure is False  # type: ignore[attr-defined]
    service = build_service(ServiceConfig(db=":memory:", emulate=8, reconfigure=True))
    assert service.runtime.scheduler.reconfigure is True  # type: ignore[attr-defined]
    assert service.frozen.scheduler.reconfigure is False  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="reconfigure merges engines the service launches"):
        build_service(ServiceConfig(db=":memory:", reconfigure=True))
    assert _args("--reconfigure").reconfigure and not _args().reconfigure
