"""One trajectory's conversation: its token context, its record, and its runner's events.

The one room both doors work in. treadle's agent loop (`agent.loop`) and the
harness gateway's sessions (`gateway.session`) are two *drivers* of a
`Conversation`; each adds only its own rules (the loop: tools, limits, deadline,
score; a session: the harness protocol). What touches a trajectory's tokens and
its record is written here, once:

- the token context (`agent.context.TokenContext`: extensions, retries, new
  segments), its segments being the trajectory's record as it grows;
- each reply: its sampled ids appended (mask 1, the engine's logprobs and policy
  versions; mask 0 when not trainable), its `Turn` recorded, the llm and queue
  seconds added;
- the tool gap: from `tool_started` (a reply asked for tools, or was returned to a
  harness) to `tool_finished` (their results, or the harness's next call), its
  seconds on the conversation's clock;
- the runner's events (`agent.runner.TurnRunner`), each exactly once: after a final
  turn or a final tool, or `ended`, the runner hears nothing more.

Context tokens that are not sampled (tool results, new messages, a forced prefix)
carry the policy version of the reply they follow (the runner's current version
before the first reply). Not thread-safe: one turn at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from treadle.agent.chat import ChatFormat, Message, ParsedReply
from treadle.agent.context import Begun, TokenContext
from treadle.agent.runner import Sampling, TurnOutput, TurnRunner
from treadle.agent.tokenizer import Tokenizer
from treadle.clock import Clock
from treadle.engines.errors import EngineProtocolError
from treadle.types import FailureStage, Trajectory, TrajectoryStatus, Turn


class Conversation:
    """One trajectory's conversation (module docstring). `trajectory` is the record
    it fills; its times are on `clock`."""

    def __init__(self, trajectory: Trajectory, tokenizer: Tokenizer, fmt: ChatFormat,
                 runner: TurnRunner, clock: Clock, *, trainable: bool = True) -> None:
        self.trajectory = trajectory
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.runner = runner
        self.clock = clock
        self.trainable = trainable  # False: a frozen sub-agent's, every token at mask 0
        self.context = TokenContext(tokenizer, fmt)
        trajectory.segments = self.context.segments  # the record grows with the context
        trajectory.timings.started_at = clock.now()
        self._gap_since: float | None = None  # a tool gap is open since (clock time)
        self._told_last = False  # the runner has heard its last event

    @property
    def stop_id(self) -> int:
        return self.context.stop_id

    @property
    def turns(self) -> int:
        """Replies recorded so far (the next reply's index)."""
        return len(self.trajectory.turns)

    @property
    def in_tool(self) -> bool:
        """A tool gap is open (`tool_started` without its `tool_finished`)."""
        return self._gap_since is not None

    @property
    def events_over(self) -> bool:
        """The runner has heard its last event."""
        return self._told_last

    # -- the context --------------------------------------------------------------------

    def begin(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]], *,
              forced: str = "") -> Begun:
        """What the next turn adds before sampling (`TokenContext.begin`); a retried
        turn's reply is taken back from the record too."""
        traj = self.trajectory
        version = traj.turns[-1].policy_version if traj.turns else self.runner.policy_version
        begun = self.context.begin(messages, tools, len(traj.turns), forced, version)
        if begun.retried:  # the harness never read that reply
            lost = traj.turns.pop()
            traj.timings.llm_s -= lost.generating_s
            traj.timings.queue_s -= lost.queued_s
        return begun

    def take_back(self) -> None:
        """Undo the last `begin`: a turn that will not run (its reply, if any, stays
        recorded: only a retry takes a recorded reply back)."""
        self.context.take_back()

    async def generate(self, prompt_ids: list[int], max_tokens: int,
                       sampling: Sampling) -> TurnOutput:
        """The runner's reply on `prompt_ids`; EngineError as the runner raises it, and
        EngineProtocolError for a reply whose ids, logprobs and versions disagree."""
        out = await self.runner.generate(prompt_ids, max_tokens, sampling, [self.stop_id])
        n = len(out.output_ids)
        if len(out.logprobs) != n or len(out.policy_versions) != n:
            raise EngineProtocolError(f"runner returned {n} ids but {len(out.logprobs)} "
                                      f"logprobs and {len(out.policy_versions)} versions")
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """The text of sampled ids, without a final stop token."""
        return self.tokenizer.decode(ids[:-1] if ids and ids[-1] == self.stop_id else ids)

    def record_reply(self, out: TurnOutput, reply: ParsedReply, kept: int | None = None,
                     ) -> Turn:
        """Append the reply's first `kept` sampled ids (all by default; a harness's stop
        string cuts the rest) to the context and its turn to the record. `reply` is
        what it was parsed into (the message a harness is returned)."""
        n = len(out.output_ids) if kept is None else kept
        self.context.reply(out.output_ids[:n], out.logprobs[:n], out.policy_versions[:n],
                           reply.message(), trainable=self.trainable)
        traj = self.trajectory
        turn = out.turn(len(traj.turns))
        turn.output_tokens = n
        traj.turns.append(turn)
        traj.timings.llm_s += out.generating_s
        traj.timings.queue_s += out.queued_s
        return turn

    # -- the runner's events, each once ---------------------------------------------------

    def turn_finished(self, *, final: bool) -> None:
        """The last recorded reply is in; `final`: no tool call and no turn follow."""
        if self._told_last:
            return
        last = self.trajectory.turns[-1]
        self.runner.turn_finished(last.output_tokens, len(self.context.context), final)
        self._told_last = final

    def tool_started(self) -> None:
        """The tool gap opens (the reply's tools run, or the harness has the reply)."""
        if not self._told_last:
            self.runner.tool_started()
        self._gap_since = self.clock.now()

    def tool_finished(self, begun: Begun | None, *, final: bool) -> float:
        """The tool gap closes: `begun` is what its results (or the harness's next
        call) added to the context, None when nothing is shown (`final`: the
        trajectory ends here). Returns the gap's seconds."""
        gap = self._close_gap()
        appended = 0 if begun is None else begun.appended
        turn = self.trajectory.turns[-1] if self.trajectory.turns else None
        if turn is not None and turn.tool_call is not None:
            turn.tool_call.output_tokens = appended
        if not self._told_last:
            self.runner.tool_finished(gap, 0 if begun is None else begun.grown, final)
            self._told_last = final
        return gap

    def ended(self, reason: str) -> None:
        """The trajectory stopped between events (deadline, failure, cancel, its end);
        a no-op once the runner has heard its last event."""
        if not self._told_last:
            self._told_last = True
            self.runner.ended(reason)

    # -- the end ------------------------------------------------------------------------

    def finish(self, status: TrajectoryStatus, reason: str | None = None,
               stage: FailureStage | None = None) -> Trajectory:
        """Complete the record: its status, an open tool gap's seconds, its prompt's
        size and end time. The runner is not told (`ended` does that)."""
        traj = self.trajectory
        traj.status, traj.reason, traj.failure_stage = status, reason, stage
        if self._gap_since is not None:
            self._close_gap()
        traj.prompt_tokens = len(traj.segments[0].prompt_ids) if traj.segments else 0
        traj.timings.finished_at = self.clock.now()
        return traj

    def _close_gap(self) -> float:
        since, self._gap_since = self._gap_since, None
        gap = 0.0 if since is None else max(0.0, self.clock.now() - since)
        self.trajectory.timings.tool_s += gap
        return gap


__all__ = ["Conversation"]
