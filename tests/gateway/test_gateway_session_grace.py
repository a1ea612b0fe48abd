"""A session the gateway ended waits out a grace for its owner, on `FakeClock`: its
owner's end within it scores it (the status that ended it stands), a call gets
`SessionEnded` rather than a 404, and unscored it is handed on when the grace is over."""

from __future__ import annotations

import asyncio

import pytest

from agent.agent_helpers import build_tokenizer
from treadle.agent.chat import Message
from treadle.agent.tokenizer import HFTokenizer
from treadle.core.cost_model import CostModel
from treadle.core.policies import build_policy, parse_policy
from treadle.gateway.errors import SessionEnded, UnknownSession
from treadle.gateway.session import CallRequest, SessionLimits, SessionSpec
from treadle.gateway.sessions import Sessions
from treadle.runtime.driver import Runtime
from treadle.testing import FakeClock
from treadle.types import GroupKey, Trajectory, TrajectoryStatus


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _spec(name: str) -> SessionSpec:
    return SessionSpec(session_id=name, trajectory_id=f"j/{name}", job_id="j",
                       key=GroupKey("j/g", 0), task_id="g",
                       limits=SessionLimits(idle_timeout_s=30.0))


def test_an_ended_session_waits_for_its_owner_then_goes_unscored(tok: HFTokenizer) -> None:
    async def main() -> list[Trajectory]:
        clock, ended = FakeClock(), []

        async def on_end(traj: Trajectory) -> None:
            ended.append(traj)

        scheduler = build_policy(parse_policy("verl"), CostModel.named("qwen3-14b", "h100"),
                                 batch_size=64)
        sessions = Sessions(Runtime(scheduler, clock=clock), tok, on_end=on_end, clock=clock,
                            sweep_s=1.0, grace_s=10.0)
        sessions.create(_spec("a"))
        sessions.create(_spec("b"))
        for _ in range(31):  # both idle past their 30 s: ended by the gateway
            clock.advance(1.0)
            await asyncio.sleep(0)
        assert ended == [] and sessions.get("a").ended  # waiting for their owners
        with pytest.raises(SessionEnded):
            await sessions.call("a", CallRequest([Message("user", "hi")]))
        await sessions.end("a", reward=1.0, status=TrajectoryStatus.COMPLETED)
        assert [(t.trajectory_id, t.status, t.reward) for t in ended] == [
            ("j/a", TrajectoryStatus.TIMEOUT, 1.0)]  # scored; what ended it stands
        for _ in range(10):  # b's grace runs out
            clock.advance(1.0)
            await asyncio.sleep(0)
        with pytest.raises(UnknownSession):
            sessions.get("b")
        await sessions.close()
        return ended

    _, b = asyncio.run(main())
    assert (b.trajectory_id, b.status, b.reward) == ("j/b", TrajectoryStatus.TIMEOUT, None)
