"""An episode's tools served to one session's harness: its calls run in the episode's
sandbox and are recorded in the session's trajectory.

    tools = SessionTools(session, episode)     # episode: open, on the task's sandbox
    specs = tools.specs                        # OpenAI function specs
    result = await tools.call("bash", '{"command": "ls"}')
    await tools.stop()                         # the harness is gone: no call runs now

What a call is, and how it is answered:

- A call runs the tool as `Episode.call` does in the agent loop: arguments that are
  not a JSON object, or that the tool's schema refuses, are the tool's own error
  result (a bad call is data), as is any call after a tool ended the episode
  (`submit_answer`). An infrastructure failure (a dead sandbox) raises, as there.
- A tool the episode does not have is `UnknownTool` (404).
- A call belongs to the reply before it: a call before the session's first reply
  is refused (`NoReplyYet`, 409), as is a call while a chat call or another tool
  call of the session runs (`SessionBusy`, 409), and a chat call while a tool call
  runs (the session's own check). A call of an ended session is `SessionEnded`
  (the gateway's answer to a chat call then).

The record, as the agent loop keeps it: the first call after a reply is that
turn's `ToolCall` (its name and arguments as run, its error and latency), in place
of the call the reply asked for; further calls before the next reply add their
latency to it (one record per turn: the scheduler sees one tool gap). The tool gap
itself (reply to next call) is timed by the session as for any harness. Not
thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from treadle.envs.base import Episode
from treadle.envs.tools.base import ToolResult
from treadle.gateway.errors import NoReplyYet, SessionBusy, SessionEnded, UnknownTool
from treadle.gateway.session import Session


class SessionTools:
    """`episode`'s tools served to `session`'s harness (module docstring). The
    caller owns the episode (it opens, scores and closes it)."""

    def __init__(self, session: Session, episode: Episode) -> None:
        self.session = session
        self.episode = episode
        self._running: asyncio.Task[Any] | None = None  # the tool call in flight
        self._stopped = False

    @property
    def specs(self) -> list[dict[str, Any]]:
        """The episode's tools in OpenAI's function format (`Episode.tool_specs`)."""
        return self.episode.tool_specs

    async def call(self, name: str, arguments: Mapping[str, Any] | str) -> ToolResult:
        """Run one call (module docstring); `arguments` as the harness sent them."""
        session = self.session
        sid = session.spec.session_id
        if self._stopped or session.ended or session.cut:
            raise SessionEnded(f"session {sid} has ended ({session.trajectory.status.value})")
        if name not in self.episode.tools:
            available = ", ".join(self.episode.tools) or "none"
            raise UnknownTool(f"no tool {name!r} in this session; it has {available}",
                              param="name")
        if session.busy or self._running is not None:
            raise SessionBusy(f"session {sid} is running a call; call the tool after it")
        turns = session.trajectory.turns
        if not turns:
            raise NoReplyYet(f"session {sid} has no reply yet: a tool call belongs to the "
                             "reply before it, so call the model first")
        turn = turns[-1]
        self._running = asyncio.current_task()
        session.in_tool_call = True
        try:
            result = await self.episode.call(name, arguments)
        finally:
            self._running = None
            session.in_tool_call = False
        ran = self.episode.history[-1]  # its arguments as parsed (or the raw text)
        record = result.to_tool_call(ran.name, ran.arguments)
        if turn.index not in session.tools_ran or turn.tool_call is None:
            turn.tool_call = record  # what ran, in place of what the reply asked for
            session.tools_ran.add(turn.index)
        else:
            turn.tool_call.latency_s += record.latency_s
        return result

    async def stop(self) -> None:
        """Refuse every further call, and cut the one in flight (its harness is gone),
        waiting until it has stopped; the episode is the caller's to score and close."""
        self._stopped = True
        task = self._running
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait({task})


__all__ = ["SessionTools"]
