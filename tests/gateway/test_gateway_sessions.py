"""Sessions on a runtime, in process, on `FakeClock`: idle timeouts, busy refusals,
sub-agents' credit and their parent's end."""

from __future__ import annotations

import asyncio

import pytest

from agent.agent_helpers import build_tokenizer
from treadle.agent.chat import Message
from treadle.agent.tokenizer import HFTokenizer
from treadle.core.cost_model import CostModel
from treadle.core.policies import build_policy, parse_policy
from treadle.gateway.errors import SessionBusy, SessionEnded, UnknownSession
from treadle.gateway.session import CallRequest, SessionLimits, SessionSpec
from treadle.gateway.sessions import Sessions
from treadle.runtime.driver import Runtime
from treadle.testing import FakeClock
from treadle.types import GroupKey, Trajectory, TrajectoryStatus


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _spec(name: str, parent: str | None = None, idle: float = 600.0) -> SessionSpec:
    return SessionSpec(session_id=name, trajectory_id=f"j/{name}", job_id="j",
                       key=GroupKey("j/g", 0), task_id="g", parent_id=parent,
                       trainable=parent is None, limits=SessionLimits(idle_timeout_s=idle))


def _sessions(tok: HFTokenizer, clock: FakeClock,
              ended: list[Trajectory]) -> Sessions:
    scheduler = build_policy(parse_policy("verl"), CostModel.named("qwen3-14b", "h100"),
                             batch_size=64)

    async def on_end(traj: Trajectory) -> None:
        ended.append(traj)

    return Sessions(Runtime(scheduler, clock=clock), tok, on_end=on_end, clock=clock,
                    sweep_s=1.0)


def test_an_idle_session_times_out_on_the_clock(tok: HFTokenizer) -> None:
    async def main() -> list[Trajectory]:
        clock, ended = FakeClock(), []
        sessions = _sessions(tok, clock, ended)
        sessions.create(_spec("a", idle=30.0))
        sessions.create(_spec("b", idle=90.0))
        for _ in range(40):  # 40 s pass; "a" is past its 30 s, "b" is not
            clock.advance(1.0)
            await asyncio.sleep(0)
        assert [t.trajectory_id for t in ended] == ["j/a"]
        sessions.get("b")
        with pytest.raises(UnknownSession):
            sessions.get("a")
        await sessions.close()
        return ended

    (traj,) = asyncio.run(main())
    assert (traj.status, traj.reason) == (TrajectoryStatus.TIMEOUT, "idle_timeout")
    assert traj.reward is None and traj.timings.finished_at == pytest.approx(30.0, abs=1.0)


def test_sub_agents_take_their_parents_credit_and_end_with_it(tok: HFTokenizer) -> None:
    async def main() -> list[Trajectory]:
        clock, ended = FakeClock(), []
        sessions = _sessions(tok, clock, ended)
        parent = sessions.create(_spec("p"))
        sessions.create(_spec("c1", parent="p"))
        sessions.create(_spec("c2", parent="p"))
        await sessions.end("c1")  # no reward of its own: it waits for its parent
        assert ended == []
        parent.busy = True
        with pytest.raises(SessionBusy):
            await sessions.end("p")
        parent.busy = False
        await sessions.end("p", reward=0.75)
        with pytest.raises(SessionEnded):  # a call on the ended session object
            await parent.call(CallRequest([Message("user", "late")]))
        with pytest.raises(UnknownSession):  # and no sub-agent for it any more
            sessions.create(_spec("late", parent="p"))
        await sessions.close()
        return ended

    ended = {t.trajectory_id: t for t in asyncio.run(main())}
    assert list(ended) == ["j/c2", "j/c1", "j/p"]  # children first
    assert ended["j/c1"].reward == 0.75 and ended["j/c1"].status is TrajectoryStatus.COMPLETED
    assert ended["j/c2"].status is TrajectoryStatus.ABORTED  # open when its parent ended
    assert ended["j/p"].children == ["j/c1", "j/c2"]
    assert ended["j/c1"].parent_id == "j/p" and not ended["j/c1"].trainable


def test_an_orchestrator_waiting_on_its_sub_agents_is_not_idle(tok: HFTokenizer) -> None:
    async def main() -> list[Trajectory]:
        clock, ended = FakeClock(), []
        sessions = _sessions(tok, clock, ended)
        sessions.create(_spec("p", idle=30.0))
        sessions.create(_spec("c", parent="p", idle=1000.0))
        sessions.create(_spec("g", parent="c", idle=1000.0))  # a grandchild
        for _ in range(40):
            clock.advance(1.0)
            await asyncio.sleep(0)
        assert ended == []  # 40 s idle, but its sub-agent is still at work
        await sessions.end("c", reward=0.5)  # its own open child is ended with it
        for _ in range(40):
            clock.advance(1.0)
            await asyncio.sleep(0)
        await sessions.close()
        return ended

    got = {t.trajectory_id: t for t in asyncio.run(main())}
    assert list(got) == ["j/g", "j/c", "j/p"]
    assert got["j/g"].status is TrajectoryStatus.ABORTED
    assert (got["j/p"].status, got["j/p"].reason) == (TrajectoryStatus.TIMEOUT, "idle_timeout")
