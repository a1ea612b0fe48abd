"""A task's tools served to a session (`gateway.tools`), in process: what a call may
do when, how it is recorded, and that `stop` cuts a call in flight. On a suite of
this test's own (`GateSuite`: a tool that waits for the test, and submit_answer),
no sandbox, no engine: the session's reply is a recorded turn."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from agent.agent_helpers import build_tokenizer
from treadle.agent.tokenizer import HFTokenizer
from treadle.core.cost_model import CostModel
from treadle.core.policies import build_policy, parse_policy
from treadle.envs.base import RewardResult, Suite
from treadle.envs.tools.answer import SubmitAnswerTool
from treadle.envs.tools.base import Tool, ToolContext, ToolResult
from treadle.gateway.errors import NoReplyYet, SessionBusy, SessionEnded, UnknownTool
from treadle.gateway.session import CallRequest, Session, SessionSpec
from treadle.gateway.tools import SessionTools
from treadle.runtime.driver import Runtime
from treadle.testing import FakeClock
from treadle.types import GroupKey, Task, Turn


class WaitTool(Tool):
    """Test double: a tool that answers when the test opens its gate."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.gate = asyncio.Event()

    @property
    def name(self) -> str:
        return "wait"

    @property
    def description(self) -> str:
        return "waits"

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        self.started.set()
        await self.gate.wait()
        return ToolResult(output=str(arguments["n"]))


class GateSuite(Suite):
    """Test double: one task, `WaitTool` and submit_answer, no sandbox."""

    name = "gate"

    def __init__(self) -> None:
        self.wait = WaitTool()

    def needs_sandbox(self, task: Task) -> bool:
        return False

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        return [self._task("t", "go", {})]

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        return self._task(str(record["id"]), "go", {})

    def tools(self, task: Task) -> list[Tool]:
        return [self.wait, SubmitAnswerTool()]

    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        return RewardResult(float(ctx.final_answer == "4"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _served(tok: HFTokenizer) -> tuple[SessionTools, GateSuite]:
    clock = FakeClock()
    scheduler = build_policy(parse_policy("verl"), CostModel.named("qwen3-14b", "h100"),
                             batch_size=64)
    spec = SessionSpec(session_id="s", trajectory_id="j/s", job_id="j",
                       key=GroupKey("j/g", 0), task_id="t", swept=False)
    session = Session(spec, Runtime(scheduler, clock=clock), tok, clock)
    suite = GateSuite()
    return SessionTools(session, suite.episode(suite.tasks()[0])), suite


def test_calls_follow_a_reply_and_are_recorded_as_the_agent_loop_records_them(
        tok: HFTokenizer) -> None:
    async def main() -> None:
        tools, suite = _served(tok)
        traj = tools.session.trajectory
        assert [s["function"]["name"] for s in tools.specs] == ["wait", "submit_answer"]
        with pytest.raises(NoReplyYet):  # no reply yet: a call belongs to one
            await tools.call("wait", {"n": 1})
        traj.turns.append(Turn(0, 3))  # the model's first reply
        with pytest.raises(UnknownTool):
            await tools.call("nope", {})
        bad = await tools.call("wait", '{"n": "x"}')  # a bad call is data
        assert bad.error is not None and "invalid arguments" in bad.error
        suite.wait.gate.set()
        ok = await tools.call("wait", {"n": 7})
        assert ok.output == "7" and ok.error is None
        # The turn holds the first call that ran after it, the later ones' seconds added.
        record = traj.turns[0].tool_call
        assert record is not None and (record.name, record.arguments) == ("wait", {"n": "x"})
        assert record.error == bad.error
        assert record.latency_s == pytest.approx(bad.latency_s + ok.latency_s)
        traj.turns.append(Turn(1, 3))
        done = await tools.call("submit_answer", {"answer": "4"})
        after = await tools.call("wait", {"n": 1})  # the episode is over: an error result
        assert done.done and after.error is not None and "episode is over" in after.error
        assert traj.turns[1].tool_call is not None
        assert traj.turns[1].tool_call.name == "submit_answer"
        assert (await tools.episode.score()).reward == 1.0

    asyncio.run(main())


def test_one_call_at_a_time_and_stop_cuts_the_call_in_flight(tok: HFTokenizer) -> None:
    async def main() -> None:
        tools, suite = _served(tok)
        session = tools.session
        session.trajectory.turns.append(Turn(0, 3))
        session.busy = True  # a chat call runs
        with pytest.raises(SessionBusy):
            await tools.call("wait", {"n": 1})
        session.busy = False
        running = asyncio.create_task(tools.call("wait", {"n": 1}))
        await suite.wait.started.wait()
        with pytest.raises(SessionBusy):  # another tool call
            await tools.call("wait", {"n": 2})
        with pytest.raises(SessionBusy):  # a chat call
            await session.call(CallRequest(messages=[]))
        await tools.stop()  # the harness is gone: the call is cut, no other runs
        assert running.cancelled()
        assert not session.in_tool_call
        with pytest.raises(SessionEnded):
            await tools.call("wait", {"n": 3})

    asyncio.run(main())
