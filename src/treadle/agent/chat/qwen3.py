"""Qwen3: Hermes tool calls with thinking blocks, as Qwen3's published chat template renders.

What differs from `hermes` (the same tool block, tool calls and tool responses):

- no default system message: without one, the system turn holds only the tool
  block, and without tools there is no system turn at all;
- a reply starts with its reasoning, ``<think>\\n...\\n</think>\\n\\n``, then its
  content and calls. `reply` splits it off (`ParsedReply.reasoning`): the calls are
  read from what follows it, and a harness is returned the content without it;
- history: an assistant message after the last user query (the agentic part of the
  conversation: its tool calls and their results) is rendered with its reasoning
  block when it has reasoning or is the last message, as the template does; one
  before it, without.

Limits, by design: the context is only ever appended to, so a conversation that
goes on after a new *user* query keeps the earlier replies' thinking as the engine
sampled it, where the template would re-render them without (Qwen3's template is
not prefix-preserving there; treadle's record must be what the engine saw). The
template's ``enable_thinking=false`` is not offered: its empty thinking block is in
the generation prompt but not in the history the template renders afterwards, so
no append-only context can match it past the first reply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.agent.chat.base import AUTO, Call, Message, ParsedReply, ToolChoice
from treadle.agent.chat.hermes import (
    IM_END,
    IM_START,
    HermesFormat,
    render_messages,
    split_calls,
    tool_block,
)

_THINK_END = "</think>"
_HERMES = HermesFormat()  # Qwen3's tool calls and tool responses are Hermes's


@dataclass(frozen=True, slots=True)
class Qwen3Format:
    """Qwen3 with thinking; the module docstring says what differs from Hermes."""

    name: str = "qwen3"
    stop_token: str = IM_END
    call_end: str = "</tool_call>"

    def prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]) -> str:
        rest = list(messages)
        system = rest.pop(0).content if rest and rest[0].role == "system" else None
        if tools:
            head = (f"{IM_START}system\n" + ("" if system is None else system + "\n\n")
                    + tool_block(tools).removeprefix("\n\n") + f"{IM_END}\n")
        elif system is not None:
            head = f"{IM_START}system\n{system}{IM_END}\n"
        else:
            head = ""
        offset = len(messages) - len(rest)  # the template counts the system message
        query = _last_query(messages) - offset
        return head + self._messages(rest, query) + f"{IM_START}assistant\n"

    def continuation(self, messages: Sequence[Message], reply_closed: bool) -> str:
        close = "" if reply_closed else IM_END
        # After a sampled reply nothing is re-rendered: every message here follows the
        # last query or is one (a new query's own reasoning rule applies to later replies).
        return f"{close}\n{self._messages(messages, -1)}{IM_START}assistant\n"

    def forced_prefix(self, choice: ToolChoice) -> str:
        return _HERMES.forced_prefix(choice)

    def reply(self, text: str, choice: ToolChoice = AUTO) -> ParsedReply:
        text = text.removesuffix(IM_END)
        reasoning = None
        if _THINK_END in text:  # the template's own split
            head, _, _ = text.partition(_THINK_END)
            reasoning = head.rstrip("\n").split("<think>")[-1].lstrip("\n")
            text = text.split(_THINK_END)[-1].lstrip("\n")
        if choice.mode == "none":
            return ParsedReply(text.strip() or None, text=text, reasoning=reasoning)
        content, parts = split_calls(text)
        return ParsedReply(content or None, tuple(parts), text, reasoning)

    def reply_text(self, content: str, calls: Sequence[Call] = ()) -> str:
        return _HERMES.reply_text(content, calls)

    def _messages(self, messages: Sequence[Message], last_query: int) -> str:
        last = len(messages) - 1
        return render_messages(messages, lambda i, m: self._assistant(m, i > last_query,
                                                                      i == last))

    def _assistant(self, m: Message, after_query: bool, last: bool) -> str:
        content, reasoning = m.content, m.reasoning
        if reasoning is None:  # not given: read from the content, as the template does
            reasoning = ""
            if _THINK_END in content:
                head = content.split(_THINK_END)[0]
                reasoning = head.rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split(_THINK_END)[-1].lstrip("\n")
        if after_query and (last or reasoning):
            # The calls' separating newline follows the content alone, as in the template.
            think = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
            return think + self.reply_text(content.lstrip("\n"), m.calls)
        return self.reply_text(content, m.calls)


def _last_query(messages: Sequence[Message]) -> int:
    """The index of the last user message that is not a wrapped tool response (the
    template's `last_query_index`: the last message's when there is none)."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "user" and not (m.content.startswith("<tool_response>")
                                     and m.content.endswith("</tool_response>")):
            return i
    return len(messages) - 1


__all__ = ["Qwen3Format"]
