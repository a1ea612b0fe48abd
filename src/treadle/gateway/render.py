"""Chat formats for the gateway: OpenAI-style messages as text pieces, replies as calls.

A `ChatFormat` renders a conversation the way the model's chat template does, in
pieces that `gateway.context` tokenizes one at a time and appends:

- `prompt`: the whole conversation (system with the tool block, every message)
  and the generation prompt — a segment's first context;
- `continuation`: the messages that follow a reply the model sampled, framed so
  that the reply's own ids (the engine's, never re-encoded) and this piece joined
  equal the template's text for the whole conversation;
- `forced_prefix`: what `tool_choice` ``required`` or a named function writes
  for the model before it samples (the engine continues after it; those tokens are
  context, mask 0, never sampled);
- `reply`: the sampled text (after any forced prefix) as content and tool calls.

`HermesChat` is the Qwen/Hermes family (`treadle.agent.chat` has the exact text);
`chat_format(name)` finds a format by name and refuses an unknown one, so that a
session for a model whose format treadle does not know is refused at creation
rather than rendered wrongly. Limits: text content only (no images or audio); a
system message after the first is rendered in place, as a system turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from treadle.agent.chat import (
    DEFAULT_SYSTEM,
    IM_END,
    IM_START,
    CallError,
    HermesFormat,
    ParsedCall,
    tool_block,
)

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class Call:
    """A tool call of an assistant message: the function and its JSON arguments."""

    name: str  # the function's name
    arguments: str  # canonical JSON of the arguments object (sorted keys, compact)

    @staticmethod
    def of(name: str, arguments: Mapping[str, Any]) -> Call:
        return Call(name, canonical_json(arguments))


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a conversation, as the gateway compares and renders it."""

    role: Role  # "developer" arrives as "system"; "function" is refused at the edge
    content: str  # text ("" for an assistant message with only tool calls)
    calls: tuple[Call, ...] = ()  # an assistant message's tool calls, in order

    def same_reply(self, other: Message) -> bool:
        """Whether two assistant messages say the same, up to the whitespace and JSON
        layout a harness changes when it echoes a reply back."""
        return (self.role == other.role == "assistant"
                and self.content.strip() == other.content.strip()
                and self.calls == other.calls)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`tool_choice`: auto, none, required, or one named function."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    function: str | None = None  # the function, for mode "function"


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A sampled reply, as the harness gets it."""

    content: str | None  # the text without its well-formed tool-call blocks; None if empty
    calls: list[Call] = field(default_factory=list)  # well-formed calls, in order


class ChatFormat(Protocol):
    """What the gateway needs of a model family's chat template (module docstring)."""

    @property
    def name(self) -> str:
        """What `chat_format` finds it by."""
        ...

    @property
    def stop_token(self) -> str:
        """The special token that ends a reply."""
        ...

    def prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]) -> str:
        """The whole conversation and the generation prompt."""
        ...

    def continuation(self, messages: Sequence[Message], reply_closed: bool) -> str:
        """The piece after a sampled reply: `messages` and the generation prompt.
        `reply_closed`: the reply ended with the stop token (else it is closed here)."""
        ...

    def forced_prefix(self, choice: ToolChoice) -> str:
        """What the model is made to have written before it samples ("" for auto/none)."""
        ...

    @property
    def call_end(self) -> str:
        """The text that closes one tool call (a reply is cut there for
        parallel_tool_calls false)."""
        ...

    def reply(self, text: str, choice: ToolChoice) -> ParsedReply:
        """The reply's content and calls; `text` includes the forced prefix, not the stop
        token. With tool_choice none every block stays text."""
        ...


@dataclass(frozen=True, slots=True)
class HermesChat:
    """The Qwen/Hermes family, rendered as `treadle.agent.chat.HermesFormat` does."""

    name: str = "hermes"
    stop_token: str = IM_END
    system: str = DEFAULT_SYSTEM  # when the conversation has no system message
    _hermes: HermesFormat = field(default_factory=HermesFormat)

    def prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]) -> str:
        system, rest = self.system, list(messages)
        if rest and rest[0].role == "system":
            system = rest.pop(0).content
        head = f"{IM_START}system\n{system}{tool_block(tools)}{IM_END}\n"
        return head + self._messages(rest) + f"{IM_START}assistant\n"

    def continuation(self, messages: Sequence[Message], reply_closed: bool) -> str:
        close = "" if reply_closed else IM_END
        return f"{close}\n{self._messages(messages)}{IM_START}assistant\n"

    @property
    def call_end(self) -> str:
        return "</tool_call>"

    def forced_prefix(self, choice: ToolChoice) -> str:
        if choice.mode == "required":
            return "<tool_call>\n"
        if choice.mode == "function":
            return f'<tool_call>\n{{"name": {json.dumps(choice.function)}, "arguments": '
        return ""

    def reply(self, text: str, choice: ToolChoice) -> ParsedReply:
        if choice.mode == "none":
            return ParsedReply(text.strip() or None)
        content, calls = self._hermes.split(text)
        good = [Call.of(c.name, c.arguments) for c in calls if isinstance(c, ParsedCall)]
        return ParsedReply(content or None, good)

    def _messages(self, messages: Sequence[Message]) -> str:
        out: list[str] = []
        tools: list[str] = []  # consecutive tool results: one user turn, as Qwen renders them
        for m in messages:
            if m.role == "tool":
                tools.append(f"<tool_response>\n{m.content}\n</tool_response>")
                continue
            if tools:
                out.append(f"{IM_START}user\n" + "\n".join(tools) + f"{IM_END}\n")
                tools = []
            if m.role == "assistant":
                calls = [ParsedCall(c.name, json.loads(c.arguments)) for c in m.calls]
                out.append(f"{IM_START}assistant\n{self._hermes.reply_text(m.content, calls)}\n")
            else:
                out.append(f"{IM_START}{m.role}\n{m.content}{IM_END}\n")
        if tools:
            out.append(f"{IM_START}user\n" + "\n".join(tools) + f"{IM_END}\n")
        return "".join(out)


_FORMATS: dict[str, ChatFormat] = {"hermes": HermesChat(), "qwen": HermesChat(name="qwen")}


def chat_format(name: str) -> ChatFormat:
    """The format called `name`; ValueError naming the known ones otherwise."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"no chat format {name!r}: treadle renders "
                         f"{', '.join(sorted(_FORMATS))}") from None


def canonical_json(value: Any) -> str:
    """One spelling of a JSON value: what two echoes of the same arguments share."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


__all__ = ["Call", "CallError", "ChatFormat", "HermesChat", "Message", "ParsedReply",
           "ToolChoice", "canonical_json", "chat_format"]
