"""Chat formats: one protocol (`base.ChatFormat`), one registry (`chat_format`).

    base.py     messages, calls, replies, and the `ChatFormat` protocol
    hermes.py   the Qwen/Hermes family (Qwen2.5's tool-use template)
    qwen3.py    Qwen3: Hermes tool calls with thinking blocks

A format is added in one place: its module here and one line in `FORMATS`. A name
that is not registered is refused (`chat_format` raises), so a model whose template
treadle does not know is refused at a job's or session's creation, never rendered
wrongly.
"""

from __future__ import annotations

from treadle.agent.chat.base import (
    Call,
    CallError,
    ChatFormat,
    Message,
    ParsedReply,
    Role,
    ToolChoice,
    canonical_json,
    prompt_messages,
)
from treadle.agent.chat.hermes import IM_END, IM_START, HermesFormat, tool_block
from treadle.agent.chat.qwen3 import Qwen3Format

FORMATS: dict[str, ChatFormat] = {
    "hermes": HermesFormat(),
    "qwen": HermesFormat(name="qwen"),  # Qwen2.5's template is Hermes
    "qwen3": Qwen3Format(),
}
DEFAULT_FORMAT = "hermes"


def chat_format(name: str) -> ChatFormat:
    """The format called `name`; ValueError naming the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"no chat format {name!r}: treadle renders "
                         f"{', '.join(sorted(FORMATS))}") from None


__all__ = ["DEFAULT_FORMAT", "FORMATS", "IM_END", "IM_START", "Call", "CallError",
           "ChatFormat", "HermesFormat", "Message", "ParsedReply", "Qwen3Format", "Role",
           "ToolChoice", "canonical_json", "chat_format", "prompt_messages", "tool_block"]
