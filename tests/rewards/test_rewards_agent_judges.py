"""Agentic judged dimensions through a scripted lane: the agent is given the task (the
template filled), the spec and the work tree; its verdict is read from its final
answer; a lane that runs no agent, an episode that fails or an answer without a
verdict leave the dimension None with the reasons (never 0); the cache tells work
trees apart."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from treadle.rewards import (
    AgentSpec,
    JudgeCache,
    JudgeCallError,
    JudgedDimension,
    JudgeInput,
    JudgeReply,
    Judges,
    Rubric,
    Scale,
    VerdictError,
    VerdictKind,
    VerifiedDimension,
)
from treadle.testing import FakeClock
from treadle.types import GroupKey, JudgementStatus, RewardSource, Trajectory, TrajectoryStatus

SPEC = AgentSpec(("bash",), max_turns=4)
TEMPLATE = "Run the tests of this change and rate its $dimension from $low to $high:\n$diff"
FILES = {"pkg/core.py": "def f():\n    return 2\n"}
SEEN = JudgeInput(task="fix f", answer="done", trajectory="...", diff="+    return 2\n",
                  files=FILES)


class AgentLane:
    """A scripted lane that runs agentic judges: each `ask_agent` gets the next step
    (the episode's final answer, or an exception to raise) and records what it was
    given."""

    identity = "scripted agent judge"

    def __init__(self, *script: str | Exception) -> None:
        self.script = list(script)
        self.asked: list[tuple[str, AgentSpec, dict[str, str]]] = []

    async def ask(self, prompt: str, *, call_id: str, top_logprobs: int,
                  schema: Mapping[str, Any]) -> JudgeReply:
        raise AssertionError("an agentic dimension is never asked in one turn")

    async def ask_agent(self, prompt: str, *, call_id: str, spec: AgentSpec,
                        files: Mapping[str, str],
                        read: Callable[[str], float]) -> JudgeReply:
        self.asked.append((prompt, spec, dict(files)))
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        with contextlib.suppress(VerdictError):  # the episode's own score, as the lane's
            read(step)
        return JudgeReply(text='[bash] 1 failed\n{"score": 1}', output_ids=[7, 8],
                          logprobs=[-0.5, -0.25], verdict_text=step)


class OneTurnLane:
    identity = "one-turn endpoint"

    async def ask(self, prompt: str, *, call_id: str, top_logprobs: int,
                  schema: Mapping[str, Any]) -> JudgeReply:
        raise AssertionError("not asked")


def rubric(optional: bool = False) -> Rubric:
    return Rubric(verified=(VerifiedDimension("tests", 0.5),),
                  judged=(JudgedDimension("quality", 0.5, TEMPLATE, Scale(1, 5),
                                          optional=optional, agent=SPEC),))


def judged(lane: Any, r: Rubric, seen: JudgeInput = SEEN, **kw: Any) -> Trajectory:
    traj = Trajectory("j/t0/0", GroupKey("j/t0", 0), status=TrajectoryStatus.COMPLETED,
                      reward=1.0, reward_source=RewardSource.VERIFIER)

    async def run() -> Trajectory:
        return await Judges(lane, clock=FakeClock(autojump=True), **kw).judge(r, traj, seen)
    return asyncio.run(run())


def test_the_agent_gets_its_task_spec_and_work_tree_and_its_answer_is_the_verdict() -> None:
    lane = AgentLane('after running them: {"score": 4, "reason": "tests pass"}')
    traj = judged(lane, rubric())
    assert lane.asked == [("Run the tests of this change and rate its quality from 1 to 5:\n"
                           "+    return 2\n", SPEC, FILES)]
    (j,) = traj.judgements
    assert (j.status, j.score, j.value, j.reason) == (JudgementStatus.JUDGED, 4, 0.75,
                                                      "tests pass")
    # The verdict is the final answer's, not the episode's last JSON (its `text`).
    assert j.reply == '[bash] 1 failed\n{"score": 1}' and j.reply_ids == [7, 8]
    assert traj.rewards == {"tests": 1.0, "quality": 0.75}
    assert traj.reward == pytest.approx(0.875)


def test_failures_leave_the_dimension_none_with_every_reason_never_zero() -> None:
    lane = AgentLane(JudgeCallError("the judge's episode: engine: down"),
                     "I could not decide")
    traj = judged(lane, rubric(), attempts=2)
    (j,) = traj.judgements
    assert j.status is JudgementStatus.FAILED and j.value is None and j.score is None
    assert "attempt 1: JudgeCallError: the judge's episode: engine: down" in j.reason
    assert "attempt 2: VerdictError: no JSON object with a score" in j.reason
    assert j.reply == '[bash] 1 failed\n{"score": 1}'  # the last episode kept: the audit
    assert traj.reward is None and traj.flagged and traj.rewards["quality"] is None


def test_a_lane_without_agents_fails_the_dimension_and_an_optional_one_trains_on() -> None:
    traj = judged(OneTurnLane(), rubric(optional=True), attempts=1)
    (j,) = traj.judgements
    assert j.status is JudgementStatus.FAILED
    assert "runs no agentic judge" in j.reason
    assert traj.reward == 1.0 and not traj.flagged


def test_answers_are_cached_by_work_tree_as_well_as_prompt() -> None:
    cache = JudgeCache()
    lane = AgentLane(*['{"score": 5, "reason": "ok"}'] * 3)
    judged(lane, rubric(), cache=cache)
    again = judged(lane, rubric(), cache=cache)
    assert again.judgements[0].cached and len(lane.asked) == 1
    other = dataclasses.replace(SEEN, files={"pkg/core.py": "def f():\n    return 3\n"})
    assert not judged(lane, rubric(), other, cache=cache).judgements[0].cached
    assert len(lane.asked) == 2


def test_an_agent_spec_is_checked() -> None:
    with pytest.raises(ValueError, match="not among"):
        AgentSpec(("rm",))
    with pytest.raises(ValueError, match="unique"):
        AgentSpec(("bash", "bash"))
    with pytest.raises(ValueError, match="JSON of its final answer"):
        JudgedDimension("q", 1.0, "$task", verdict=VerdictKind.LOGPROBS, agent=SPEC)
