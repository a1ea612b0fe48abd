"""Where a trajectory's LLM turns run, and who hears its scheduling events.

`TurnRunner` is the seam between a conversation (`agent.conversation`) and what
runs its turns: the runtime's scheduled turns (`runtime.turns.ScheduledTurns`, on a
pool of engines under the scheduler), or `EngineTurns` on one engine without a
scheduler (single rollouts, evaluation, tests). The conversation tells the runner
its events — a turn's end, a tool call's start and end, the trajectory's end — each
exactly once (`agent.conversation.Conversation` keeps that promise for both doors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from treadle.engines.base import Engine, FinishReason, GenerateRequest, derived_seed
from treadle.engines.errors import EngineError
from treadle.types import OutputConstraint, Turn


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling parameters sent with every turn."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass
    # Base seed: turn t of a trajectory of task `task` (sample `repetition`) samples
    # with seed derived_seed(seed, task, repetition, t), so the same task, sample and
    # policy give the same tokens in any job (evaluations share their random
    # numbers). None: the engine's own randomness.
    seed: int | None = None
    # Decode the reply under this (structured output: a harness's response_format);
    # None: sample freely. A constrained reply is never resumed mid-way (`runtime.turns`).
    constraint: OutputConstraint | None = None

    def for_turn(self, task_id: str, repetition: int, turn: int) -> Sampling:
        """These parameters with the seed of one turn (unchanged when unseeded)."""
        if self.seed is None:
            return self
        return dataclasses.replace(self, seed=derived_seed(self.seed, task_id, repetition,
                                                           turn))


DEFAULT_SAMPLING = Sampling()


@dataclass(frozen=True, slots=True)
class TurnOutput:
    """One reply as the runner got it (possibly over several engine calls, if the
    turn was preempted and resumed: the ids and logprobs are concatenated)."""

    output_ids: list[int]  # sampled ids, the stop token included when sampled
    logprobs: list[float]  # one per output id
    policy_versions: list[int]  # weights version that sampled each output id
    finish_reason: FinishReason  # "stop" or "length" ("abort" never reaches the agent)
    engine_id: str | None = None  # the engine of the last call
    queued_s: float = 0.0  # waiting for an engine, preemptions included
    generating_s: float = 0.0  # inside engine calls

    @property
    def last_version(self) -> int:
        """The policy version of the last sampled token (0 for an empty reply)."""
        return self.policy_versions[-1] if self.policy_versions else 0

    def turn(self, index: int) -> Turn:
        """The trajectory's record of this reply as turn `index`."""
        return Turn(index, len(self.output_ids), self.engine_id, queued_s=self.queued_s,
                    generating_s=self.generating_s, policy_version=self.last_version)


class TurnRunner(Protocol):
    """Where the agent's LLM turns run, and who hears its scheduling events."""

    @property
    def policy_version(self) -> int:
        """The weights version a token sampled now would carry."""
        ...

    async def generate(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling,
                       stop_ids: list[int]) -> TurnOutput:
        """Run one turn on the context `prompt_ids`; raises `EngineError` on failure."""
        ...

    def turn_finished(self, output_tokens: int, context_tokens: int, final: bool) -> None:
        """The reply is in; `final`: no tool call and no turn follow."""
        ...

    def tool_started(self) -> None: ...

    def tool_finished(self, latency_s: float, output_tokens: int, final: bool) -> None:
        """The tools returned; `final`: the trajectory ends here (no turn follows)."""
        ...

    def ended(self, reason: str) -> None:
        """The trajectory stopped between events (deadline, failure, cancel)."""
        ...


class EngineTurns:
    """A `TurnRunner` on one engine, without a scheduler: each turn is one call.

    For single rollouts, evaluation and tests; the runtime's runner schedules turns
    over a pool of engines instead. `policy_version` stamps every sampled token.
    Request ids are ``<request_prefix>-<n>`` (default prefix: unique per runner); a
    fixed prefix makes them reproducible, for engines that seed sampling by id.
    """

    def __init__(self, engine: Engine, *, engine_id: str = "engine", policy_version: int = 0,
                 request_timeout_s: float | None = 600.0,
                 request_prefix: str | None = None) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self.policy_version = policy_version
        self.request_timeout_s = request_timeout_s
        self.request_prefix = request_prefix if request_prefix is not None else f"{id(self):x}"
        self._calls = 0

    async def generate(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling,
                       stop_ids: list[int]) -> TurnOutput:
        self._calls += 1
        result = await self.engine.generate(GenerateRequest(
            request_id=f"{self.request_prefix}-{self._calls}", prompt_ids=prompt_ids,
            max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            seed=sampling.seed, stop_token_ids=stop_ids, timeout_s=self.request_timeout_s,
            constraint=sampling.constraint))
        if result.finish_reason == "abort":
            raise EngineError(f"engine {self.engine_id} aborted the request")
        return TurnOutput(result.output_ids, result.logprobs,
                          [self.policy_version] * len(result.output_ids), result.finish_reason,
                          self.engine_id, result.queued_s or 0.0, result.generating_s)

    def turn_finished(self, output_tokens: int, context_tokens: int, final: bool) -> None:
        pass

    def tool_started(self) -> None:
        pass

    def tool_finished(self, latency_s: float, output_tokens: int, final: bool) -> None:
        pass

    def ended(self, reason: str) -> None:
        pass


__all__ = ["DEFAULT_SAMPLING", "EngineTurns", "Sampling", "TurnOutput", "TurnRunner"]
