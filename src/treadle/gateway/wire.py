"""The OpenAI chat-completions wire: the request as a `CallRequest`, the replies and
the errors as OpenAI's SDKs parse them.

A body is validated by one model, `chat_request.ChatRequest`, from which the
route's OpenAPI schema is generated; then for what a schema cannot say (a named
tool_choice among the tools, tool-call arguments a JSON object, the text's size).
A refusal is a 400 naming the parameter (``messages[2].content``) and the value
refused in full (or its size, past `MAX_NAMED_CHARS`: never cut mid-value).

Parameters (anything else is a 400 naming it — never silently ignored):

=========================  ====================================================
honoured                   model (any name: the session serves its policy),
                           messages, tools, tool_choice (auto, none, required, a
                           named function), temperature, top_p, max_tokens,
                           max_completion_tokens, stop (up to 4 strings), seed,
                           stream, stream_options.include_usage, logprobs
                           parallel_tool_calls (false: the reply is cut after its
                           first tool call, as if the model had stopped there),
                           response_format (text, json_object, json_schema: the
                           call's constraint, which the engine decodes the
                           reply under; `gateway.session` says when it is
                           refused)
accepted, no effect on     user, metadata, store, service_tier, prompt_cache_key,
the reply                  safety_identifier
only their neutral value   n (1), top_logprobs (0), frequency_penalty and
                           presence_penalty (0), modalities (["text"]),
                           logit_bias ({})
=========================  ====================================================

Refused, among others: reasoning_effort and verbosity (the policy has no such
control), audio, functions/function_call (use tools).

Messages: roles system, developer (read as system), user, assistant (content and
``tool_calls``) and tool; content as a string or a list of text parts. Tools are
rendered into the prompt as sent, ``function.strict`` included: strict schemas are
not enforced (tool calls are not decoded under their schemas), so a call the model
writes wrong comes back as text content with finish_reason stop. A streamed
reply is sent when its turn has ended (treadle's engines return whole turns), as
OpenAI's chunks: the role, the content, each tool call, the finish reason, the
usage when asked, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from treadle.agent.chat import Call, Message, Role, ToolChoice, canonical_json
from treadle.engines.errors import public_text
from treadle.gateway import chat_request as schema
from treadle.gateway.errors import GatewayError, InvalidRequest
from treadle.gateway.session import CallRequest, CallResult
from treadle.types import JsonObjectConstraint, JsonSchemaConstraint, OutputConstraint

_ROLES: dict[str, Role] = {"system": "system", "developer": "system", "user": "user",
                           "assistant": "assistant", "tool": "tool"}
MAX_STOP = schema.MAX_STOP
# Characters of message text in one call: tokenizing runs on the event loop, and no
# context a session may hold (max_total_tokens <= 2**20) needs more.
MAX_TEXT_CHARS = 8 << 20
# A refused value longer than this (as JSON) is named by its size, not cut mid-value.
MAX_NAMED_CHARS = 1000
_DESCRIBED = schema.descriptions()
# Where the request's unions are told apart by a field (the member's name is in an
# error's location, after the object's own).
_TAGGED = {"messages[]": "role", "response_format": "type"}


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How to answer a call (what does not change the reply's tokens)."""

    model: str  # echoed in the reply
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    logprobs: bool = False


def parse_chat(body: Any) -> tuple[CallRequest, ChatOptions]:
    """The call a request body asks for (its response_format as the constraint its
    reply is decoded under) and how to answer it; InvalidRequest naming the
    parameter. The body is validated by `chat_request.ChatRequest` (the route's
    OpenAPI schema), then for what a schema cannot say."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    for key in body:
        if key not in schema.ChatRequest.model_fields:
            raise InvalidRequest(f"unknown parameter {key!r}", param=key)
    try:
        chat = schema.ChatRequest.model_validate(body)
    except ValidationError as e:
        raise _refusal(e, body) from None
    tools: list[dict[str, Any]] = list(body.get("tools") or [])  # rendered as sent
    names = {t.function.name for t in chat.tools or []}
    parsed = [_message(m, f"messages[{i}]") for i, m in enumerate(chat.messages)]
    if sum(len(m.content) + sum(len(c.arguments) for c in m.calls) for m in parsed) \
            > MAX_TEXT_CHARS:
        raise InvalidRequest(f"messages: more than {MAX_TEXT_CHARS:,} characters of text",
                             param="messages")
    request = CallRequest(
        messages=parsed,
        tools=tools,
        tool_choice=_tool_choice(chat.tool_choice, names),
        max_tokens=chat.max_completion_tokens or chat.max_tokens,
        temperature=None if chat.temperature is None else float(chat.temperature),
        top_p=None if chat.top_p is None else float(chat.top_p),
        seed=chat.seed,
        stop=(chat.stop,) if isinstance(chat.stop, str) else tuple(chat.stop or ()),
        one_call=chat.parallel_tool_calls is False,
        constraint=_constraint(chat.response_format))
    usage = chat.stream_options
    options = ChatOptions(chat.model, bool(chat.stream),
                          bool(usage is not None and usage.include_usage), bool(chat.logprobs))
    return request, options


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
    """OpenAI's error object for `error`; its message shows no engine's address
    (`engines.errors.public_text`: the logs have them)."""
    return {"error": {"message": public_text(str(error))[:2000], "type": error.kind,
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


def _message(value: schema.SystemMessage | schema.UserMessage | schema.AssistantMessage
             | schema.ToolMessage, where: str) -> Message:
    calls: tuple[Call, ...] = ()
    if isinstance(value, schema.AssistantMessage) and value.tool_calls:
        calls = tuple(_call(c, f"{where}.tool_calls[{k}]")
                      for k, c in enumerate(value.tool_calls))
    content = value.content
    text = "" if content is None else content if isinstance(content, str) else "".join(
        part.text for part in content)
    return Message(_ROLES[value.role], text, calls)


def _call(value: schema.ToolCall, where: str) -> Call:
    args = value.function.arguments
    try:
        parsed = json.loads(args, parse_constant=_not_a_number) if isinstance(args, str) \
            else args
    except (ValueError, RecursionError):  # not JSON (NaN included), or nested too deep
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{where}.function.arguments: must be a JSON object (as a "
                             f"string), got {_named(args)}", param=f"{where}.function.arguments")
    return Call(value.function.name, canonical_json(parsed))


def _not_a_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _tool_choice(value: str | schema.NamedToolChoice | None, names: set[str]) -> ToolChoice:
    if value is None or value == "auto":
        return ToolChoice()
    if value == "none":
        return ToolChoice("none")
    if value == "required":
        if not names:
            raise InvalidRequest("tool_choice=required needs tools", param="tool_choice")
        return ToolChoice("required")
    assert isinstance(value, schema.NamedToolChoice)  # the model's last member
    if value.function.name not in names:
        raise InvalidRequest(f"tool_choice: names {value.function.name!r}, which is not one "
                             "of the tools", param="tool_choice")
    return ToolChoice("function", value.function.name)


def _constraint(value: schema.TextFormat | schema.JsonObjectFormat | schema.JsonSchemaFormat
                | None) -> OutputConstraint | None:
    match value:
        case schema.JsonSchemaFormat(json_schema=spec):
            return JsonSchemaConstraint(spec.json_schema, spec.name)
        case schema.JsonObjectFormat():
            return JsonObjectConstraint()
        case _:
            return None


def _refusal(error: ValidationError, body: dict[str, Any]) -> InvalidRequest:
    """The first thing `error` finds wrong, as a 400 naming the parameter (OpenAI's
    ``messages[2].content``) and the value refused, in full."""
    located = [(*_where(i["loc"], body), i) for i in error.errors(include_url=False)]
    first = located[0][0]
    # A union tries each of its members: of the issues at the first one's parameter,
    # the deepest says most.
    param, path, issue = max(
        (x for x in located if x[0] == first or x[0].startswith((f"{first}.", f"{first}["))),
        key=lambda x: len(x[0]))
    kind, value = issue["type"], issue.get("input")
    if path.startswith("messages[]"):
        refused = _message_refusal(param, kind, body)
        if refused is not None:
            return refused
    if param == "response_format" and kind.startswith("union_tag"):
        return InvalidRequest("response_format: its type must be text, json_object or "
                              "json_schema, got "
                              f"{_named(_get(body, 'response_format', 'type'))}",
                              param="response_format")
    described = _DESCRIBED.get(path)
    if param in schema.NEUTRAL:
        return InvalidRequest(f"{param}={_named(value)} is not served by treadle's gateway "
                              f"({described})", param=param)
    if kind == "extra_forbidden":
        within, _, name = param.rpartition(".")
        return InvalidRequest(f"{within}: field {name!r} is not served", param=param)
    why = described or issue["msg"][:1].lower() + issue["msg"][1:]
    if kind == "missing":
        return InvalidRequest(f"{param}: required ({why})" if described
                              else f"{param}: required", param=param)
    return InvalidRequest(f"{param}: {why}, got {_named(value)}", param=param)


def _message_refusal(param: str, kind: str, body: dict[str, Any]) -> InvalidRequest | None:
    """What is wrong with a message, in the words the gateway has always used."""
    where = param[:param.index("]") + 1]  # messages[i]
    role = _get(body, *_indices(where), "role")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return InvalidRequest(f"{where}.role: must be one of {', '.join(_ROLES)}, got "
                              f"{_named(role)}", param=f"{where}.role")
    if kind in ("extra_forbidden", "none_required") and param.count(".") == 1:
        return InvalidRequest(f"{where}: field {param.rpartition('.')[2]!r} is not served "
                              f"for role {role}", param=param)
    part = re.match(r"messages\[\d+\]\.content\[\d+\]", param)
    if part is not None:
        return InvalidRequest(f"{part[0]}: only text parts are served, got "
                              f"{_named(_get(body, *_indices(part[0])))}", param=part[0])
    return None


def _where(loc: tuple[int | str, ...], body: Any) -> tuple[str, str]:
    """An error's location as OpenAI names the parameter (``messages[2].content``)
    and as `chat_request.descriptions` keys it (``messages[].content``): the members
    of a union that the location names are left out, found by walking the body."""
    node, param, path, tagged = body, "", "", None
    for k, part in enumerate(loc):
        last = k == len(loc) - 1
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            node, param, path = node[part], f"{param}[{part}]", f"{path}[]"
            continue
        if not (isinstance(part, str) and isinstance(node, dict)):
            continue  # a union member's label (under a value that is no object)
        tag = _TAGGED.get(path)
        if tag is not None and tagged != path and not last and node.get(tag) == part:
            tagged = path  # the member of a tagged union, named by its tag
            continue
        if part in node or last:  # a key, or the name of a missing one
            node = node.get(part)
            param = f"{param}.{part}" if param else part
            path = f"{path}.{part}" if path else part
    return param, path


def _indices(param: str) -> list[str | int]:
    """``messages[2].content[0]`` as keys and indices to `_get` it."""
    keys: list[str | int] = []
    for piece in param.replace("]", "").split("."):
        name, *indices = piece.split("[")
        keys += [name, *map(int, indices)]
    return keys


def _get(body: Any, *keys: str | int) -> Any:
    for key in keys:
        if isinstance(body, dict) and isinstance(key, str):
            body = body.get(key)
        elif isinstance(body, list) and isinstance(key, int) and 0 <= key < len(body):
            body = body[key]
        else:
            return None
    return body


def _named(value: Any) -> str:
    """`value` in full as JSON, or its size where that is longer than a message
    should carry (never cut mid-value)."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    if len(text) <= MAX_NAMED_CHARS:
        return text
    return f"a {type(value).__name__} of {len(text):,} characters as JSON"


__all__ = ["ChatOptions", "chunks", "completion", "error_body", "models_list", "parse_chat"]
