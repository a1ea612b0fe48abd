"""What a chat format is: a conversation as text pieces, a sampled reply as calls.

A `ChatFormat` renders a conversation the way a model family's chat template does,
in pieces that `agent.context.TokenContext` tokenizes one at a time and appends,
never re-rendering what the engine has already seen:

- `prompt`: the whole conversation (system with the tool block, every message)
  and the generation prompt — a segment's first context;
- `continuation`: the messages that follow a reply the model sampled, framed so
  that the reply's own ids (the engine's, never re-encoded) and this piece joined
  equal the template's text for the whole conversation;
- `forced_prefix`: what `tool_choice` ``required`` or a named function writes
  for the model before it samples (the engine continues after it; those tokens are
  context, mask 0, never sampled);
- `reply`: the sampled text (after any forced prefix) as content and tool calls,
  malformed calls included as `CallError`s in written order;
- `reply_text`: how a reply with given calls is written (supervised transcripts in
  the very format the replies are parsed in).

Both doors drive the same formats: treadle's agent loop (a task's prompt as
messages, tool results as ``tool`` messages) and the harness gateway (OpenAI
messages as a harness sends them). Limits: text content only (no images or audio).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Role = Literal["system", "user", "assistant", "tool"]


def canonical_json(value: Any) -> str:
    """One spelling of a JSON value: what two echoes of the same arguments share."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Call:
    """A well-formed tool call: the function and its JSON arguments."""

    name: str  # the function the model named (it may not exist; the episode says so)
    arguments: str  # canonical JSON of the arguments object (sorted keys, compact)

    @staticmethod
    def of(name: str, arguments: Mapping[str, Any]) -> Call:
        return Call(name, canonical_json(arguments))

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict (a fresh one on every call)."""
        value: dict[str, Any] = json.loads(self.arguments)
        return value


@dataclass(frozen=True, slots=True)
class CallError:
    """A tool-call block the model got wrong; `message` is shown to it."""

    message: str  # what is wrong, in words the model can act on
    raw: str  # the block's text as written (clipped)


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a conversation, as the room compares and renders it."""

    role: Role  # "developer" arrives as "system"; "function" is refused at the edge
    content: str  # text ("" for an assistant message with only tool calls)
    calls: tuple[Call, ...] = ()  # an assistant message's tool calls, in order
    # An assistant message's thinking, where the format has it (None: not given, read
    # from the content as the format's template does).
    reasoning: str | None = None

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


AUTO = ToolChoice()  # the default: the model decides


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A sampled reply: its content, its tool calls, and its reasoning."""

    content: str | None  # the text without its well-formed tool-call blocks; None if empty
    parts: tuple[Call | CallError, ...] = ()  # every tool-call block, in written order
    text: str = ""  # the reply as written after its reasoning (calls included): the answer
    reasoning: str | None = None  # a thinking block's text (formats that have them)

    @property
    def calls(self) -> list[Call]:
        """The well-formed calls, in order."""
        return [p for p in self.parts if isinstance(p, Call)]

    @property
    def wants_tools(self) -> bool:
        """Whether the reply has any tool-call block, well-formed or not."""
        return bool(self.parts)

    def message(self) -> Message:
        """The reply as the assistant message a harness is returned (and echoes)."""
        return Message("assistant", self.content or "", tuple(self.calls), self.reasoning)


def prompt_messages(prompt: str | Sequence[Mapping[str, Any]]) -> list[Message]:
    """A task's prompt as messages: a text is one user message; chat messages need
    roles system/user/assistant, string content, and a system message only first
    (the prompt a suite task or a transcript starts from). ValueError naming the
    message otherwise."""
    if isinstance(prompt, str):
        return [Message("user", prompt)]
    out: list[Message] = []
    for i, m in enumerate(prompt):
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise ValueError(f"prompt message {i}: needs role system/user/assistant and "
                             f"string content, got {dict(m)!r:.120}")
        if role == "system" and i:
            raise ValueError(f"prompt message {i}: a system message must come first")
        out.append(Message(role, content))
    if not out:
        raise ValueError("prompt has no messages")
    return out


class ChatFormat(Protocol):
    """What the room needs of a model family's chat template (module docstring)."""

    @property
    def name(self) -> str:
        """What `chat_format` finds it by."""
        ...

    @property
    def stop_token(self) -> str:
        """The special token that ends a reply."""
        ...

    @property
    def call_end(self) -> str:
        """The text that closes one tool call (a reply is cut there for
        parallel_tool_calls false)."""
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

    def reply(self, text: str, choice: ToolChoice = AUTO) -> ParsedReply:
        """The reply's content and calls; `text` includes the forced prefix, not the stop
        token. With tool_choice none every block stays text. Never raises."""
        ...

    def reply_text(self, content: str, calls: Sequence[Call] = ()) -> str:
        """How a reply with these calls is written, stop token included."""
        ...


__all__ = ["AUTO", "Call", "CallError", "ChatFormat", "Message", "ParsedReply", "Role",
           "ToolChoice", "canonical_json", "prompt_messages"]
