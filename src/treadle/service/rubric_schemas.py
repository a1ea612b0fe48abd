"""A job's rubric on the wire (`JobRequest.rubric`): pydantic at the edge, turned into
`treadle.rewards.Rubric` (the dataclasses inside) when the request is validated, so
a bad template or weight is a 422 naming the field (docs/rewards.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from treadle.rewards import (
    AgentSpec,
    JudgedDimension,
    Rubric,
    Scale,
    VerdictKind,
    VerifiedDimension,
)

NAME = r"^[A-Za-z0-9_.:-]+$"  # a dimension's name (a key of the record's rewards)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JudgeParams(_Strict):
    """Where the judge runs and how it is asked."""

    engines: Literal["policy", "frozen"] = Field(
        default="policy", description="the service's engines that judge, when no url is "
                                      "given: the policy's (the model as it is trained) or "
                                      "the frozen pool (a pinned version)")
    url: str | None = Field(default=None, min_length=1, max_length=2048, pattern=r"^https?://",
                            description="an OpenAI-compatible base URL (ending /v1) whose "
                                        "/chat/completions judges instead")
    model: str = Field(default="model", min_length=1, max_length=256,
                       description="the endpoint's model name (url only)")
    api_key: str | None = Field(default=None, max_length=4096,
                                description="the endpoint's key (url only)")
    max_tokens: int = Field(default=256, ge=1, le=1 << 16)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    attempts: int = Field(default=3, ge=1, le=20,
                          description="calls per dimension before it is left without a "
                                      "verdict (a failure, a timeout or an unreadable reply "
                                      "each use one)")
    timeout_s: float = Field(default=120.0, gt=0.0, le=3600.0,
                             description="seconds one judge call may take")
    diff_chars: int = Field(default=16_384, ge=256, le=1 << 20,
                            description="the longest $diff shown (characters; a longer "
                                        "one is cut, with a marker line saying so)")


class VerifiedParams(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=NAME)
    weight: float = Field(ge=0.0, le=1e6, allow_inf_nan=False)
    metric: str = Field(default="reward", min_length=1, max_length=128,
                        description="reward: the suite's reward; else one of its metrics")
    gate: float | None = Field(default=None, allow_inf_nan=False,
                               description="below this, the reward is gated_reward and the "
                                           "judges are not asked (tests must pass: 1.0)")


JudgeTool = Literal["bash", "python", "read_file", "write_file", "apply_patch"]


def _default_tools() -> list[JudgeTool]:
    return ["bash", "read_file"]


class AgentParams(_Strict):
    """An agentic judge: the template is its task; it works in a sandbox holding the
    trajectory's work tree with these tools (and submit_answer) and answers with the
    verdict's JSON."""

    tools: list[JudgeTool] = Field(
        default_factory=_default_tools, min_length=1, max_length=5,
        description="the judge's tools besides submit_answer")
    max_turns: int = Field(default=8, ge=1, le=64, description="its replies at most")
    max_total_tokens: int = Field(default=16_384, ge=2, le=1 << 20,
                                  description="its whole context at most")
    max_tokens_per_turn: int | None = Field(default=None, ge=1, le=1 << 16,
                                            description="one reply at most (default: the "
                                                        "judge's max_tokens)")


class JudgedParams(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=NAME)
    weight: float = Field(ge=0.0, le=1e6, allow_inf_nan=False)
    template: str = Field(min_length=1, max_length=65_536,
                          description="the judge's prompt: $task, $answer, $trajectory, "
                                      "$diff, $low, $high, $dimension are filled in")
    scale: list[int] = Field(default_factory=lambda: [1, 5], min_length=2, max_length=2,
                             description="[low, high] integer scores")
    verdict: Literal["json", "logprobs"] = Field(
        default="json", description="json: the score in a JSON object of the reply; "
                                    "logprobs: the expected score under the top logprobs "
                                    "of the score token (needs a judge url)")
    optional: bool = Field(default=False, description="train without it when its judge "
                                                      "gives no verdict")
    agent: AgentParams | None = Field(default=None, description="judged by an agent with "
                                                                "tools in a sandbox holding "
                                                                "the work tree")


class RubricParams(_Strict):
    """`JobRequest.rubric`: the reward vector of each trajectory (docs/rewards.md)."""

    verified: list[VerifiedParams] = Field(default_factory=list, max_length=32)
    judged: list[JudgedParams] = Field(default_factory=list, max_length=32)
    gated_reward: float = Field(default=0.0, allow_inf_nan=False)
    judge: JudgeParams = Field(default_factory=JudgeParams)

    @model_validator(mode="after")
    def _builds(self) -> RubricParams:
        self.rubric()  # its ValueError names what is wrong
        if self.judge.url is None and any(j.verdict == "logprobs" for j in self.judged):
            raise ValueError("a logprobs verdict needs judge.url: the engines' token API "
                             "returns no top logprobs")
        if self.judge.url is not None and any(j.agent is not None for j in self.judged):
            raise ValueError("an agentic judge runs on the engines (treadle's agent loop), "
                             "not on judge.url")
        return self

    def rubric(self) -> Rubric:
        return Rubric(
            verified=tuple(VerifiedDimension(v.name, v.weight, v.metric, v.gate)
                           for v in self.verified),
            judged=tuple(JudgedDimension(j.name, j.weight, j.template, Scale(*j.scale),
                                         VerdictKind(j.verdict), j.optional,
                                         None if j.agent is None else AgentSpec(
                                             tuple(j.agent.tools), j.agent.max_turns,
                                             j.agent.max_total_tokens,
                                             j.agent.max_tokens_per_turn))
                         for j in self.judged),
            gated_reward=self.gated_reward)
