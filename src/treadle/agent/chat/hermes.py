"""The Qwen/Hermes chat format (Qwen2.5's tool-use template), written once for both doors.

The whole conversation renders as Qwen2.5 and Qwen3 chat templates render tool use
(without thinking blocks; `qwen3` is the family with them)::

    <|im_start|>system
    {system}

    # Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {...}}
    </tools>

    For each function call, return a json object with function name and arguments
    within <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call><|im_end|>
    <|im_start|>user
    {task}<|im_end|>
    <|im_start|>assistant

A reply is the ids the engine sampled, ending with ``<|im_end|>``; tool results
follow it as the template renders tool messages — consecutive ones in one user
turn, each in its own ``<tool_response>`` block, joined by a newline::

    \\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

Tool calls are read from a reply's text: every ``<tool_call>{json}</tool_call>``
block whose JSON is an object with a string ``name`` and an object ``arguments`` (a
JSON string holding an object is accepted too). Anything else inside a block, or a
block left open, is a `CallError` that the agent loop shows the model as an
observation; it never raises. A system message after the first is rendered in
place, as a system turn. A tokenizer whose BPE merges across the boundary of two
pieces gives a context that differs from tokenizing the whole conversation at once,
which is the point: the engine saw the pieces, so the trainer must too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.agent.chat.base import AUTO, Call, CallError, Message, ParsedReply, ToolChoice

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful assistant."
TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tool_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system message's tool section (empty without tools). `tools` are function
    specs as `Tool.spec` gives them ({"type": "function", "function": {...}})."""
    if not tools:
        return ""
    lines = "".join("\n" + json.dumps(dict(t), ensure_ascii=False) for t in tools)
    return TOOLS_INTRO + lines + TOOLS_OUTRO


@dataclass(frozen=True, slots=True)
class HermesFormat:
    """Qwen/Hermes rendering; the module docstring has the exact text."""

    name: str = "hermes"
    system: str = DEFAULT_SYSTEM  # when the conversation has no system message
    stop_token: str = IM_END
    call_end: str = "</tool_call>"

    def prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]) -> str:
        system, rest = self.system, list(messages)
        if rest and rest[0].role == "system":
            system = rest.pop(0).content
        head = f"{IM_START}system\n{system}{tool_block(tools)}{IM_END}\n"
        return head + self._messages(rest) + f"{IM_START}assistant\n"

    def continuation(self, messages: Sequence[Message], reply_closed: bool) -> str:
        close = "" if reply_closed else IM_END
        return f"{close}\n{self._messages(messages)}{IM_START}assistant\n"

    def forced_prefix(self, choice: ToolChoice) -> str:
        if choice.mode == "required":
            return "<tool_call>\n"
        if choice.mode == "function":
            return f'<tool_call>\n{{"name": {json.dumps(choice.function)}, "arguments": '
        return ""

    def reply(self, text: str, choice: ToolChoice = AUTO) -> ParsedReply:
        text = text.removesuffix(IM_END)
        if choice.mode == "none":
            return ParsedReply(text.strip() or None, text=text)
        content, parts = split_calls(text)
        return ParsedReply(content or None, tuple(parts), text)

    def reply_text(self, content: str, calls: Sequence[Call] = ()) -> str:
        body = content
        for c in calls:
            call = json.dumps({"name": c.name, "arguments": c.parsed_arguments()},
                              ensure_ascii=False)
            body += f"{chr(10) if body else ''}<tool_call>\n{call}\n</tool_call>"
        return body + IM_END

    def _messages(self, messages: Sequence[Message]) -> str:
        return render_messages(messages, lambda _i, m: self.reply_text(m.content, m.calls))


def render_messages(messages: Sequence[Message],
                    assistant: Callable[[int, Message], str]) -> str:
    """`messages` as the Qwen family's templates render them after the system turn:
    consecutive tool results in one user turn, each in a ``<tool_response>`` block;
    user and later system messages as their own turns; an assistant message (at its
    index) as `assistant` writes its body, stop token included."""
    out: list[str] = []
    tools: list[str] = []  # consecutive tool results: one user turn, as Qwen renders them
    for i, m in enumerate(messages):
        if m.role == "tool":
            tools.append(f"<tool_response>\n{m.content}\n</tool_response>")
            continue
        if tools:
            out.append(f"{IM_START}user\n" + "\n".join(tools) + f"{IM_END}\n")
            tools = []
        if m.role == "assistant":
            out.append(f"{IM_START}assistant\n{assistant(i, m)}\n")
        else:
            out.append(f"{IM_START}{m.role}\n{m.content}{IM_END}\n")
    if tools:
        out.append(f"{IM_START}user\n" + "\n".join(tools) + f"{IM_END}\n")
    return "".join(out)


def split_calls(text: str) -> tuple[str, list[Call | CallError]]:
    """(`text` without its well-formed ``<tool_call>`` blocks, stripped; every block's
    call, well-formed or not, in written order). A malformed or unclosed block stays
    in the text: it is what the model wrote, not a call. Never raises."""
    calls: list[Call | CallError] = []
    kept: list[str] = []
    end = 0
    for m in _CALL.finditer(text):
        call = parse_call(m.group(1))
        calls.append(call)
        kept.append(text[end:m.start()] if isinstance(call, Call) else text[end:m.end()])
        end = m.end()
    rest = text[end:]
    kept.append(rest)
    if "<tool_call>" in rest:
        raw = rest[rest.index("<tool_call>"):]
        calls.append(CallError("a <tool_call> block was opened but never closed with "
                               "</tool_call>", raw[:200]))
    return "".join(kept).strip(), calls


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_call(body: str) -> Call | CallError:
    """One block's JSON as a call, or what is wrong with it (never raises)."""
    raw = body.strip()
    try:
        # No NaN or Infinity (the record could not be written), nor nesting past the
        # parser's depth: model-written text is anything.
        value = json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        return CallError(f"the tool call is not valid JSON ({e.msg} at position {e.pos}); "
                         'write {"name": ..., "arguments": {...}}', raw[:200])
    except (ValueError, RecursionError) as e:
        return CallError(f"the tool call is not valid JSON ({str(e)[:80]})", raw[:200])
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return CallError('the tool call must be a JSON object with a string "name"', raw[:200])
    args = value.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args, parse_constant=_no_constant) if args.strip() else {}
        except (ValueError, RecursionError):
            return CallError('"arguments" must be a JSON object', raw[:200])
    if not isinstance(args, dict):
        return CallError('"arguments" must be a JSON object', raw[:200])
    return Call.of(value["name"], args)


__all__ = ["DEFAULT_SYSTEM", "IM_END", "IM_START", "TOOLS_INTRO", "TOOLS_OUTRO",
           "HermesFormat", "parse_call", "render_messages", "split_calls", "tool_block"]
