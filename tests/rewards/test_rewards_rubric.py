"""Rubrics, verdicts and judging through a scripted lane: the prompt is the template
filled exactly, verdicts are read or refused (never defaulted), a judge that fails
leaves its dimension None with the reasons and the trajectory flagged and unscored,
answers are cached by content, gates skip the judges."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import pytest

from treadle.rewards import (
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
    expected_score,
    parse_json_verdict,
)
from treadle.testing import FakeClock
from treadle.types import (
    GroupKey,
    JudgementStatus,
    RewardSource,
    Trajectory,
    TrajectoryStatus,
)

TEMPLATE = ("Rate the $dimension of the answer from $low to $high.\nTask: $task\n"
            "Answer: $answer\nReply with JSON: {\"score\": n, \"reason\": \"...\"}")
SEEN = JudgeInput(task="What is 6*7?", answer="42", trajectory="[user]\nWhat is 6*7?")
Reply = Callable[[str, int], Coroutine[Any, Any, JudgeReply]]


class Lane:
    """A judge lane that answers with a script: each call gets the next reply (a
    JudgeReply, an exception to raise, or None: never answer)."""

    identity = "scripted judge"

    def __init__(self, *script: JudgeReply | Exception | None) -> None:
        self.script = list(script)
        self.prompts: list[str] = []

    async def ask(self, prompt: str, *, call_id: str, top_logprobs: int,
                  schema: Mapping[str, Any]) -> JudgeReply:
        self.prompts.append(prompt)
        step = self.script.pop(0)
        if step is None:
            await asyncio.Event().wait()  # hangs: only its timeout ends it
        if isinstance(step, Exception):
            raise step
        assert isinstance(step, JudgeReply)
        return step


def rubric(*, optional: bool = False, gate: float | None = None,
           verdict: VerdictKind = VerdictKind.JSON) -> Rubric:
    return Rubric(verified=(VerifiedDimension("correct", 0.5, gate=gate),),
                  judged=(JudgedDimension("clarity", 0.5, TEMPLATE, Scale(1, 5),
                                          verdict=verdict, optional=optional),))


def scored(reward: float = 1.0) -> Trajectory:
    return Trajectory("j/t0/0", GroupKey("j/t0", 0), status=TrajectoryStatus.COMPLETED,
                      reward=reward, reward_source=RewardSource.VERIFIER)


def judge(lane: Lane, r: Rubric, traj: Trajectory, **kw: Any) -> Trajectory:
    async def run() -> Trajectory:
        judges = Judges(lane, clock=FakeClock(autojump=True), timeout_s=30.0, **kw)
        return await judges.judge(r, traj, SEEN)
    return asyncio.run(run())


def test_the_prompt_is_the_template_filled_exactly() -> None:
    d = rubric().judged[0]
    assert d.render(SEEN) == (
        "Rate the clarity of the answer from 1 to 5.\nTask: What is 6*7?\nAnswer: 42\n"
        "Reply with JSON: {\"score\": n, \"reason\": \"...\"}")


def test_a_template_naming_an_unknown_field_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\$secret"):
        JudgedDimension("x", 1.0, "look at $secret")
    with pytest.raises(ValueError, match="names nothing"):
        JudgedDimension("x", 1.0, "costs $5")


def test_json_verdicts_are_read_or_refused() -> None:
    scale = Scale(1, 5)
    v = parse_json_verdict('thinking... ```json\n{"score": 4, "reason": "clear"}\n```', scale)
    assert (v.score, v.reason) == (4.0, "clear")
    for bad in ('{"score": 9}', '{"score": true}', '{"grade": 3}', "4", '{"score": "4"}'):
        with pytest.raises(VerdictError):
            parse_json_verdict(bad, scale)


def test_the_expected_score_comes_from_the_top_logprobs_of_the_score_token() -> None:
    tokens = ["Score", ":", " 4"]
    top = [{"Score": -0.1}, {":": -0.01},
           {" 4": math.log(0.5), "3": math.log(0.2), " 3": math.log(0.1), "x": math.log(0.2)}]
    v = expected_score(tokens, top, Scale(1, 5))
    assert v.position == 2
    assert v.score == pytest.approx((4 * 0.5 + 3 * 0.3) / 0.8)
    assert v.mass == pytest.approx(0.8)
    with pytest.raises(VerdictError, match="no score token"):
        expected_score(["no", "score"], [{"no": 0.0}, {"score": 0.0}], Scale(1, 5))


def test_a_verdict_fills_the_reward_vector_and_the_weighted_sum() -> None:
    lane = Lane(JudgeReply('{"score": 4, "reason": "clear"}'))
    t = judge(lane, rubric(), scored())
    assert lane.prompts == [rubric().judged[0].render(SEEN)]
    assert t.rewards == {"correct": 1.0, "clarity": 0.75}
    assert t.reward == pytest.approx(0.5 * 1.0 + 0.5 * 0.75)
    assert t.reward_source is RewardSource.RUBRIC and not t.flagged
    (j,) = t.judgements
    assert (j.status, j.score, j.reason, j.attempts, j.cached) == (
        JudgementStatus.JUDGED, 4.0, "clear", 1, False)
    assert j.reply == '{"score": 4, "reason": "clear"}' and j.prompt == lane.prompts[0]


def test_a_failing_judge_leaves_the_dimension_none_flagged_never_zero() -> None:
    lane = Lane(JudgeCallError("connection refused"), None, JudgeReply("I like it"))
    t = judge(lane, rubric(), scored())
    assert len(lane.prompts) == 3  # the whole budget was spent
    (j,) = t.judgements
    assert j.status is JudgementStatus.FAILED and j.value is None and j.score is None
    assert "connection refused" in j.reason and "within 30.0 s" in j.reason
    assert "no JSON object" in j.reason and j.reply == "I like it"
    assert t.rewards == {"correct": 1.0, "clarity": None}
    assert t.flagged and t.reward is None and t.reward_source is None


def test_an_unparseable_answer_is_asked_again_within_the_budget() -> None:
    lane = Lane(JudgeReply("hmm"), JudgeReply('{"score": 2}'))
    t = judge(lane, rubric(), scored())
    assert t.judgements[0].attempts == 2 and t.rewards["clarity"] == 0.25
    lane = Lane(JudgeReply("hmm"), JudgeReply('{"score": 2}'))
    t = judge(lane, rubric(), scored(), attempts=1)
    assert t.flagged and len(lane.prompts) == 1


def test_an_optional_dimension_without_a_verdict_trains_on_the_rest() -> None:
    t = judge(Lane(JudgeCallError("down"), JudgeCallError("down"), JudgeCallError("down")),
              rubric(optional=True), scored(0.6))
    assert t.rewards == {"correct": 0.6, "clarity": None}
    assert not t.flagged and t.reward == pytest.approx(0.6)  # its weight goes to the rest


def test_answers_are_cached_by_content() -> None:
    cache = JudgeCache()
    lane = Lane(JudgeReply('{"score": 5}'))
    judge(lane, rubric(), scored(), cache=cache)
    t = judge(lane, rubric(), scored(), cache=cache)  # the script is empty: no call
    assert t.judgements[0].cached and t.judgements[0].attempts == 0
    assert t.rewards["clarity"] == 1.0 and cache.hits == 1
    other = Lane(JudgeReply('{"score": 1}'))
    seen_other = JudgeInput(task="What is 6*8?", answer="48", trajectory="")
    t = asyncio.run(Judges(other, cache=cache).judge(rubric(), scored(), seen_other))
    assert not t.judgements[0].cached and t.rewards["clarity"] == 0.0


def test_a_gate_not_passed_skips_the_judges() -> None:
    lane = Lane()
    t = judge(lane, rubric(gate=1.0), scored(0.5))
    assert lane.prompts == [] and t.reward == 0.0 and not t.flagged  # the gated reward
    assert t.judgements[0].status is JudgementStatus.SKIPPED
    assert t.rewards == {"correct": 0.5, "clarity": None}


def test_a_trajectory_without_a_reward_is_not_judged() -> None:
    lane = Lane()
    t = Trajectory("x", GroupKey("g", 0), status=TrajectoryStatus.ERROR)
    assert judge(lane, rubric(), t).judgements == [] and lane.prompts == []


def test_logprob_verdicts_read_the_lanes_top_alternatives() -> None:
    reply = JudgeReply("3", tokens=["3"], top=[{"3": math.log(0.5), "5": math.log(0.5)}])
    t = judge(Lane(reply), rubric(verdict=VerdictKind.LOGPROBS), scored())
    assert t.judgements[0].score == pytest.approx(4.0)
    assert t.rewards["clarity"] == pytest.approx(0.75)
