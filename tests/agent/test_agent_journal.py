"""Resuming a trajectory from its turn journal: the record up to the crash is the
uninterrupted run's, token for token; the engine is asked only for the turns after
it; tools declared RERUN run again (their state rebuilt), NONE ones do not, and an
OPAQUE call ends what a resume keeps. Scripted replies through a real tokenizer, a
sandbox-free suite whose tools keep state in the episode."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
from agent_helpers import FakeScriptedRunner, build_tokenizer

from treadle.agent.chat import Call, HermesFormat
from treadle.agent.journal import (
    FROM_PROMPT,
    JournaledTurn,
    ReplayingRunner,
    ResumeFrom,
    plan_resume,
    resume_body,
)
from treadle.agent.loop import AgentLimits, run_agent
from treadle.agent.tokenizer import HFTokenizer
from treadle.envs.base import RewardResult, Suite, open_episode
from treadle.envs.tools.answer import SubmitAnswerTool
from treadle.envs.tools.base import Tool, ToolContext, ToolReplay, ToolResult
from treadle.testing import FakeClock
from treadle.types import GroupKey, ResumePoint, Task, Trajectory, TrajectoryStatus

FMT = HermesFormat()


class _Tool(Tool):
    tool_name = ""

    @property
    def name(self) -> str:
        return self.tool_name

    @property
    def description(self) -> str:
        return f"the {self.tool_name} tool"

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object", "properties": {}}


class Bump(_Tool):
    """Adds one to the episode's counter (state a resume must rebuild)."""

    tool_name = "bump"
    replay = ToolReplay.RERUN

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        ctx.state["n"] = ctx.state.get("n", 0) + 1
        ctx.state["runs"] = ctx.state.get("runs", 0) + 1
        return ToolResult(output=f"n={ctx.state['n']}")


class Peek(_Tool):
    """Reads the counter (nothing to rebuild)."""

    tool_name = "peek"
    replay = ToolReplay.NONE

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        ctx.state["peeks"] = ctx.state.get("peeks", 0) + 1
        return ToolResult(output=f"seen {ctx.state.get('n', 0)}")


class Remote(_Tool):
    """State elsewhere: not declared, so opaque."""

    tool_name = "remote"

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return ToolResult(output="remote ok")


class CounterSuite(Suite):
    name = "counter-test"

    def needs_sandbox(self, task: Task) -> bool:
        return False

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        return [Task("q1", "Count to two.", suite=self.name, metadata={"answer": "2"})]

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        raise NotImplementedError

    def tools(self, task: Task) -> list[Tool]:
        return [Bump(), Peek(), Remote(), SubmitAnswerTool()]

    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        return RewardResult(float(ctx.final_answer == str(ctx.state.get("n"))))


def call(name: str, **arguments: Any) -> str:
    return FMT.reply_text("", [Call.of(name, arguments)])


SCRIPT = [call("bump"), call("bump"), call("peek"), call("submit_answer", answer="2")]


class Journal:
    def __init__(self) -> None:
        self.entries: list[JournaledTurn] = []
        self.sampled_tokens: list[int] = []  # each live reply's, as it came

    def sampled(self, tokens: int) -> None:
        self.sampled_tokens.append(tokens)

    def turn(self, entry: JournaledTurn) -> None:
        self.entries.append(entry)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def run(tok: HFTokenizer, replies: list[str], *, journal: Journal | None = None,
        bodies: list[str] | None = None, attempt: int = 1,
        from_prompt: bool = False) -> tuple[Trajectory, FakeScriptedRunner, dict[str, Any]]:
    """One trajectory; with `bodies`, a restarted attempt resuming from them."""
    suite = CounterSuite()
    clock = FakeClock(autojump=True)
    runner = FakeScriptedRunner(tok, replies, clock=clock)
    state: dict[str, Any] = {}

    async def go() -> Trajectory:
        async with open_episode(suite, suite.tasks()[0]) as ep:
            resume = None if bodies is None else plan_resume(
                bodies, [], attempt=attempt, replay_of=ep.replay_of, from_prompt=from_prompt)
            traj = await run_agent(ep, tok, runner, traj_id="q1/t0", key=GroupKey("q1", 0),
                                   limits=AgentLimits(max_turns=8), clock=clock,
                                   journal=journal, resume=resume)
            state.update(ep.ctx.state)
            return traj

    return asyncio.run(asyncio.wait_for(go(), 30)), runner, state


def _same_record(a: Trajectory, b: Trajectory) -> None:
    """Token-exact, and the turns the same but for their tools' seconds (a live call's
    are its own)."""
    assert [(s.prompt_ids, s.response_ids, s.loss_mask, s.logprobs, s.policy_versions)
            for s in a.segments] == \
           [(s.prompt_ids, s.response_ids, s.loss_mask, s.logprobs, s.policy_versions)
            for s in b.segments]
    assert [(t.index, t.output_tokens, t.engine_id, t.policy_version, t.queued_s,
             t.generating_s, None if t.tool_call is None else
             (t.tool_call.name, t.tool_call.arguments, t.tool_call.output_tokens))
            for t in a.turns] == \
           [(t.index, t.output_tokens, t.engine_id, t.policy_version, t.queued_s,
             t.generating_s, None if t.tool_call is None else
             (t.tool_call.name, t.tool_call.arguments, t.tool_call.output_tokens))
            for t in b.turns]
    assert (a.status, a.reward, a.prompt_tokens) == (b.status, b.reward, b.prompt_tokens)


def test_a_resumed_trajectory_is_the_uninterrupted_one_and_asks_only_for_what_is_left(
        tok: HFTokenizer) -> None:
    journal = Journal()
    whole, whole_runner, _ = run(tok, SCRIPT, journal=journal)
    assert whole.status is TrajectoryStatus.COMPLETED and whole.reward == 1.0
    # Every completed turn but the final one is journaled, each once, in order.
    assert [e.index for e in journal.entries] == [0, 1, 2]
    # The service died after two turns: the third (peek) and the answer run again.
    bodies = [e.encode() for e in journal.entries[:2]]
    resumed, runner, state = run(tok, SCRIPT[2:], bodies=bodies)
    _same_record(resumed, whole)
    # The replayed turns' tool seconds are the recorded ones.
    assert [t.tool_call.latency_s for t in resumed.turns[:2] if t.tool_call] == \
        [t.tool_call.latency_s for t in whole.turns[:2] if t.tool_call]
    assert resumed.resumed == [ResumePoint(1, 2, rerun_calls=2)]
    # The engine saw exactly the uninterrupted run's context at turn 2, once.
    assert runner.prompts == whole_runner.prompts[2:]
    # Its runner heard of the trajectory first at its first live turn.
    assert runner.events[0][0] == "generate" and len(
        [e for e in runner.events if e[0] == "turn"]) == 2
    # bump ran again twice (the counter rebuilt: peek saw 2, live), peek was not replayed.
    assert state["n"] == 2 and state["runs"] == 2 and state["peeks"] == 1


def test_the_journal_keeps_a_resumed_attempts_new_turns_only(tok: HFTokenizer) -> None:
    first = Journal()
    run(tok, SCRIPT, journal=first)
    again = Journal()
    run(tok, SCRIPT[1:], journal=again, bodies=[first.entries[0].encode()])
    assert [e.index for e in again.entries] == [1, 2]
    # Only the live replies are news (the final one's turn is never journaled).
    live = [t.output_tokens for t in first_turns(first)][1:]
    assert again.sampled_tokens == [*live, len(tok.encode(SCRIPT[3]))]
    assert [(e.output, [(c.name, c.arguments, c.result.output) for c in e.calls])
            for e in again.entries] == \
        [(e.output, [(c.name, c.arguments, c.result.output) for c in e.calls])
         for e in first.entries[1:]]


def first_turns(journal: Journal) -> list[Any]:
    return [e.output.turn(e.index) for e in journal.entries]


def test_an_opaque_call_ends_what_a_resume_keeps(tok: HFTokenizer) -> None:
    script = [call("bump"), call("remote"), call("bump"), call("submit_answer", answer="2")]
    journal = Journal()
    whole, _, _ = run(tok, script, journal=journal)
    bodies = [e.encode() for e in journal.entries]
    resumed, runner, state = run(tok, script[1:], bodies=bodies, attempt=2)
    point = resumed.resumed[-1]
    assert (point.attempt, point.turn, point.rerun_calls, point.discarded_turns) == (2, 1, 1, 2)
    assert point.discarded_tokens == sum(e.tokens for e in journal.entries[1:])
    assert point.reason == "turn 1: tool 'remote' cannot be replayed"
    _same_record(resumed, whole)  # (the same script: the same tokens again)
    assert len(runner.prompts) == 3 and state["runs"] == 2


def test_resuming_from_the_prompt_keeps_nothing_and_says_what_it_discarded(
        tok: HFTokenizer) -> None:
    journal = Journal()
    whole, _, _ = run(tok, SCRIPT, journal=journal)
    bodies = [e.encode() for e in journal.entries]
    resumed, runner, _ = run(tok, SCRIPT, bodies=bodies, from_prompt=True)
    assert resumed.resumed == [ResumePoint(1, 0, 0, 3, sum(e.tokens for e in journal.entries),
                                           FROM_PROMPT)]
    assert len(runner.prompts) == 4
    _same_record(resumed, whole)


def test_earlier_resumes_are_kept_and_a_bad_entry_ends_the_prefix() -> None:
    earlier = ResumePoint(1, 3, 1, 0, 0, "")
    good = JournaledTurn(0, FakeOutput.make(3))
    resume = plan_resume([good.encode(), b"\xc1not msgpack", good.encode()],
                         [resume_body(earlier)],
                         attempt=2, replay_of=None)
    assert resume.resumed[0] == earlier
    assert resume.point.turn == 1 and resume.point.discarded_turns == 2
    assert resume.point.reason.startswith("turn 1: its journal entry does not read")
    assert resume.point.discarded_tokens == 3  # (the unreadable entry's are unknown)


def test_a_planner_records_the_resume_it_plans_before_returning_it() -> None:
    earlier = ResumePoint(1, 3, 1, 0, 0, "")
    source = ResumeFrom(2, (JournaledTurn(0, FakeOutput.make(3)).encode(),),
                        (resume_body(earlier),))
    recorded: list[ResumePoint] = []
    resume = source.planner(recorded.append)(None)
    assert recorded == [resume.point] and resume.point.attempt == 2
    assert resume == source.plan(None)


class FakeOutput:
    @staticmethod
    def make(n: int) -> Any:
        from treadle.agent.runner import TurnOutput
        return TurnOutput(list(range(n)), [-0.5] * n, [1] * n, "stop", "e0", 0.1, 0.2)


def test_a_replaying_runner_forwards_the_end_and_the_first_live_turn() -> None:
    class Inner:
        policy_version = 7

        def __init__(self) -> None:
            self.heard: list[str] = []

        async def generate(self, *a: Any) -> Any:
            self.heard.append("generate")
            return FakeOutput.make(1)

        def turn_finished(self, *a: Any) -> None:
            self.heard.append("turn")

        def tool_started(self) -> None:
            self.heard.append("tool_started")

        def tool_finished(self, *a: Any) -> None:
            self.heard.append("tool_finished")

        def ended(self, reason: str) -> None:
            self.heard.append("ended")

    inner = Inner()
    runner = ReplayingRunner(inner, [FakeOutput.make(2)])

    async def go() -> None:
        assert len((await runner.generate([], 4, None, [])).output_ids) == 2  # type: ignore[arg-type]
        runner.turn_finished(2, 2, False), runner.tool_started(), runner.tool_finished(0, 1, False)
        assert len((await runner.generate([], 4, None, [])).output_ids) == 1  # type: ignore[arg-type]
        runner.turn_finished(1, 3, True)
        runner.ended("done")

    asyncio.run(go())
    assert inner.heard == ["generate", "turn", "ended"] and runner.policy_version == 7
