"""The OpenAI chat-completions wire: the request as a `CallRequest`, the replies and
the errors as OpenAI's SDKs parse them.

Parameters (anything else is a 400 naming it — never silently ignored):

=========================  ====================================================
honoured                   model (any name: the session serves its policy),
                           messages, tools, tool_choice (auto, none, required, a
                           named function), temperature, top_p, max_tokens,
                           max_completion_tokens, stop (up to 4 strings), seed,
                           stream, stream_options.include_usage, logprobs
                           parallel_tool_calls (false: the reply is cut after its
                           first tool call, as if the model had stopped there)
accepted, no effect on     user, metadata, store, service_tier, prompt_cache_key,
the reply                  safety_identifier
only their neutral value   n (1), top_logprobs (0), frequency_penalty and
                           presence_penalty (0), response_format (text),
                           modalities (["text"]), logit_bias ({})
=========================  ====================================================

Refused, among others: reasoning_effort and verbosity (the policy has no such
control), audio, functions/function_call (use tools), a response_format schema.

Messages: roles system, developer (read as system), user, assistant (content and
``tool_calls``) and tool; content as a string or a list of text parts. Tools are
rendered into the prompt as sent, ``function.strict`` included: strict schemas are
not enforced (there is no constrained decoding), so a call the model writes wrong
comes back as text content with finish_reason stop. A streamed
reply is sent when its turn has ended (treadle's engines return whole turns), as
OpenAI's chunks: the role, the content, each tool call, the finish reason, the
usage when asked, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from treadle.agent.chat import Call, Message, Role, ToolChoice, canonical_json
from treadle.gateway.errors import GatewayError, InvalidRequest
from treadle.gateway.session import CallRequest, CallResult

_HONOURED = {"model", "messages", "tools", "tool_choice", "temperature", "top_p",
             "max_tokens", "max_completion_tokens", "stop", "seed", "stream",
             "stream_options", "logprobs", "parallel_tool_calls"}
_NO_EFFECT = {"user", "metadata", "store", "service_tier", "prompt_cache_key",
              "safety_identifier"}
# Parameter -> the one value the gateway serves (a different value would be ignored).
_NEUTRAL: dict[str, Any] = {"n": 1, "top_logprobs": 0, "frequency_penalty": 0,
                            "presence_penalty": 0, "response_format": {"type": "text"},
                            "modalities": ["text"], "logit_bias": {}}
_ROLES: dict[str, Role] = {"system": "system", "developer": "system", "user": "user",
                           "assistant": "assistant", "tool": "tool"}
MAX_STOP = 4  # stop strings, as OpenAI allows
# Characters of message text in one call: tokenizing runs on the event loop, and no
# context a session may hold (max_total_tokens <= 2**20) needs more.
MAX_TEXT_CHARS = 8 << 20


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How to answer a call (what does not change the reply's tokens)."""

    model: str  # echoed in the reply
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    logprobs: bool = False


def parse_chat(body: Any) -> tuple[CallRequest, ChatOptions]:
    """The call a request body asks for; InvalidRequest naming the parameter."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    for key, value in body.items():
        if key in _NEUTRAL:
            if value is not None and value != _NEUTRAL[key]:
                raise InvalidRequest(f"{key}={_short(value)} is not served by treadle's "
                                     f"gateway (only {json.dumps(_NEUTRAL[key])})", param=key)
        elif key not in _HONOURED and key not in _NO_EFFECT:
            raise InvalidRequest(f"unknown parameter {key!r}", param=key)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: a non-empty string is required", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: a non-empty array is required", param="messages")
    tools = _tools(body.get("tools"))
    names = {t["function"]["name"] for t in tools}
    parsed = [_message(m, i) for i, m in enumerate(messages)]
    if sum(len(m.content) + sum(len(c.arguments) for c in m.calls) for m in parsed) \
            > MAX_TEXT_CHARS:
        raise InvalidRequest(f"messages: more than {MAX_TEXT_CHARS:,} characters of text",
                             param="messages")
    # Both checked (an `or` of the two once left max_tokens unchecked beside a valid
    # max_completion_tokens: `true` was taken); the newer name wins.
    newer, older = _positive(body, "max_completion_tokens"), _positive(body, "max_tokens")
    request = CallRequest(
        messages=parsed,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), names),
        max_tokens=older if newer is None else newer,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, open_low=True),
        seed=_seed(body.get("seed")),
        stop=_stop(body.get("stop")),
        one_call=body.get("parallel_tool_calls") is False)
    usage = body.get("stream_options") or {}
    if not isinstance(usage, dict) or set(usage) - {"include_usage"}:
        raise InvalidRequest("stream_options: only include_usage is served",
                             param="stream_options")
    return request, ChatOptions(model, _flag(body, "stream"), bool(usage.get("include_usage")),
                                _flag(body, "logprobs"))


def completion(result: CallResult, options: ChatOptions, call_id: str,
               token_text: Callable[[int], str]) -> dict[str, Any]:
    """The ``chat.completion`` object; `token_text(id)` spells a token for logprobs."""
    message: dict[str, Any] = {"role": "assistant", "content": result.reply.content,
                               "refusal": None}
    if result.reply.calls:
        message["tool_calls"] = _tool_calls(result, call_id)
    choice = {"index": 0, "message": message, "finish_reason": result.finish_reason,
              "logprobs": _logprobs(result, token_text) if options.logprobs else None}
    return {"id": call_id, "object": "chat.completion", "created": int(time.time()),
            "model": options.model, "choices": [choice], "usage": _usage(result)}


def chunks(result: CallResult, options: ChatOptions, call_id: str,
           token_text: Callable[[int], str]) -> Iterator[bytes]:
    """The reply as server-sent events, as OpenAI streams it."""
    head = {"id": call_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": options.model}

    def event(delta: dict[str, Any], finish: str | None = None,
              logprobs: Any = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _sse({**head, "choices": [choice]})

    logprobs = _logprobs(result, token_text) if options.logprobs else None
    yield event({"role": "assistant", "content": ""})
    if result.reply.content:
        yield event({"content": result.reply.content}, logprobs=logprobs)
        logprobs = None
    for k, call in enumerate(_tool_calls(result, call_id)):
        # A reply of calls only carries its logprobs on its first call's chunk.
        yield event({"tool_calls": [{"index": k, **call}]}, logprobs=logprobs)
        logprobs = None
    yield event({}, result.finish_reason)
    if options.include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(result)})
    yield b"data: [DONE]\n\n"


def error_body(error: GatewayError) -> dict[str, Any]:
    """OpenAI's error object for `error`."""
    return {"error": {"message": str(error)[:2000], "type": error.kind,
                      "param": error.param, "code": error.code}}


def models_list(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                        "owned_by": "treadle"}]}


def _sse(value: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(value, ensure_ascii=False).encode() + b"\n\n"


def _tool_calls(result: CallResult, call_id: str) -> list[dict[str, Any]]:
    return [{"id": f"call_{call_id.removeprefix('chatcmpl-')}_{k}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for k, c in enumerate(result.reply.calls)]


def _usage(result: CallResult) -> dict[str, int]:
    n = len(result.output_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n,
            "total_tokens": result.prompt_tokens + n}


def _logprobs(result: CallResult, token_text: Callable[[int], str]) -> dict[str, Any]:
    content = []
    for tid, lp in zip(result.output_ids, result.logprobs, strict=True):
        text = token_text(tid)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": []})
    return {"content": content, "refusal": None}


def _message(value: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where}: must be an object", param=where)
    given = value.get("role")
    role = _ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise InvalidRequest(f"{where}.role: must be one of {', '.join(_ROLES)}, got "
                             f"{_short(given)}", param=f"{where}.role")
    # What SDKs echo back with an assistant message they parsed (annotations are web
    # citations; audio and function_call must be empty).
    allowed = {"role", "content", "name"} | {
        "assistant": {"tool_calls", "refusal", "annotations", "audio", "function_call"},
        "tool": {"tool_call_id"}}.get(role, set())
    extra = sorted(set(value) - allowed)
    extra += [k for k in ("audio", "function_call") if value.get(k) and k not in extra]
    if extra:
        raise InvalidRequest(f"{where}: field {extra[0]!r} is not served for role {role}",
                             param=f"{where}.{extra[0]}")
    content = _content(value.get("content"), f"{where}.content",
                       optional=role == "assistant")
    calls: tuple[Call, ...] = ()
    if role == "assistant" and value.get("tool_calls"):
        calls = tuple(_call(c, f"{where}.tool_calls[{k}]")
                      for k, c in enumerate(_array(value["tool_calls"], f"{where}.tool_calls")))
    return Message(role, content, calls)


def _content(value: Any, where: str, *, optional: bool) -> str:
    if isinstance(value, str):
        return value
    if value is None and optional:
        return ""
    if isinstance(value, list):
        parts = []
        for k, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise InvalidRequest(f"{where}[{k}]: only text parts are served",
                                     param=f"{where}[{k}]")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"{where}: must be a string or an array of text parts", param=where)


def _call(value: Any, where: str) -> Call:
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"{where}: needs function.name", param=where)
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args, parse_constant=_not_a_number) if isinstance(args, str) \
            else args
    except (ValueError, RecursionError):  # not JSON (NaN included), or nested too deep
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{where}.function.arguments: must be a JSON object (as a "
                             "string)", param=f"{where}.function.arguments")
    return Call(fn["name"], canonical_json(parsed))


def _not_a_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    out = []
    for k, tool in enumerate(_array(value, "tools")):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise InvalidRequest(f"tools[{k}]: must be {{\"type\": \"function\", \"function\": "
                                 "{\"name\": ...}}", param=f"tools[{k}]")
        out.append(tool)
    return out


def _tool_choice(value: Any, names: set[str]) -> ToolChoice:
    if value is None or value == "auto":
        return ToolChoice()
    if value in ("none", "required"):
        if value == "required" and not names:
            raise InvalidRequest("tool_choice=required needs tools", param="tool_choice")
        return ToolChoice(value)
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in names:
        raise InvalidRequest("tool_choice: auto, none, required, or {\"type\": \"function\", "
                             "\"function\": {\"name\": <one of the tools>}}",
                             param="tool_choice")
    return ToolChoice("function", name)


def _array(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidRequest(f"{where}: must be an array", param=where)
    return value


def _positive(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= 1 << 20:
        raise InvalidRequest(f"{key}: an integer from 1 to {1 << 20}", param=key)
    return value


def _number(body: Mapping[str, Any], key: str, low: float, high: float, *,
            open_low: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (
        low < value <= high if open_low else low <= value <= high)
    if not ok:
        raise InvalidRequest(f"{key}: a number in {'(' if open_low else '['}{low}, {high}]",
                             param=key)
    return float(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 0 <= value < 1 << 63:
        raise InvalidRequest("seed: a non-negative 64-bit integer", param="seed")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(
            isinstance(s, str) and s for s in stops):
        raise InvalidRequest(f"stop: a non-empty string or up to {MAX_STOP} of them",
                             param="stop")
    return tuple(stops)


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"{key}: must be true or false", param=key)
    return bool(value)


def _short(value: Any) -> str:
    return json.dumps(value, default=str)[:80]


__all__ = ["ChatOptions", "chunks", "completion", "error_body", "models_list", "parse_chat"]
