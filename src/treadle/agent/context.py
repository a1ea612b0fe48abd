"""One trajectory's token context: what each turn appends, and when a new segment begins.

Both doors keep their context here: treadle's agent loop (its task's prompt, then
its tool results as ``tool`` messages) and the harness gateway (whatever messages a
harness sends). The context never trusts text sent back to it. It keeps the
conversation it has rendered (`Message`s, its own replies as they were returned)
and the token ids of the current segment, and for every turn compares the turn's
messages with them:

- **extension** — the messages are the conversation so far (every earlier message
  equal; each echoed assistant reply the same as returned, up to whitespace and the
  JSON layout of its tool arguments) followed by new ones, with the same tools: only
  the new messages are tokenized (`ChatFormat.continuation`, mask 0) and appended
  after the sampled ids of the last reply, which stay the engine's own;
- **retry** — the messages are exactly the previous call's (a client that timed
  out, or lost the connection, and sent the request again): the previous call's
  reply, which the harness never read, is taken back and the call is run again on
  the context it had;
- **new segment** — anything else: the harness pruned old tool results, summarised,
  rewrote the system prompt, changed the tools or edited a reply. The whole
  conversation is rendered again (`ChatFormat.prompt`) as the prompt of a new
  `TokenSegment`, whose `start_turn` and `start_reason` say where and why:

  ================  ===========================================================
  start             the first turn
  tools_changed     the tools differ from the previous call's
  system_changed    the first message (the system prompt) differs
  reply_edited      an echoed assistant reply is not the one returned
  messages_removed  no new message after the conversation: fewer (pruned), or
                    the same ones again (not the last call's: that is a retry)
  messages_edited   an earlier user or tool message differs (e.g. summarised)
  ================  ===========================================================

Each segment is prefix-consistent: its context is exactly what the engine was sent
on each of its calls. This module is pure (no I/O, no clock): `agent.conversation`
drives it. (treadle's own agent loop only ever extends its conversation.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.agent.chat import ChatFormat, Message, canonical_json
from treadle.agent.tokenizer import Tokenizer
from treadle.types import TokenSegment


@dataclass(frozen=True, slots=True)
class Begun:
    """What `TokenContext.begin` did for a turn."""

    prompt_ids: list[int]  # the whole context to send the engine
    appended: int  # tokens added before sampling (the new messages, or a new prompt)
    new_segment: str | None  # the new segment's start reason, or None (an extension)
    retried: bool  # the previous call's reply was taken back (a retried request)
    previous_context: int  # tokens of the context before this call (after a retry's undo)

    @property
    def grown(self) -> int:
        """How much the context grew, as the scheduler hears it (it only adds): the
        appended tokens of an extension; over the old context for a new segment (0 if
        the new one is smaller)."""
        if self.new_segment is None:
            return self.appended
        return max(0, len(self.prompt_ids) - self.previous_context)


@dataclass(slots=True)
class _Undo:
    """The context before the last call, to take that call back on a retry."""

    segments: int  # segments there were
    response_len: int  # response tokens of the last of them
    history: list[Message]
    closed: bool
    tools_before: str  # the tools before it
    request: list[Message]  # the last call's messages
    tools_key: str  # and its tools


class TokenContext:
    """The token context of one trajectory (see the module docstring). Not
    thread-safe; one turn at a time."""

    def __init__(self, tokenizer: Tokenizer, fmt: ChatFormat) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.segments: list[TokenSegment] = []  # the trajectory's token record, in order
        self.context: list[int] = []  # the current segment's prompt and responses
        self._history: list[Message] = []  # the conversation the context holds
        self._tools_key = ""
        self._closed = True  # the last reply ended with the stop token
        self._undo: _Undo | None = None
        self.stop_id = tokenizer.token_id(fmt.stop_token)

    @property
    def history(self) -> list[Message]:
        """The conversation the context holds, replies as returned (a copy)."""
        return list(self._history)

    def begin(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
              turn: int, forced: str = "", version: int = 0) -> Begun:
        """Append what this call adds before sampling: the new messages (an extension)
        or a new segment's prompt, then the `forced` prefix (mask 0, stamped with
        `version`). `turn` is the index the call's reply will have."""
        tools_key = canonical_json(list(tools))
        retried = self._retry(messages, tools_key)
        undo = _Undo(len(self.segments), len(self.segments[-1].response_ids)
                     if self.segments else 0, list(self._history), self._closed,
                     self._tools_key, list(messages), tools_key)
        previous = len(self.context)
        reason = self._why_new(messages, tools_key)
        if reason is None:
            text = self.fmt.continuation(messages[len(self._history):], self._closed) + forced
            ids = self.tokenizer.encode(text)
            self._append(ids, version)
        else:
            ids = self.tokenizer.encode(self.fmt.prompt(messages, tools) + forced)
            self.segments.append(TokenSegment(prompt_ids=list(ids), start_turn=turn,
                                              start_reason=reason))
            self.context = list(ids)
        self._history = list(messages)
        self._tools_key = tools_key
        self._undo = undo
        return Begun(list(self.context), len(ids), reason, retried, previous)

    def reply(self, ids: Sequence[int], logprobs: Sequence[float],
              versions: Sequence[int], returned: Message, *, trainable: bool = True) -> None:
        """Append the sampled ids (mask 1; mask 0 and logprob 0.0 when not `trainable`,
        a frozen sub-agent's); `returned` is the reply as the harness got it, which its
        next call must echo."""
        seg = self.segments[-1]
        self.context.extend(ids)
        seg.response_ids.extend(ids)
        seg.loss_mask.extend([int(trainable)] * len(ids))
        seg.logprobs.extend(logprobs if trainable else [0.0] * len(ids))
        seg.policy_versions.extend(versions)
        self._history.append(returned)
        self._closed = bool(ids) and ids[-1] == self.stop_id

    def _why_new(self, messages: Sequence[Message], tools_key: str) -> str | None:
        """None when `messages` extend the conversation; else the new segment's reason."""
        if not self.segments:
            return "start"
        if tools_key != self._tools_key:
            return "tools_changed"
        had = self._history
        for given, kept in zip(messages, had, strict=False):
            if kept.role == "assistant":
                if not kept.same_reply(given):
                    return "reply_edited"
            elif given != kept:
                return "system_changed" if kept.role == "system" else "messages_edited"
        if len(messages) <= len(had):
            return "messages_removed"
        return None

    def take_back(self) -> None:
        """Undo the last `begin` (and its reply, if any): a call that could not run."""
        if self._undo is not None:
            self._restore(self._undo)

    def _retry(self, messages: Sequence[Message], tools_key: str) -> bool:
        """Take the last call back if `messages` repeat it exactly."""
        undo = self._undo
        if undo is None or tools_key != undo.tools_key or list(messages) != undo.request:
            return False
        self._restore(undo)
        return True

    def _restore(self, undo: _Undo) -> None:
        del self.segments[undo.segments:]
        if undo.segments:
            seg = self.segments[-1]
            for part in (seg.response_ids, seg.loss_mask, seg.logprobs, seg.policy_versions):
                del part[undo.response_len:]
            self.context = seg.prompt_ids + seg.response_ids
        else:
            self.context = []
        self._history, self._closed = undo.history, undo.closed
        self._tools_key = undo.tools_before
        self._undo = None

    def _append(self, ids: Sequence[int], version: int) -> None:
        seg = self.segments[-1]
        self.context.extend(ids)
        seg.response_ids.extend(ids)
        seg.loss_mask.extend([0] * len(ids))
        seg.logprobs.extend([0.0] * len(ids))
        seg.policy_versions.extend([version] * len(ids))


__all__ = ["Begun", "TokenContext"]
