"""treadle's agent loop: one trajectory, prompt then (reply, tools, observation)*.

    runner = EngineTurns(engine)                       # or the runtime's scheduled turns
    async with open_episode(suite, task, sandboxes) as episode:
        traj = await run_agent(episode, tokenizer, runner, traj_id="t0",
                               key=GroupKey(task.task_id, 0))

The loop is one driver of a `agent.conversation.Conversation` (the harness
gateway's sessions are the other): the token context, the record and the runner's
events are the conversation's. The loop adds the agent's rules only:

- the **prompt**: the task's prompt as messages (a text is one user message; chat
  messages must have roles system/user/assistant, a system message first) with the
  episode's initial observation after it, rendered by the chat format with the
  suite's tools;
- a **reply**: the engine's ids, parsed by the format for tool calls; the calls run
  in written order, a malformed one shown to the model as ``[error] ...``;
- an **observation**: the tool results as ``tool`` messages, appended (mask 0) —
  nothing is ever decoded and encoded again, so the record is exactly the token
  sequence the engine saw and `loss_mask` covers exactly the tokens it sampled.

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
ERROR                  an infrastructure failure, with `failure_stage`: ``init`` (the
                       task's prompt cannot be rendered), ``engine`` (`EngineError`
                       from the runner), ``tool`` (a tool's infrastructure raised),
                       ``eval`` (the reward raised), ``runtime`` (anything else: a
                       bug, reported, not raised)
=====================  ==============================================================

Every status but ERROR is scored by the suite's reward on the last reply's text
(after any reasoning block): a wrong, cut or missing answer is data for the
trainer. ERROR carries no reward. Malformed tool calls, unknown tools and bad
arguments are observations for the model, never errors. Cancelling the coroutine
cancels the turn or tool in flight and propagates (the caller records the
trajectory as aborted). Limits are checked before every turn and every
observation, so no context ever exceeds ``max_total_tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.agent.chat import DEFAULT_FORMAT, CallError, Message, ParsedReply, prompt_messages
from treadle.agent.chat import chat_format as _chat_format
from treadle.agent.context import Begun
from treadle.agent.conversation import Conversation
from treadle.agent.journal import JournaledTurn, ReplayingRunner, Resume, TurnJournal
from treadle.agent.runner import DEFAULT_SAMPLING, Sampling, TurnOutput, TurnRunner
from treadle.agent.tokenizer import Tokenizer
from treadle.clock import MONOTONIC, Clock
from treadle.engines.errors import EngineError
from treadle.envs.base import Episode
from treadle.envs.tools.base import ToolRecord
from treadle.errors import TreadleError
from treadle.types import (
    FailureStage,
    GroupKey,
    RewardSource,
    ToolCall,
    Trajectory,
    TrajectoryStatus,
    Turn,
)

log = logging.getLogger(__name__)


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


class _Stop(Exception):
    """Ends the loop with a status (internal)."""

    def __init__(self, status: TrajectoryStatus, reason: str | None = None,
                 stage: FailureStage | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.stage = status, reason, stage


async def run_agent(episode: Episode, tokenizer: Tokenizer, runner: TurnRunner, *,
                    traj_id: str, key: GroupKey, limits: AgentLimits = AgentLimits(),
                    sampling: Sampling = DEFAULT_SAMPLING, chat_format: str = DEFAULT_FORMAT,
                    clock: Clock = MONOTONIC, journal: TurnJournal | None = None,
                    resume: Resume | None = None) -> Trajectory:
    """Run the episode to its end and score it; see the module docstring.

    `episode` must be started (its initial observation, if any, is shown after the
    task's prompt). `chat_format` names the model family's format (`agent.chat`;
    ValueError for an unknown one). The deadline, the tool gaps and the start and
    finish times are on `clock` (the runtime passes its own). Each completed turn
    goes to `journal`; `resume` (a restarted attempt's) replays the turns it keeps
    first (`agent.journal`). Returns the trajectory; raises only `CancelledError`.
    """
    fmt = _chat_format(chat_format)
    task = episode.task
    traj = Trajectory(traj_id, key, task_id=task.task_id, status=TrajectoryStatus.RUNNING)
    if resume is not None:
        runner = ReplayingRunner(runner, [t.output for t in resume.turns])
        episode.replay(resume.calls)
        traj.resumed = list(resume.resumed)
    conv = Conversation(traj, tokenizer, fmt, runner, clock)
    journaling = None if journal is None else _Journaling(
        journal, 0 if resume is None else len(resume.turns))
    deadline = None if limits.deadline_s is None else clock.now() + limits.deadline_s
    answers: list[str] = []  # each reply's text: the last one is scored
    try:
        prompt = prompt_messages(_with_observation(task.prompt, episode.initial_observation))
    except ValueError as e:
        # A task whose prompt the chat format cannot render (an unknown role, a
        # system message mid-conversation) is a failure of the task's setup, not of
        # the policy: excluded, and attributed.
        reason = f"init: the task's prompt cannot be rendered: {e}"
        conv.ended(reason)
        return conv.finish(TrajectoryStatus.ERROR, reason, FailureStage.INIT)
    stop = _Stop(TrajectoryStatus.RUNNING)
    try:
        await _turns(episode, conv, prompt, limits, sampling, deadline, answers, journaling)
    except _Stop as s:
        stop = s
    except asyncio.CancelledError:
        conv.ended("cancelled")
        raise
    except Exception as e:  # a bug must not take the trajectory's siblings down
        log.exception("trajectory %s failed inside the agent loop", traj_id)
        stop = _Stop(TrajectoryStatus.ERROR, f"agent loop: {type(e).__name__}: {e}",
                     FailureStage.RUNTIME)
    conv.ended(stop.reason or stop.status.value)
    if stop.status is not TrajectoryStatus.ERROR:
        stop = await _score(episode, traj, answers[-1] if answers else None, stop)
    return conv.finish(stop.status, stop.reason, stop.stage)


@dataclass(frozen=True, slots=True)
class _Journaling:
    journal: TurnJournal
    replayed: int  # turns a resume replays (already in the journal)

    def sampled(self, index: int, out: TurnOutput) -> None:
        if index >= self.replayed:
            self.journal.sampled(len(out.output_ids))

    def turn(self, index: int, out: TurnOutput, calls: Sequence[ToolRecord]) -> None:
        if index >= self.replayed:
            self.journal.turn(JournaledTurn(index, out, tuple(calls)))


async def _turns(episode: Episode, conv: Conversation, prompt: list[Message],
                 limits: AgentLimits, sampling: Sampling, deadline: float | None,
                 answers: list[str], journaling: _Journaling | None) -> None:
    traj, clock, tools = conv.trajectory, conv.clock, episode.tool_specs
    begun = conv.begin(prompt, tools)
    if len(begun.prompt_ids) >= limits.max_total_tokens:
        raise _Stop(TrajectoryStatus.TRUNCATED, "max_total_tokens")
    for index in range(limits.max_turns):
        budget = min(limits.max_tokens_per_turn, limits.max_total_tokens - len(begun.prompt_ids))
        try:
            async with clock.timeout(_left(deadline, clock)):
                out = await conv.generate(begun.prompt_ids, budget, sampling.for_turn(
                    traj.task_id, traj.key.repetition, index))
        except TimeoutError:
            raise _Stop(TrajectoryStatus.TIMEOUT, "deadline") from None
        except EngineError as e:
            raise _Stop(TrajectoryStatus.ERROR, f"engine: {e}", FailureStage.ENGINE) from None
        reply = conv.fmt.reply(conv.decode(out.output_ids))
        turn = conv.record_reply(out, reply)
        if journaling is not None:
            journaling.sampled(index, out)
        answers.append(reply.text)
        cut = _cut_reason(out, budget, limits)
        if cut is not None or not reply.wants_tools:
            conv.turn_finished(final=True)
            raise _Stop(TrajectoryStatus.TRUNCATED, cut) if cut is not None \
                else _Stop(TrajectoryStatus.COMPLETED)
        conv.turn_finished(final=False)
        conv.tool_started()
        first_call = len(episode.history)
        try:
            async with clock.timeout(_left(deadline, clock)):
                results = await _call_tools(episode, reply, turn)
        except TimeoutError:
            raise _Stop(TrajectoryStatus.TIMEOUT, "deadline") from None
        except TreadleError as e:
            raise _Stop(TrajectoryStatus.ERROR, f"tool: {type(e).__name__}: {e}",
                        FailureStage.TOOL) from None
        end = _after_tools(episode, conv, results, tools, index, limits)
        if isinstance(end, _Stop):  # the observation is never shown: it is not in the record
            conv.tool_finished(None, final=True)
            raise end
        begun = end
        conv.tool_finished(begun, final=False)
        if journaling is not None:
            journaling.turn(index, out, episode.history[first_call:])


def _after_tools(episode: Episode, conv: Conversation, results: list[str],
                 tools: Sequence[Mapping[str, Any]], index: int,
                 limits: AgentLimits) -> Begun | _Stop:
    """The observation appended (its `Begun`), or the `_Stop` that ends the episode
    before it is shown."""
    if episode.done:
        return _Stop(TrajectoryStatus.COMPLETED)
    begun = conv.begin([*conv.context.history, *tool_messages(results)], tools)
    if len(begun.prompt_ids) >= limits.max_total_tokens:
        conv.take_back()
        return _Stop(TrajectoryStatus.TRUNCATED, "max_total_tokens")
    if index + 1 == limits.max_turns:
        conv.take_back()
        return _Stop(TrajectoryStatus.MAX_TURNS, "max_turns")
    return begun


def _cut_reason(out: TurnOutput, budget: int, limits: AgentLimits) -> str | None:
    if out.finish_reason != "length":
        return None
    return "max_tokens_per_turn" if budget == limits.max_tokens_per_turn else "max_total_tokens"


async def _call_tools(episode: Episode, reply: ParsedReply, turn: Turn) -> list[str]:
    """Run the reply's calls in order; the observation text of each."""
    results: list[str] = []
    for call in reply.parts:
        if isinstance(call, CallError):
            results.append(f"[error] {call.message}")
            record = ToolCall("", {"_raw": call.raw}, error=call.message)
        else:
            arguments = call.parsed_arguments()
            result = await episode.call(call.name, arguments)
            results.append(result.observation())
            record = result.to_tool_call(call.name, arguments)
        # One record per turn: the scheduler sees one tool gap; extra calls of the same
        # reply are folded into the first record's latency.
        if turn.tool_call is None:
            turn.tool_call = record
        else:
            turn.tool_call.latency_s += record.latency_s
        if episode.done:
            break  # calls after the one that ended the episode are not run
    return results


async def _score(episode: Episode, traj: Trajectory, answer: str | None, stop: _Stop) -> _Stop:
    """The suite's reward on the final answer; an eval failure when it raises."""
    try:
        result = await episode.score(answer)
    except TreadleError as e:
        return _Stop(TrajectoryStatus.ERROR, f"eval: {type(e).__name__}: {e}", FailureStage.EVAL)
    traj.reward = result.reward
    traj.reward_source = RewardSource.VERIFIER
    traj.metrics = dict(result.metrics)
    return stop


def tool_messages(results: Sequence[str]) -> list[Message]:
    """Tool results as the messages the loop shows the model (one ``tool`` message each)."""
    return [Message("tool", r) for r in results]


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


__all__ = ["AgentLimits", "run_agent", "tool_messages"]
