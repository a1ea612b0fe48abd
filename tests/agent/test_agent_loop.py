"""The agent loop, token-exact: scripted replies through a real tokenizer and real
episodes (a sandbox-free test suite, and the math suite with the local backend)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import FakeScriptedRunner, build_tokenizer

from treadle.agent.chat import IM_END, Call, HermesFormat, prompt_messages
from treadle.agent.loop import AgentLimits, run_agent, tool_messages
from treadle.agent.runner import Sampling
from treadle.agent.tokenizer import HFTokenizer
from treadle.engines.base import derived_seed
from treadle.envs.base import RewardResult, Suite, open_episode
from treadle.envs.tools.answer import SubmitAnswerTool
from treadle.envs.tools.base import Tool, ToolContext, ToolResult
from treadle.errors import SandboxError
from treadle.testing import FakeClock
from treadle.types import FailureStage, GroupKey, Task, TrajectoryStatus

FMT = HermesFormat()


class EchoTool(Tool):
    @property
    def name(self) -> str:
        return "echo"

    @property
    def description(self) -> str:
        return "echo the text back"

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object", "properties": {"text": {"type": "string"}},
                "required": ["text"]}

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        if arguments["text"] == "crash":
            raise SandboxError("the sandbox died")
        return ToolResult(output=arguments["text"])


class EchoSuite(Suite):
    """A test suite: no sandbox; reward 1 for submitting the task's answer."""

    name = "echo-test"

    def __init__(self, reward_fails: bool = False) -> None:
        self.reward_fails = reward_fails

    def needs_sandbox(self, task: Task) -> bool:
        return False

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        return [Task("q1", "Say 42.", suite=self.name, metadata={"answer": "42"})]

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        raise NotImplementedError

    def tools(self, task: Task) -> list[Tool]:
        return [EchoTool(), SubmitAnswerTool()]

    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        if self.reward_fails:
            raise SandboxError("grader sandbox gone")
        answer = ctx.final_answer if ctx.final_answer is not None else final_message
        return RewardResult(float(answer == ctx.task.metadata["answer"]), {"submitted": 1.0})


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def call(name: str, **arguments: Any) -> str:
    return FMT.reply_text("", [Call.of(name, arguments)])


def play(tok: HFTokenizer, replies: list[str], suite: Suite | None = None,
         limits: AgentLimits | None = None, sampling: Sampling | None = None,
         group: str = "q1", **runner_kw: Any) -> tuple[Any, FakeScriptedRunner]:
    """One trajectory of the sandbox-free suite, on a fake clock that jumps over every
    wait (the runner's delays, the deadline): exact, and over at once."""
    suite = suite or EchoSuite()
    limits = limits or AgentLimits()
    task = suite.tasks()[0]
    clock = FakeClock(autojump=True)
    runner = FakeScriptedRunner(tok, replies, clock=clock, **runner_kw)

    async def go() -> Any:
        async with open_episode(suite, task) as ep:
            return await run_agent(ep, tok, runner, traj_id=f"{group}/t0",
                                   key=GroupKey(group, 0), limits=limits,
                                   sampling=sampling or Sampling(), clock=clock)

    return asyncio.run(asyncio.wait_for(go(), 30)), runner


def test_a_two_turn_trajectory_is_token_exact(tok: HFTokenizer) -> None:
    traj, runner = play(tok, [call("echo", text="hello"), call("submit_answer", answer="42")])
    assert traj.status is TrajectoryStatus.COMPLETED and traj.reward == 1.0
    seg = traj.segments[0]
    seg.validate()
    prompt = tok.encode(FMT.prompt(prompt_messages("Say 42."),
                                   [EchoTool().spec, SubmitAnswerTool().spec]))
    obs = tok.encode(FMT.continuation(tool_messages(["hello"]), True))
    r1, r2 = runner.outputs
    assert seg.prompt_ids == prompt
    assert seg.response_ids == r1.output_ids + obs + r2.output_ids
    assert seg.loss_mask == [1] * len(r1.output_ids) + [0] * len(obs) + [1] * len(r2.output_ids)
    assert seg.logprobs == r1.logprobs + [0.0] * len(obs) + r2.logprobs
    assert seg.policy_versions == [3] * len(seg.response_ids)
    # The engine saw exactly the record's tokens, appended, never re-tokenized.
    assert runner.prompts == [prompt, prompt + r1.output_ids + obs]
    assert r1.output_ids[-1] == tok.token_id(IM_END)
    assert [t.output_tokens for t in traj.turns] == [len(r1.output_ids), len(r2.output_ids)]
    assert traj.turns[0].tool_call is not None and traj.turns[0].tool_call.name == "echo"
    assert traj.turns[0].tool_call.output_tokens == len(obs)
    assert traj.timings.llm_s == pytest.approx(1.0) and traj.timings.queue_s == pytest.approx(0.5)
    # The scheduler heard: turn, tool, turn, final tool (submit_answer), nothing after.
    kinds = [e[0] for e in runner.events]
    assert kinds == ["generate", "turn", "tool_started", "tool_finished",
                     "generate", "turn", "tool_started", "tool_finished"]
    assert runner.events[3] == ("tool_finished", len(obs), False)
    assert runner.events[-1] == ("tool_finished", 0, True)


def test_a_reply_without_tool_calls_completes_and_is_scored_on_its_text(
        tok: HFTokenizer) -> None:
    traj, runner = play(tok, ["42" + IM_END])
    assert traj.status is TrajectoryStatus.COMPLETED and traj.reward == 1.0
    assert runner.events[-1][0] == "turn" and runner.events[-1][-1] is True


def test_malformed_calls_and_unknown_tools_are_observations(tok: HFTokenizer) -> None:
    traj, runner = play(tok, ["<tool_call>{oops}</tool_call>" + IM_END, call("nope"),
                              call("echo"), call("submit_answer", answer="41")])
    assert traj.status is TrajectoryStatus.COMPLETED and traj.reward == 0.0
    shown = tok.decode(runner.prompts[-1])
    assert "not valid JSON" in shown and "unknown tool 'nope'" in shown
    assert "invalid arguments for echo" in shown
    assert len(traj.turns) == 4


def test_max_turns_ends_with_its_own_status_and_is_still_scored(tok: HFTokenizer) -> None:
    traj, runner = play(tok, [call("echo", text="a")] * 3, limits=AgentLimits(max_turns=2))
    assert (traj.status, traj.reason, traj.reward) == (TrajectoryStatus.MAX_TURNS,
                                                       "max_turns", 0.0)
    assert len(traj.turns) == 2 and runner.events[-1] == ("tool_finished", 0, True)
    # The last observation was never shown to the model, so it is not in the record.
    assert traj.segments[0].response_ids[-1] == tok.token_id(IM_END)


def test_a_reply_cut_at_the_per_turn_limit_is_truncated(tok: HFTokenizer) -> None:
    traj, runner = play(tok, ["a long reply about the tool call result" * 5 + IM_END],
                        limits=AgentLimits(max_tokens_per_turn=5))
    assert (traj.status, traj.reason) == (TrajectoryStatus.TRUNCATED, "max_tokens_per_turn")
    assert traj.turns[0].output_tokens == 5 and runner.events[-1][-1] is True


def test_the_context_never_exceeds_max_total_tokens(tok: HFTokenizer) -> None:
    first, _ = play(tok, ["42" + IM_END])
    limit = first.prompt_tokens + 20
    traj, runner = play(tok, [call("echo", text="the result " * 30)] * 4,
                        limits=AgentLimits(max_total_tokens=limit))
    assert (traj.status, traj.reason) == (TrajectoryStatus.TRUNCATED, "max_total_tokens")
    assert traj.prompt_tokens + len(traj.segments[0].response_ids) <= limit
    assert all(max_tokens <= limit - traj.prompt_tokens for _, max_tokens in
               (e for e in runner.events if e[0] == "generate"))


def test_a_prompt_longer_than_the_budget_is_truncated_before_any_turn(
        tok: HFTokenizer) -> None:
    traj, runner = play(tok, ["42" + IM_END], limits=AgentLimits(max_total_tokens=5))
    assert (traj.status, traj.reason) == (TrajectoryStatus.TRUNCATED, "max_total_tokens")
    assert not traj.turns and runner.events == [("ended", "max_total_tokens")]


def test_the_deadline_ends_a_slow_turn_with_timeout(tok: HFTokenizer) -> None:
    traj, runner = play(tok, ["42" + IM_END], limits=AgentLimits(deadline_s=0.05),
                        delay_s=5.0)
    assert (traj.status, traj.reason) == (TrajectoryStatus.TIMEOUT, "deadline")
    assert runner.events[-1] == ("ended", "deadline") and traj.reward == 0.0
    assert traj.timings.finished_at == pytest.approx(0.05)  # at the deadline, not the reply


def test_a_turn_that_ends_just_before_the_deadline_is_not_cut(tok: HFTokenizer) -> None:
    traj, _ = play(tok, [call("echo", text="a"), "42" + IM_END],
                   limits=AgentLimits(deadline_s=10.0), delay_s=4.99)
    assert traj.status is TrajectoryStatus.COMPLETED and len(traj.turns) == 2
    assert traj.timings.finished_at == pytest.approx(9.98)
    traj, _ = play(tok, [call("echo", text="a"), "42" + IM_END],
                   limits=AgentLimits(deadline_s=10.0), delay_s=5.01)
    assert (traj.status, traj.reason) == (TrajectoryStatus.TIMEOUT, "deadline")
    assert traj.timings.finished_at == pytest.approx(10.0)


def test_an_engine_failure_is_an_error_of_the_engine_stage_with_no_reward(
        tok: HFTokenizer) -> None:
    traj, runner = play(tok, [call("echo", text="a"), "x"], fail_on_turn=1)
    assert traj.status is TrajectoryStatus.ERROR and traj.failure_stage is FailureStage.ENGINE
    assert "unreachable" in (traj.reason or "") and traj.reward is None and traj.infra_failure
    assert runner.events[-1][0] == "ended"


def test_a_tool_infrastructure_failure_is_an_error_of_the_tool_stage(
        tok: HFTokenizer) -> None:
    traj, _ = play(tok, [call("echo", text="crash")])
    assert traj.status is TrajectoryStatus.ERROR and traj.failure_stage is FailureStage.TOOL
    assert "sandbox died" in (traj.reason or "") and traj.reward is None


def test_a_failing_reward_is_an_error_of_the_eval_stage(tok: HFTokenizer) -> None:
    traj, _ = play(tok, ["42" + IM_END], suite=EchoSuite(reward_fails=True))
    assert traj.status is TrajectoryStatus.ERROR and traj.failure_stage is FailureStage.EVAL
    assert traj.reward is None


def test_cancelling_propagates_and_tells_the_runner(tok: HFTokenizer) -> None:
    suite = EchoSuite()
    clock = FakeClock()  # never advanced: the turn stays in flight until cancelled
    runner = FakeScriptedRunner(tok, ["42" + IM_END], delay_s=10.0, clock=clock)

    async def go() -> None:
        async with open_episode(suite, suite.tasks()[0]) as ep:
            task = asyncio.ensure_future(run_agent(ep, tok, runner, traj_id="t0",
                                                   key=GroupKey("q1", 0), clock=clock))
            await runner.generating.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert runner.events[-1] == ("ended", "cancelled")


def test_math_with_the_real_python_tool(tok: HFTokenizer, tmp_path: Path) -> None:
    from treadle.envs.suites.math import MathSuite
    from treadle.sandbox import LocalBackend

    suite = MathSuite()
    task = next(t for t in suite.tasks(50, seed=1) if t.metadata["kind"] == "arith")
    question = task.metadata["question"]
    expression = question.removeprefix("Compute ").removesuffix(".").replace("^", "**")
    runner = FakeScriptedRunner(tok, [call("python", code=f"print({expression})"), "x"])

    async def go() -> Any:
        async with open_episode(suite, task, LocalBackend(work_root=str(tmp_path))) as ep:
            first = await run_agent(ep, tok, runner, traj_id="t0", key=GroupKey("m", 0))
            return first, ep.history[0].result.output.strip()

    traj, printed = asyncio.run(asyncio.wait_for(go(), 60))
    assert printed == task.metadata["answer"]
    # Turn 2 saw the tool's real output; its reply ("x") was scored as the answer.
    assert f"<tool_response>\n{printed}" in tok.decode(runner.prompts[1])
    assert traj.status is TrajectoryStatus.COMPLETED and traj.reward == 0.0
    # The suite's metrics, as plain floats: the reply "x" is not a number at all.
    assert traj.metrics == {"correct": 0.0, "parsed": 0.0}
    assert all(type(v) is float for v in traj.metrics.values())


def test_a_seeded_sampling_gives_each_turn_a_seed_of_its_task_sample_and_index(
        tok: HFTokenizer) -> None:
    replies = [call("echo", text="hello"), call("submit_answer", answer="42")]
    traj, runner = play(tok, replies, sampling=Sampling(temperature=0.5, seed=5))
    task = traj.task_id
    assert [s.seed for s in runner.samplings] == [derived_seed(5, task, 0, 0),
                                                  derived_seed(5, task, 0, 1)]
    assert len({s.seed for s in runner.samplings}) == 2
    assert {s.temperature for s in runner.samplings} == {0.5}
    # The job, trajectory id and group id do not enter it: a seeded evaluation of the
    # same task and sample draws the same numbers in any job.
    _traj, again = play(tok, replies, sampling=Sampling(temperature=0.5, seed=5),
                        group="job2/q1")
    assert again.samplings == runner.samplings
    _traj, unseeded = play(tok, replies)
    assert [s.seed for s in unseeded.samplings] == [None, None]


class BadPromptSuite(EchoSuite):
    """A task whose prompt the chat format cannot render: a role it has no turn for."""

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        return [Task("q1", [{"role": "critic", "content": "Say 42."}], suite=self.name,
                     metadata={"answer": "42"})]


def test_a_prompt_that_cannot_be_rendered_is_an_init_failure_not_a_crash(
        tok: HFTokenizer) -> None:
    traj, runner = play(tok, [], suite=BadPromptSuite())
    assert traj.status is TrajectoryStatus.ERROR and traj.failure_stage is FailureStage.INIT
    assert "prompt message 0" in (traj.reason or "") and traj.reward is None
    assert runner.events == [("ended", traj.reason)] and not traj.turns
