"""The Qwen/Hermes chat format, rendered piecewise so that nothing is re-tokenized.

A trajectory's context is built from three kinds of pieces, each tokenized once
and appended, never re-rendered:

1. the **prompt**: system message (with the tool block), the user's task, and the
   generation prompt, exactly as Qwen2.5/Qwen3 chat templates render tool use::

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

2. the model's **reply**: the ids the engine sampled, ending with ``<|im_end|>``
   (the stop token; the engine returns it as the last output id);
3. an **observation**: the tool results of that reply, as the template renders
   tool messages, framed so that the context stays what the template would give
   for the whole conversation::

       \\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

   (several results of one reply each get their own ``<tool_response>`` block in
   the same user turn, joined by a newline, as Qwen3's template does).

Tool calls are parsed from the decoded reply: every ``<tool_call>{json}</tool_call>``
block whose JSON is an object with a string ``name`` and an object ``arguments``
(a JSON string holding an object is accepted too). Anything else inside a
``<tool_call>`` block, or a block left open, is a `CallError`: the agent loop shows
it to the model as an observation, it never raises.

Limits: one chat family (Qwen/Hermes); no "thinking" blocks are stripped (the
reply is kept verbatim, as it was sampled); a tokenizer whose BPE merges across the
boundary of two pieces gives a context that differs from tokenizing the whole
conversation at once — which is the point: the engine saw the pieces, so the
trainer must too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful assistant."
_TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Tokenizer(Protocol):
    """What the agent loop needs of a tokenizer. `encode` maps special-token text
    (``<|im_start|>``) to its single id and adds no BOS/EOS of its own."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_id(self, token: str) -> int:
        """The id of a special token; KeyError naming it if the vocabulary lacks it."""
        ...


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` package; no transformers)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer  # lazy: an optional dependency

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tok = _Tokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=False)
        return text

    def token_id(self, token: str) -> int:
        found = self._tok.token_to_id(token)
        if found is None:
            raise KeyError(f"token {token!r} is not in the tokenizer's vocabulary")
        return int(found)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """A well-formed tool call."""

    name: str  # the tool the model named (it may not exist; the episode says so)
    arguments: dict[str, Any]  # parsed JSON arguments


@dataclass(frozen=True, slots=True)
class CallError:
    """A `<tool_call>` block the model got wrong; `message` is shown to it."""

    message: str  # what is wrong, in words the model can act on
    raw: str  # the block's text as written (clipped)


@dataclass(frozen=True, slots=True)
class Reply:
    """One decoded model reply."""

    text: str  # the reply without its stop token
    calls: list[ParsedCall | CallError] = field(default_factory=list)  # in written order

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls)


def tool_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system message's tool section (empty without tools). `tools` are function
    specs as `Tool.spec` gives them ({"type": "function", "function": {...}})."""
    if not tools:
        return ""
    lines = "".join("\n" + json.dumps(dict(t), ensure_ascii=False) for t in tools)
    return _TOOLS_INTRO + lines + _TOOLS_OUTRO


@dataclass(frozen=True, slots=True)
class HermesFormat:
    """Qwen/Hermes rendering; see the module docstring for the exact text."""

    system: str = DEFAULT_SYSTEM  # used when the task's messages carry no system message

    def prompt_text(self, prompt: str | Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] = ()) -> str:
        """The prompt piece: system (with tools), the task's messages, generation prompt.

        `prompt` is the task's text (one user message) or chat messages with roles
        system/user/assistant; ValueError for any other shape.
        """
        messages = _messages(prompt)
        system = self.system
        if messages and messages[0]["role"] == "system":
            system = messages.pop(0)["content"]
        out = [f"{IM_START}system\n{system}{tool_block(tools)}{IM_END}\n"]
        for m in messages:
            out.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
        out.append(f"{IM_START}assistant\n")
        return "".join(out)

    def observation_text(self, results: Sequence[str]) -> str:
        """The observation piece after a reply that ended with the stop token."""
        blocks = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
        return f"\n{IM_START}user\n{blocks}{IM_END}\n{IM_START}assistant\n"

    def reply_text(self, content: str, calls: Sequence[ParsedCall] = ()) -> str:
        """How a reply with these calls is written, stop token included (for building
        supervised transcripts in the very format the agent loop parses)."""
        body = content
        for c in calls:
            call = json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
            body += f"{chr(10) if body else ''}<tool_call>\n{call}\n</tool_call>"
        return body + IM_END

    def parse(self, text: str) -> Reply:
        """The reply's tool calls, well-formed or not (never raises)."""
        text = text.removesuffix(IM_END)
        return Reply(text, self.split(text)[1])

    def split(self, text: str) -> tuple[str, list[ParsedCall | CallError]]:
        """(the reply's text without its well-formed ``<tool_call>`` blocks, stripped;
        every block's call, well-formed or not). A malformed or unclosed block stays
        in the text: it is what the model wrote, not a call. Never raises."""
        calls: list[ParsedCall | CallError] = []
        kept: list[str] = []
        end = 0
        for m in _CALL.finditer(text):
            call = _parse_call(m.group(1))
            calls.append(call)
            kept.append(text[end:m.start()] if isinstance(call, ParsedCall)
                        else text[end:m.end()])
            end = m.end()
        rest = text[end:]
        kept.append(rest)
        if "<tool_call>" in rest:
            raw = rest[rest.index("<tool_call>"):]
            calls.append(CallError("a <tool_call> block was opened but never closed with "
                                   "</tool_call>", raw[:200]))
        return "".join(kept).strip(), calls


def _messages(prompt: str | Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    out: list[dict[str, str]] = []
    for i, m in enumerate(prompt):
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise ValueError(f"prompt message {i}: needs role system/user/assistant and "
                             f"string content, got {dict(m)!r:.120}")
        if role == "system" and i:
            raise ValueError(f"prompt message {i}: a system message must come first")
        out.append({"role": role, "content": content})
    if not out:
        raise ValueError("prompt has no messages")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse_call(body: str) -> ParsedCall | CallError:
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
    return ParsedCall(value["name"], args)
