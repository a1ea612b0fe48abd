"""A session: a harness's chat calls, run as one trajectory's scheduled turns.

    session = sessions.create(SessionSpec(...))      # gateway.sessions.Sessions
    result = await session.call(CallRequest(messages=[...], tools=[...]))
    traj = await sessions.end(session.spec.session_id, reward=1.0)

A session is a trajectory to the scheduler (`runtime.turns`): each call is a turn,
and the time from a reply to the next call is its tool gap (`tool_started` when a
reply is returned, `tool_finished` when the next call comes), so priority,
placement, prefix-cache affinity and migration in tool gaps apply as for treadle's
own agents; the gateway adds no scheduling of its own. The token context, the
record and the scheduler's events are the session's `agent.conversation.Conversation`,
the same room treadle's own agent loop drives.

What ends a session, and its status:

================  =============================================================
the owner         `end` (POST /v1/sessions/{id}/end): completed unless it says
idle timeout      no call for `idle_timeout_s` (from creation or the last reply):
                  timeout, reason ``idle_timeout``
an engine failure the call answers 503; error, stage engine
a context the     the call answers 400 (context_length_exceeded); truncated,
engine refuses    reason ``engine refused: ...``
its parent        a sub-agent still open when its parent ends: aborted
================  =============================================================

A session that ends before any call was served is no trajectory of the policy (no
token, no outcome): however it ended, it is stored as an error, stage harness,
without a reward (`no_call_served`, where its trajectory is handed to the store).

Limits (`SessionLimits`): a call past ``max_turns`` is refused (`SessionLimit`,
the session stays open for its owner to end); a reply is cut at the room left
under ``max_total_tokens`` (finish_reason length, whatever the reply holds), and a
call whose context already fills it is refused naming the limit.

Structured output: a call's ``constraint`` (its response_format) goes to the engine,
which decodes the reply under it; the turn records it. Refused (400 naming
response_format): with tools the model may call, on engines without that kind
(`EngineCapabilities.constraints`), or when the engine refuses the format itself
(the session then stays open).

Sub-agents (PARL): a session created with a parent is its child; the parent's
record lists its children. A child that ends before its parent without a reward
of its own waits for the parent and takes the parent's reward (the credit rule),
then both are handed to `on_end`. A frozen child (`trainable` false) has every
token at mask 0.

Not thread-safe: one event loop. Calls of one session are serialised by refusal
(`SessionBusy`), never queued.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from treadle.agent.chat import Message, ParsedReply, ToolChoice, chat_format
from treadle.agent.conversation import Conversation
from treadle.agent.journal import ReplayingRunner
from treadle.agent.runner import Sampling, TurnOutput, TurnRunner
from treadle.agent.tokenizer import Tokenizer
from treadle.clock import Clock
from treadle.engines.errors import EngineError, EngineRequestError
from treadle.gateway.errors import (
    ContextTooLong,
    GatewayEngineError,
    GatewayError,
    GatewayInternalError,
    InvalidRequest,
    SessionBusy,
    SessionEnded,
    SessionLimit,
)
from treadle.runtime.contract import TrajectoryHost
from treadle.runtime.driver import Runtime
from treadle.types import (
    FailureStage,
    GroupKey,
    KVAcrossUpdates,
    OutputConstraint,
    ToolCall,
    Trajectory,
    TrajectoryStatus,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """Where a session stops taking calls."""

    max_turns: int = 64  # calls (replies) at most
    max_total_tokens: int = 4096  # a segment's context: prompt, replies and new messages
    max_tokens_per_turn: int = 1024  # one reply at most (a call may ask for fewer)
    idle_timeout_s: float = 600.0  # no call this long (real seconds): the session times out


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """What a session is, fixed at its creation."""

    session_id: str  # the id in its URL
    trajectory_id: str  # its trajectory's id in the store
    job_id: str  # the job whose stream delivers it
    key: GroupKey  # its GRPO group and repetition
    task_id: str  # the task it samples
    sampling: Sampling = field(default_factory=Sampling)  # each call's defaults
    limits: SessionLimits = field(default_factory=SessionLimits)
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the caller's, kept in the record
    parent_id: str | None = None  # the parent's session id, for a sub-agent
    trainable: bool = True  # False: a frozen sub-agent, every token at mask 0
    chat_format: str = "hermes"  # the model family's chat format (`agent.chat.chat_format`)
    swept: bool = True  # ends at its idle timeout (False: its owner always ends it)
    engine_pool: str = "policy"  # the runtime serving its calls: policy | frozen
    # What its calls after a weight update do with KV cached before it (recorded).
    kv_across_updates: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE
    max_staleness: int | None = None  # a continuous job's bound, for the scheduler


@dataclass(frozen=True, slots=True)
class CallRequest:
    """One chat call, as the wire layer validated it."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)  # function specs as sent
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    max_tokens: int | None = None  # the call's own cap on the reply
    temperature: float | None = None  # None: the session's
    top_p: float | None = None
    seed: int | None = None  # None: the session's seed, derived per turn
    stop: tuple[str, ...] = ()  # strings that end the reply (cut after sampling)
    one_call: bool = False  # parallel_tool_calls false: cut the reply after its first call
    # response_format json_object / json_schema: the reply is decoded under it by the
    # engine (structured output); None: sampled freely.
    constraint: OutputConstraint | None = None


@dataclass(frozen=True, slots=True)
class CallResult:
    """One call's reply and what it cost."""

    reply: ParsedReply
    finish_reason: str  # stop | tool_calls | length
    output_ids: list[int]  # the sampled ids kept (a stop string's tail cut off)
    logprobs: list[float]  # one per kept id
    prompt_tokens: int  # the context the engine was sent
    turn: int  # the reply's turn index in the session
    output: TurnOutput  # the runner's whole reply (what a journal keeps to replay it)


class Session:
    """One session's state; made by `Sessions.create`. Its conversation
    (`agent.conversation`) holds the token context, the record and the scheduler's
    events; the session adds the harness protocol: one call at a time (a retry of
    the running call gets its answer), the limits, forced prefixes, stop strings."""

    def __init__(self, spec: SessionSpec, runtime: Runtime, tokenizer: Tokenizer,
                 clock: Clock, *, replay: Sequence[TurnOutput] = (),
                 turns: TrajectoryHost | None = None) -> None:
        self.spec = spec
        self.fmt = chat_format(spec.chat_format)
        self.tokenizer = tokenizer
        self._runtime = runtime  # its engines say what structured output they serve
        self._clock = clock
        self.trajectory = Trajectory(
            spec.trajectory_id, spec.key, task_id=spec.task_id,
            status=TrajectoryStatus.RUNNING, trainable=spec.trainable, metadata=dict(spec.metadata),
            kv_across_updates=spec.kv_across_updates)
        # Timings on the runtime's clock (the scheduler's, modelled seconds with emulated
        # engines), as treadle's own trajectories have them; idleness on `clock`.
        # A session opened again after a restart answers its first calls (the journal's,
        # replayed by its owner) with their recorded replies (`agent.journal`).
        # Its runner: the runtime's, or one in a runner actor (`turns`: the service's
        # runner actors, whose turns the runtime schedules all the same).
        runner: TurnRunner = (turns or runtime).turns(spec.trajectory_id, spec.key.group_id,
                                                      spec.kv_across_updates,
                                                      max_staleness=spec.max_staleness)
        if replay:
            runner = ReplayingRunner(runner, replay)
        self.conversation = Conversation(self.trajectory, tokenizer, self.fmt, runner,
                                         runtime.clock, trainable=spec.trainable)
        self.children: list[Session] = []
        self.reserved_children = 0  # child slots handed out (before their sessions exist)
        self.last_active = clock.now()  # creation, or the end of the last call
        self.busy = False
        self.ended = False
        self.cut = False  # a call was cut mid-turn: no further call can run
        self._call_task: asyncio.Task[object] | None = None  # the call in flight
        # The call in flight's request and its answer, for a client's retry of it.
        self._running: tuple[CallRequest, asyncio.Future[CallResult]] | None = None
        self.final_text: str | None = None  # the last reply's content
        self.final_answer: str | None = None  # what a harness run wrote as its answer
        # Tools the gateway serves the harness (`gateway.tools`): one runs now (no chat
        # call may), and the turns whose ToolCall records what ran (its own latency).
        self.in_tool_call = False
        self.tools_ran: set[int] = set()

    @property
    def segments(self) -> int:
        """Token segments so far."""
        return len(self.conversation.context.segments)

    async def call(self, request: CallRequest) -> CallResult:
        """Run one call; the errors of `gateway.errors` for what cannot run."""
        if self.ended or self.cut:
            raise SessionEnded(f"session {self.spec.session_id} has ended "
                               f"({self.trajectory.status.value})")
        if self.in_tool_call:
            raise SessionBusy(f"session {self.spec.session_id} is running a tool call; call "
                              "the model after it")
        if self.busy:
            running = self._running
            if running is not None and running[0] == request:
                # The same request again while it runs: a client that timed out and
                # retried. It gets the running call's answer (never a second reply).
                return await asyncio.shield(running[1])
            raise SessionBusy(f"session {self.spec.session_id} is running a call; a harness "
                              "that runs calls in parallel on one context needs a session "
                              "for each (parent_session_id)")
        self.busy = True
        self._call_task = asyncio.current_task()
        answer: asyncio.Future[CallResult] = asyncio.get_running_loop().create_future()
        # Retrieved whether or not a retry waits on it (no "never retrieved" warning).
        answer.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._running = (request, answer)
        try:
            result = await self._guarded(request)
            answer.set_result(result)
            return result
        except BaseException as e:
            if not answer.done():
                if isinstance(e, asyncio.CancelledError):
                    answer.cancel()
                else:
                    answer.set_exception(e)
            raise
        finally:
            self._running = None

    async def _guarded(self, request: CallRequest) -> CallResult:
        """`_call`, its failures turned into the session's end (see `call`)."""
        try:
            return await self._call(request)
        except asyncio.CancelledError:
            # The turn was cut mid-flight (the session was ended, its harness is gone, or
            # the service is closing): its scheduler state cannot be resumed, so no
            # further call may run on it.
            self.cut = True
            raise
        except GatewayError:
            raise
        except Exception as e:  # a bug must not wedge the session: it ends, attributed
            log.exception("session %s: a call failed in the gateway", self.spec.session_id)
            self.conversation.take_back()
            self.finish(TrajectoryStatus.ERROR, f"runtime: {type(e).__name__}: {e}",
                        FailureStage.RUNTIME)
            raise GatewayInternalError(f"the gateway failed the call: {type(e).__name__}"
                                       ) from None
        finally:
            self.busy = False
            self._call_task = None
            self.last_active = self._clock.now()
            if self.ended or self.cut:
                self._tell_ended()

    async def interrupt(self) -> None:
        """Cut the call in flight, if any, and wait until it has stopped (its harness
        is gone). The session stays open for its owner to end; it takes no more calls."""
        task = self._call_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait({task})

    async def _call(self, request: CallRequest) -> CallResult:
        limits, conv = self.spec.limits, self.conversation
        self._check_constraint(request)
        forced = self.fmt.forced_prefix(request.tool_choice)
        begun = conv.begin(request.messages, request.tools, forced=forced)
        turn = conv.turns
        self.tools_ran.discard(turn)  # (a retried reply's, taken back with it)
        if turn >= limits.max_turns:
            conv.take_back()
            raise SessionLimit(f"the session has had its max_turns ({limits.max_turns}) "
                               "calls; end it", param="max_turns")
        room = limits.max_total_tokens - len(begun.prompt_ids)
        if room <= 0:
            conv.take_back()
            raise SessionLimit(f"the context ({len(begun.prompt_ids)} tokens) fills the "
                               f"session's max_total_tokens ({limits.max_total_tokens})",
                               param="max_total_tokens")
        budget = min(limits.max_tokens_per_turn, request.max_tokens or room, room)
        if conv.in_tool:
            # The harness's next call ends the tool gap its last reply opened: the gap
            # is all the gateway knows of the harness's tools.
            gap = conv.tool_finished(begun, final=False)
            last = self.trajectory.turns[-1] if self.trajectory.turns else None
            if last is not None and last.tool_call is not None and \
                    last.index not in self.tools_ran:
                last.tool_call.latency_s = gap
        out = await self._generate(request, begun.prompt_ids, budget, turn)
        ids, logprobs, cut = self._stopped(out, request.stop, forced,
                                           self.fmt.call_end if request.one_call else None)
        text = forced + conv.decode(ids)
        if cut is not None:
            text = text[:cut]
        reply = self.fmt.reply(text, request.tool_choice)
        record = conv.record_reply(out, reply, kept=len(ids))
        record.constraint = request.constraint
        if reply.calls:
            first = reply.calls[0]
            record.tool_call = ToolCall(first.name, first.parsed_arguments())
        self.final_text = reply.content
        conv.turn_finished(final=False)
        conv.tool_started()
        # A reply the engine cut (at its token budget: the room under max_total_tokens,
        # max_tokens_per_turn or the call's max_tokens) says length whatever it holds,
        # tool calls included, as OpenAI's does; one that a stop string or the first
        # call cut stopped where the model would have.
        finish = "length" if out.finish_reason == "length" and cut is None else (
            "tool_calls" if reply.calls else "stop")
        return CallResult(reply, finish, ids, logprobs, len(begun.prompt_ids), turn, out)

    def _check_constraint(self, request: CallRequest) -> None:
        """InvalidRequest (naming response_format in full) for a constraint this
        call cannot be decoded under: with tools the model may call (the whole reply
        is decoded under the format, so it could not call them), or on engines that
        cannot decode under its kind."""
        constraint = request.constraint
        if constraint is None:
            return
        kind = constraint.kind.value
        if request.tools and request.tool_choice.mode != "none":
            raise InvalidRequest(
                f"response_format {kind} with tools the model may call is not served: the "
                "whole reply is decoded under the format, so it could not call them (send "
                "tool_choice none, or no tools)", param="response_format")
        for slot in self._runtime.engines():
            refusal = slot.engine.capabilities.refusal(constraint)
            if refusal is not None:
                raise InvalidRequest(f"response_format {kind} is not served by this "
                                     f"session's engines: {refusal}", param="response_format")

    async def _generate(self, request: CallRequest, prompt_ids: list[int], budget: int,
                        turn: int) -> TurnOutput:
        base = self.spec.sampling
        sampling = Sampling(
            base.temperature if request.temperature is None else request.temperature,
            base.top_p if request.top_p is None else request.top_p,
            request.seed if request.seed is not None else base.seed, request.constraint)
        if request.seed is None:
            sampling = sampling.for_turn(self.spec.task_id, self.spec.key.repetition, turn)
        try:
            return await self.conversation.generate(prompt_ids, budget, sampling)
        except EngineRequestError as e:
            self.conversation.take_back()
            if request.constraint is not None:
                # Its context fits (the session's limits are within the engine's), so
                # what the engine refused is the format (a schema its grammar cannot
                # take): the session stays open for a call without it.
                log.warning("session %s: the engine refused a %s call: %s",
                            self.spec.session_id, request.constraint.kind.value, e)
                raise InvalidRequest(f"the engine refused to decode under response_format "
                                     f"{request.constraint.kind.value}: {e}",
                                     param="response_format") from None
            log.warning("session %s: the engine refused the call: %s", self.spec.session_id, e)
            self.finish(TrajectoryStatus.TRUNCATED, f"engine refused: {e}")
            raise ContextTooLong(f"the engine refused the call: {e}",
                                 param="messages") from None
        except EngineError as e:
            self.conversation.take_back()
            log.warning("session %s: the engines failed the call: %s", self.spec.session_id, e)
            self.finish(TrajectoryStatus.ERROR, f"engine: {e}", FailureStage.ENGINE)
            raise GatewayEngineError(f"the engines failed the call: {e}") from None

    def _stopped(self, out: TurnOutput, stop: Sequence[str], forced: str,
                 keep: str | None) -> tuple[list[int], list[float], int | None]:
        """The ids up to the token that completes the first stop string, or `keep`
        (the tail is cut: the context continues from there, as if the model had
        stopped), and where the reply's text (`forced` included) ends: before a stop
        string, after `keep`; None when nothing was cut."""
        ids, logprobs = list(out.output_ids), list(out.logprobs)
        if not stop and keep is None:
            return ids, logprobs, None

        def end_in(text: str) -> int | None:
            hits = [text.find(s, len(forced)) for s in stop if s in text[len(forced):]]
            if keep is not None and keep in text[len(forced):]:
                hits.append(text.index(keep, len(forced)) + len(keep))
            return min(hits) if hits else None

        if end_in(forced + self.tokenizer.decode(ids)) is None:
            return ids, logprobs, None
        # The shortest prefix whose text holds a stop: prefixes' texts only grow, so a
        # binary search decodes log2(n) prefixes, not n (whole, since a character may
        # span tokens).
        low, high = 1, len(ids)
        while low < high:
            mid = (low + high) // 2
            if end_in(forced + self.tokenizer.decode(ids[:mid])) is None:
                low = mid + 1
            else:
                high = mid
        return ids[:low], logprobs[:low], end_in(forced + self.tokenizer.decode(ids[:low]))

    def finish(self, status: TrajectoryStatus, reason: str | None = None,
               stage: FailureStage | None = None) -> None:
        """End it: the record is completed (not stored) and the scheduler forgets it. A
        call in flight in another task is cancelled first; the runner hears `ended`
        once that call has unwound (its `finally`), so no event follows the end."""
        if self.ended:
            return
        self.ended = True
        self.trajectory.children = [c.spec.trajectory_id for c in self.children]
        self.conversation.finish(status, reason, stage)
        task = self._call_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        elif not self.busy:
            self._tell_ended()

    def _tell_ended(self) -> None:
        self.conversation.ended(self.trajectory.reason or self.trajectory.status.value)


def no_call_served(traj: Trajectory) -> None:
    """A session's trajectory as it is stored: one that ended before any call was
    served has no token to train on and no outcome of the policy, so it is no
    completed (or truncated, or timed out) trajectory and has no reward: the
    harness's episode failed (status error, stage harness)."""
    if traj.turns or traj.status in (TrajectoryStatus.ERROR, TrajectoryStatus.ABORTED):
        return
    traj.reason = (f"harness: no call was served before the session ended "
                   f"({traj.status.value}" + (f": {traj.reason})" if traj.reason else ")"))
    traj.status, traj.failure_stage = TrajectoryStatus.ERROR, FailureStage.HARNESS
    traj.reward = traj.reward_source = None


__all__ = ["CallRequest", "CallResult", "Session", "SessionLimits", "SessionSpec",
           "no_call_served"]
