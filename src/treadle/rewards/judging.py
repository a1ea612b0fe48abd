"""Asking judges: each judged dimension of a trajectory, through a `JudgeLane`.

    judges = Judges(lane, attempts=3, timeout_s=120.0)
    traj = await judges.judge(rubric, traj, JudgeInput(task, answer, conversation))

`Judges.judge` fills a scored trajectory's reward vector (`Trajectory.rewards`), its
`judgements` and its scalar reward (`rubric.aggregate`, source RUBRIC); the judged
dimensions are asked at once, each:

- rendered (`JudgedDimension.render`) and looked up in the cache by the content
  hash of what decides the answer (the lane's identity, the prompt, how it is
  read); a hit is used as is (`Judgement.cached`, no call);
- asked — its reply decoded under the verdict's JSON schema where the lane can; an
  agentic dimension (`rubric.AgentSpec`) runs as an agent through the lane
  (`AgentJudgeLane.ask_agent`), in a sandbox holding `JudgeInput.files`, its verdict
  read from its final answer — up to `attempts` times: a call that raises
  `JudgeCallError`, takes longer than `timeout_s` (seconds of `clock`) or answers
  without a verdict on the scale (`VerdictError`) is asked again; after the last,
  the dimension is FAILED, its value None, its reason every attempt's error, and —
  unless the rubric marks it optional — the trajectory is flagged
  (`Trajectory.flagged`) and unscored. Never a 0, never a default score.

A trajectory without a reward (an infrastructure failure, an abort, one its suite
did not score) is returned untouched: there is nothing to add to. A gate not passed
skips the judges (`rubric.Rubric.gate_failed`). Only answers with a verdict are
cached (bounded, least recently used first out), so a failure is asked again next
time. Limits: one process's cache; the lane's own retries (if any) come on top.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from treadle.clock import Clock, WallClock
from treadle.rewards.errors import JudgeCallError, JudgeError
from treadle.rewards.rubric import (
    AgentSpec,
    JudgedDimension,
    JudgeInput,
    Rubric,
    VerdictKind,
    aggregate,
)
from treadle.rewards.verdict import (
    Verdict,
    expected_score,
    parse_json_verdict,
    verdict_schema,
)
from treadle.types import Judgement, JudgementStatus, RewardSource, Trajectory

TOP_LOGPROBS = 20  # alternatives asked per position for a logprob verdict


@dataclass(frozen=True, slots=True)
class JudgeReply:
    """What a judge answered to one prompt."""

    text: str
    tokens: list[str] = field(default_factory=list)  # the reply's tokens as text
    # Each position's top alternatives, text -> logprob (asked for logprob verdicts).
    top: list[dict[str, float]] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)  # token-level lanes only
    logprobs: list[float] = field(default_factory=list)  # one per output id
    # Where the verdict is read, when not `text`: an agentic judge's final answer
    # (its `text` is the whole episode after the prompt, kept for audit).
    verdict_text: str | None = None


class JudgeLane(Protocol):
    """Where judge calls go: the policy's engines, a frozen pool, an endpoint."""

    @property
    def identity(self) -> str:
        """What decides its answers besides the prompt (lane, model, sampling): part
        of the cache key, and the judgement's `judge`."""
        ...

    async def ask(self, prompt: str, *, call_id: str, top_logprobs: int,
                  schema: Mapping[str, Any]) -> JudgeReply:
        """One judge call on `prompt` (`call_id`: unique per call, a request id); the
        top `top_logprobs` alternatives per position when it is above 0; the reply
        decoded under the JSON `schema` (`verdict.verdict_schema`). Raises
        JudgeCallError when the call fails."""
        ...


@runtime_checkable
class AgentJudgeLane(JudgeLane, Protocol):
    """A lane that also runs agentic judges (`rubric.AgentSpec`): the engines'."""

    async def ask_agent(self, prompt: str, *, call_id: str, spec: AgentSpec,
                        files: Mapping[str, str],
                        read: Callable[[str], float]) -> JudgeReply:
        """One agentic judgement: an agent whose task is `prompt`, with `spec`'s tools
        and limits, in a sandbox holding `files`; `read` gives the verdict's value
        of its final answer (raising VerdictError when it holds none: the episode's
        own score). Returns the episode (`JudgeReply.verdict_text`: the final
        answer, with or without a verdict). Raises JudgeCallError when the episode
        fails."""
        ...


@dataclass(frozen=True, slots=True)
class _Answer:
    verdict: Verdict
    reply: JudgeReply


class JudgeCache:
    """Verdicts by content hash, the most recently used kept (module docstring)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._answers: collections.OrderedDict[str, _Answer] = collections.OrderedDict()
        self.hits = 0

    def get(self, key: str) -> _Answer | None:
        answer = self._answers.get(key)
        if answer is not None:
            self._answers.move_to_end(key)
            self.hits += 1
        return answer

    def put(self, key: str, answer: _Answer) -> None:
        self._answers[key] = answer
        self._answers.move_to_end(key)
        while len(self._answers) > self.size:
            self._answers.popitem(last=False)


def content_key(identity: str, dimension: JudgedDimension, prompt: str,
                files: Mapping[str, str] | None = None) -> str:
    """The cache key of one judge question (an agentic judge's: with its spec and the
    work tree it is given)."""
    parts = [identity, dimension.verdict.value, str(dimension.scale.low),
             str(dimension.scale.high), prompt]
    if dimension.agent is not None:
        parts.append(dimension.agent.identity)
        parts.extend(f"{path}\x01{text}" for path, text in sorted((files or {}).items()))
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


class Judges:
    """Judges trajectories through one lane (module docstring)."""

    def __init__(self, lane: JudgeLane, *, attempts: int = 3, timeout_s: float | None = 120.0,
                 clock: Clock | None = None, cache: JudgeCache | None = None) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.lane = lane
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.clock: Clock = clock or WallClock()
        self.cache = cache if cache is not None else JudgeCache()
        self.calls = 0  # judge calls made

    async def judge(self, rubric: Rubric, traj: Trajectory, seen: JudgeInput) -> Trajectory:
        """`traj` with its reward vector, judgements and reward (module docstring)."""
        if traj.reward is None:
            return traj
        measured = rubric.measured(traj.reward, traj.metrics)
        gate = rubric.gate_failed(measured)
        if gate is not None:
            judgements = [self._skipped(d, gate) for d in rubric.judged]
        else:
            judgements = list(await asyncio.gather(
                *(self._one(d, traj.trajectory_id, seen) for d in rubric.judged)))
        traj.judgements = judgements
        traj.rewards = {**measured, **{j.dimension: j.value for j in judgements}}
        traj.reward = aggregate(rubric, measured, judgements)
        traj.reward_source = None if traj.reward is None else RewardSource.RUBRIC
        return traj

    def _skipped(self, d: JudgedDimension, why: str) -> Judgement:
        return Judgement(d.name, JudgementStatus.SKIPPED, None, None, f"not judged: {why}",
                         d.optional, self.lane.identity, 0, False, "", "")

    async def _one(self, d: JudgedDimension, traj_id: str, seen: JudgeInput) -> Judgement:
        prompt = d.render(seen)
        key = content_key(self.lane.identity, d, prompt, seen.files)
        cached = self.cache.get(key)
        if cached is not None:
            return self._judged(d, prompt, cached, attempts=0, cached=True)
        errors: list[str] = []
        reply: JudgeReply | None = None
        for attempt in range(self.attempts):
            try:
                self.calls += 1
                async with self.clock.timeout(self.timeout_s):
                    reply = await self._ask(d, prompt, f"{traj_id}/judge/{d.name}/{attempt}",
                                            seen)
                answer = _Answer(_verdict(d, reply), reply)
            except TimeoutError:
                errors.append(f"attempt {attempt + 1}: no answer within {self.timeout_s} s")
                continue
            except JudgeError as e:
                errors.append(f"attempt {attempt + 1}: {type(e).__name__}: {e}")
                continue
            self.cache.put(key, answer)
            return self._judged(d, prompt, answer, attempts=attempt + 1, cached=False)
        return Judgement(d.name, JudgementStatus.FAILED, None, None,
                         "judge failed: " + "; ".join(errors), d.optional, self.lane.identity,
                         self.attempts, False, prompt, reply.text if reply else "",
                         list(reply.output_ids) if reply else [],
                         list(reply.logprobs) if reply else [])

    async def _ask(self, d: JudgedDimension, prompt: str, call_id: str,
                   seen: JudgeInput) -> JudgeReply:
        if d.agent is None:
            return await self.lane.ask(
                prompt, call_id=call_id,
                top_logprobs=TOP_LOGPROBS if d.verdict is VerdictKind.LOGPROBS else 0,
                schema=verdict_schema(d.scale))
        if not isinstance(self.lane, AgentJudgeLane):
            raise JudgeCallError(f"{self.lane.identity}: runs no agentic judge (the "
                                 "engines' lanes do)")
        return await self.lane.ask_agent(
            prompt, call_id=call_id, spec=d.agent, files=seen.files,
            read=lambda text: d.scale.value(parse_json_verdict(text, d.scale).score))

    def _judged(self, d: JudgedDimension, prompt: str, answer: _Answer, *, attempts: int,
                cached: bool) -> Judgement:
        reply = answer.reply
        return Judgement(d.name, JudgementStatus.JUDGED, d.scale.value(answer.verdict.score),
                         answer.verdict.score, answer.verdict.reason, d.optional,
                         self.lane.identity, attempts, cached, prompt, reply.text,
                         list(reply.output_ids), list(reply.logprobs))


def _verdict(d: JudgedDimension, reply: JudgeReply) -> Verdict:
    if d.verdict is VerdictKind.JSON:
        text = reply.text if reply.verdict_text is None else reply.verdict_text
        return parse_json_verdict(text, d.scale)
    found = expected_score(reply.tokens, reply.top, d.scale)
    return Verdict(found.score, f"expected score at reply token {found.position} "
                                f"(scale mass {found.mass:.3f})")


def conversation_text(messages: Sequence[tuple[str, str]]) -> str:
    """A conversation as plain text for a judge's $trajectory: one block per message,
    headed by its role."""
    return "\n\n".join(f"[{role}]\n{text}" for role, text in messages)
