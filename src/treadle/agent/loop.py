"""One trajectory, token in and token out: prompt, then (reply, tools, observation)*.

    runner = EngineTurns(engine)                       # or the runtime's scheduled turns
    async with open_episode(suite, task, sandboxes) as episode:
        traj = await run_agent(episode, tokenizer, runner, traj_id="t0",
                               key=GroupKey(task.task_id, 0))

The loop keeps one token list for the whole context and only ever appends to it:

- the **prompt** piece (`HermesFormat.prompt_text`) is tokenized once;
- a **reply** is appended as the engine's output ids, with mask 1 and the engine's
  logprobs and policy version for every id;
- an **observation** piece (`HermesFormat.observation_text` of the tool results) is
  tokenized on its own and appended with mask 0 and logprob 0.0.

Nothing is ever decoded and encoded again: the reply is decoded only to find its
tool calls. The trajectory's `TokenSegment` is therefore exactly the token sequence
the engine saw, and `loss_mask` covers exactly the tokens it sampled.

How a trajectory ends (`Trajectory.status`, `reason`):

=====================  ==============================================================
COMPLETED              a reply with no tool call, or a tool that ended the episode
                       (`submit_answer`)
TRUNCATED              ``max_tokens_per_turn``: a reply cut at the per-turn limit;
                       ``max_total_tokens``: the context is full (a reply cut at the
                       remaining budget, or an observation that does not fit)
MAX_TURNS              ``max_turns`` replies and the model still wants tools
TIMEOUT                ``deadline``: the deadline (on the loop's clock) passed mid-turn
                       or mid-tool
ERROR                  an infrastructure failure, with `failure_stage`: ``engine``
                       (`EngineError` from the runner), ``tool`` (a tool's
                       infrastructure raised), ``eval`` (the reward raised),
                       ``runtime`` (anything else: a bug, reported, not raised)
=====================  ==============================================================

Every status but ERROR is scored by the suite's reward: a wrong, cut or missing
answer is data for the trainer. ERROR carries no reward. Malformed tool calls, unknown
tools and bad arguments are observations for the model, never errors. Cancelling
the coroutine cancels the turn or tool in flight and propagates (the caller records
the trajectory as aborted). Limits are checked before every turn and every
observation, so no context ever exceeds ``max_total_tokens``.

The runner hears the scheduling events of the trajectory (`TurnRunner`): a turn's
end (``final`` when no turn follows), the tool call's start and end, and `ended`
when the trajectory stops without a final turn or final tool (deadline, failure,
cancel).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from treadle.agent.chat import IM_END, CallError, HermesFormat, Reply, Tokenizer
from treadle.clock import MONOTONIC, Clock
from treadle.engines.base import Engine, FinishReason, GenerateRequest, derived_seed
from treadle.engines.errors import EngineError
from treadle.envs.base import Episode
from treadle.errors import TreadleError
from treadle.types import (
    FailureStage,
    GroupKey,
    TokenSegment,
    ToolCall,
    Trajectory,
    TrajectoryStatus,
    Turn,
)

log = logging.getLogger(__name__)
HERMES = HermesFormat()


@dataclass(frozen=True, slots=True)
class AgentLimits:
    """Where a trajectory stops. Each limit ends it with its own status and reason."""

    max_turns: int = 8  # LLM replies at most
    max_total_tokens: int = 4096  # the whole context: prompt, replies and observations
    max_tokens_per_turn: int = 1024  # one reply at most
    deadline_s: float | None = None  # seconds for the whole trajectory, on the loop's clock

    def as_params(self) -> dict[str, Any]:
        """The limits as a job request's `limits` (the service's wire form)."""
        return dataclasses.asdict(self)

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 2 or self.max_tokens_per_turn < 1:
            raise ValueError("max_turns and max_tokens_per_turn must be >= 1 and "
                             "max_total_tokens >= 2")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")


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

    def for_turn(self, task_id: str, repetition: int, turn: int) -> Sampling:
        """These parameters with the seed of one turn (unchanged when unseeded)."""
        if self.seed is None:
            return self
        return dataclasses.replace(self, seed=derived_seed(self.seed, task_id, repetition,
                                                           turn))


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
            seed=sampling.seed, stop_token_ids=stop_ids, timeout_s=self.request_timeout_s))
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


class _Stop(Exception):
    """Ends the loop with a status (internal)."""

    def __init__(self, status: TrajectoryStatus, reason: str | None = None,
                 stage: FailureStage | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.stage = status, reason, stage


@dataclass(slots=True)
class _State:
    traj: Trajectory
    segment: TokenSegment
    context: list[int]  # prompt + everything appended
    final_message: str | None = None  # the last reply's text
    events_done: bool = False  # the runner heard a final turn or final tool


async def run_agent(episode: Episode, tokenizer: Tokenizer, runner: TurnRunner, *,
                    traj_id: str, key: GroupKey, limits: AgentLimits = AgentLimits(),
                    sampling: Sampling = Sampling(), fmt: HermesFormat = HERMES,
                    clock: Clock = MONOTONIC) -> Trajectory:
    """Run the episode to its end and score it; see the module docstring.

    `episode` must be started (its initial observation, if any, is shown after the
    task's prompt). The deadline, the tool latencies and the start and finish times
    are on `clock` (the runtime passes its own). Returns the trajectory; raises only
    `CancelledError`.
    """
    task = episode.task
    start = clock.now()
    traj = Trajectory(traj_id, key, task_id=task.task_id, status=TrajectoryStatus.RUNNING)
    traj.timings.started_at = start
    deadline = None if limits.deadline_s is None else start + limits.deadline_s
    stop_ids = [tokenizer.token_id(IM_END)]
    prompt = _with_observation(task.prompt, episode.initial_observation)
    try:
        prompt_ids = tokenizer.encode(fmt.prompt_text(prompt, episode.tool_specs))
    except ValueError as e:
        # A task whose prompt the chat format cannot render (an unknown role, a
        # system message mid-conversation) is a failure of the task's setup, not of
        # the policy: excluded, and attributed.
        traj.status, traj.failure_stage = TrajectoryStatus.ERROR, FailureStage.INIT
        traj.reason = f"init: the task's prompt cannot be rendered: {e}"
        runner.ended(traj.reason)
        traj.timings.finished_at = clock.now()
        return traj
    state = _State(traj, TokenSegment(prompt_ids=prompt_ids), list(prompt_ids))
    traj.prompt_tokens = len(prompt_ids)
    traj.segments.append(state.segment)
    try:
        if len(prompt_ids) >= limits.max_total_tokens:
            raise _Stop(TrajectoryStatus.TRUNCATED, "max_total_tokens")
        await _turns(episode, tokenizer, runner, state, limits, sampling, fmt, stop_ids,
                     deadline, clock)
    except _Stop as stop:
        traj.status, traj.reason, traj.failure_stage = stop.status, stop.reason, stop.stage
    except asyncio.CancelledError:
        if not state.events_done:
            runner.ended("cancelled")
        raise
    except Exception as e:  # a bug must not take the trajectory's siblings down
        log.exception("trajectory %s failed inside the agent loop", traj_id)
        traj.status, traj.failure_stage = TrajectoryStatus.ERROR, FailureStage.RUNTIME
        traj.reason = f"agent loop: {type(e).__name__}: {e}"
    if not state.events_done:
        runner.ended(traj.reason or traj.status.value)
        state.events_done = True
    if traj.status is not TrajectoryStatus.ERROR:
        await _score(episode, state)
    traj.timings.finished_at = clock.now()
    return traj


async def _turns(episode: Episode, tokenizer: Tokenizer, runner: TurnRunner, state: _State,
                 limits: AgentLimits, sampling: Sampling, fmt: HermesFormat,
                 stop_ids: list[int], deadline: float | None, clock: Clock) -> None:
    traj, context = state.traj, state.context
    for index in range(limits.max_turns):
        room = limits.max_total_tokens - len(context)
        budget = min(limits.max_tokens_per_turn, room)
        try:
            async with clock.timeout(_left(deadline, clock)):
                out = await runner.generate(list(context), budget,
                                            sampling.for_turn(traj.task_id, traj.key.repetition,
                                                              index), stop_ids)
            _append_reply(state, out)  # a malformed reply is the engine's failure
        except TimeoutError:
            raise _Stop(TrajectoryStatus.TIMEOUT, "deadline") from None
        except EngineError as e:
            raise _Stop(TrajectoryStatus.ERROR, f"engine: {e}", FailureStage.ENGINE) from None
        turn = out.turn(index)
        traj.turns.append(turn)
        traj.timings.llm_s += out.generating_s
        traj.timings.queue_s += out.queued_s
        reply = fmt.parse(tokenizer.decode(_strip_stop(out.output_ids, stop_ids)))
        state.final_message = reply.text
        cut = _cut_reason(out, budget, limits)
        if cut is not None or not reply.wants_tools:
            _final_turn(runner, state, out)
            if cut is not None:
                raise _Stop(TrajectoryStatus.TRUNCATED, cut)
            raise _Stop(TrajectoryStatus.COMPLETED)
        runner.turn_finished(len(out.output_ids), len(context), final=False)
        runner.tool_started()
        started = clock.now()
        try:
            async with clock.timeout(_left(deadline, clock)):
                results = await _call_tools(episode, reply, turn)
        except TimeoutError:
            raise _Stop(TrajectoryStatus.TIMEOUT, "deadline") from None
        except TreadleError as e:
            raise _Stop(TrajectoryStatus.ERROR, f"tool: {type(e).__name__}: {e}",
                        FailureStage.TOOL) from None
        latency = clock.now() - started
        traj.timings.tool_s += latency
        obs = tokenizer.encode(fmt.observation_text(results))
        if episode.done:
            end: tuple[TrajectoryStatus, str | None] | None = (TrajectoryStatus.COMPLETED, None)
        elif len(context) + len(obs) >= limits.max_total_tokens:
            end = (TrajectoryStatus.TRUNCATED, "max_total_tokens")
        elif index + 1 == limits.max_turns:
            end = (TrajectoryStatus.MAX_TURNS, "max_turns")
        else:
            end = None
        if end is not None:  # the observation is never shown: it is not in the record
            runner.tool_finished(latency, 0, final=True)
            state.events_done = True
            raise _Stop(*end)
        _append_observation(state, obs, out)
        if turn.tool_call is not None:
            turn.tool_call.output_tokens = len(obs)
        runner.tool_finished(latency, len(obs), final=False)


def _final_turn(runner: TurnRunner, state: _State, out: TurnOutput) -> None:
    runner.turn_finished(len(out.output_ids), len(state.context), final=True)
    state.events_done = True


def _cut_reason(out: TurnOutput, budget: int, limits: AgentLimits) -> str | None:
    if out.finish_reason != "length":
        return None
    return "max_tokens_per_turn" if budget == limits.max_tokens_per_turn else "max_total_tokens"


async def _call_tools(episode: Episode, reply: Reply, turn: Turn) -> list[str]:
    """Run the reply's calls in order; the observation text of each."""
    results: list[str] = []
    for call in reply.calls:
        if isinstance(call, CallError):
            results.append(f"[error] {call.message}")
            record = ToolCall("", {"_raw": call.raw}, error=call.message)
        else:
            result = await episode.call(call.name, call.arguments)
            results.append(result.observation())
            record = result.to_tool_call(call.name, call.arguments)
        # One record per turn: the scheduler sees one tool gap; extra calls of the same
        # reply are folded into the first record's latency.
        if turn.tool_call is None:
            turn.tool_call = record
        else:
            turn.tool_call.latency_s += record.latency_s
        if episode.done:
            break  # calls after the one that ended the episode are not run
    return results


def _append_reply(state: _State, out: TurnOutput) -> None:
    n = len(out.output_ids)
    if len(out.logprobs) != n or len(out.policy_versions) != n:
        raise EngineError(f"runner returned {n} ids but {len(out.logprobs)} logprobs and "
                          f"{len(out.policy_versions)} versions")
    seg = state.segment
    state.context.extend(out.output_ids)
    seg.response_ids.extend(out.output_ids)
    seg.loss_mask.extend([1] * n)
    seg.logprobs.extend(out.logprobs)
    seg.policy_versions.extend(out.policy_versions)


def _append_observation(state: _State, ids: list[int], after: TurnOutput) -> None:
    # Observation tokens carry the version of the reply they answer (not trained on).
    version = after.last_version
    seg = state.segment
    state.context.extend(ids)
    seg.response_ids.extend(ids)
    seg.loss_mask.extend([0] * len(ids))
    seg.logprobs.extend([0.0] * len(ids))
    seg.policy_versions.extend([version] * len(ids))


async def _score(episode: Episode, state: _State) -> None:
    traj = state.traj
    try:
        result = await episode.score(state.final_message)
    except TreadleError as e:
        traj.status, traj.failure_stage = TrajectoryStatus.ERROR, FailureStage.EVAL
        traj.reason = f"eval: {type(e).__name__}: {e}"
        return
    traj.reward = result.reward
    traj.metrics = dict(result.metrics)


def _strip_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> Sequence[int]:
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


def _left(deadline: float | None, clock: Clock) -> float | None:
    if deadline is None:
        return None
    return max(0.0, deadline - clock.now())


def _with_observation(prompt: str | list[dict[str, object]],
                      observation: str | None) -> str | list[dict[str, object]]:
    """The task's prompt with the episode's initial observation (setup output) after it."""
    if not observation:
        return prompt
    if isinstance(prompt, str):
        return f"{prompt}\n\n{observation}"
    return [*prompt, {"role": "user", "content": observation}]


__all__ = ["AgentLimits", "EngineTurns", "Sampling", "TurnOutput", "TurnRunner", "run_agent"]
