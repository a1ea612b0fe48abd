"""The body of ``POST /chat/completions`` as the gateway serves it: one pydantic model
(`ChatRequest`), which `wire.parse_chat` validates every body with and from which the
route's OpenAPI schema is generated (`openapi_schema`), so the two cannot disagree.

Strict: no value is coerced (``"1"`` is no integer, ``1`` no boolean), and a key
the gateway does not know is refused, at the top level and in a message (each role
has its own fields). What a JSON schema cannot say is checked after the model, by
`wire.parse_chat`: a named ``tool_choice`` must name one of the ``tools``,
``required`` needs tools, a tool call's ``arguments`` must be a JSON object, the
messages' text is bounded.

Parameters with one neutral value (``n`` 1, ``top_logprobs`` 0, the penalties 0,
``modalities`` ``["text"]``, ``logit_bias`` ``{}``) take only it. Tool specs, tool
calls and a JSON schema's body are the harness's: their own keys pass as sent.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field

MAX_TOKENS = 1 << 20  # max_tokens, max_completion_tokens: no context a session holds is longer
MAX_STOP = 4  # stop strings, as OpenAI allows
MAX_SEED = (1 << 63) - 1

# Parameter -> the one value the gateway serves (any other would change nothing).
NEUTRAL: dict[str, Any] = {"n": 1, "top_logprobs": 0, "frequency_penalty": 0,
                           "presence_penalty": 0, "modalities": ["text"], "logit_bias": {}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Open(BaseModel):
    """An object whose other keys are the harness's own (kept as sent)."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart], Field(
    description="a string or an array of text parts")]


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = Field(
        default="{}", description="a JSON object (as a string)")


class ToolCall(_Open):
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system", "developer"]  # developer is read as system
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Strict):
    """An assistant message, with what SDKs echo back with one they parsed."""

    role: Literal["assistant"]
    content: Content | None = Field(
        default=None, description="a string or an array of text parts, or null")
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None  # web citations: not rendered
    audio: None = None  # echoed as null by SDKs; audio is not served
    function_call: None = None  # likewise (use tool_calls)


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    name: str | None = None
    tool_call_id: str | None = None


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage,
                    Field(discriminator="role")]


class FunctionSpec(_Open):
    name: str = Field(min_length=1)


class Tool(_Open):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    # "schema" shadows a BaseModel attribute: the alias is the wire's name.
    json_schema: dict[str, Any] = Field(alias="schema",
                                        description="the JSON schema the reply must match")
    strict: bool | None = None  # the reply always matches: it is decoded under the schema


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]


class StreamOptions(_Strict):
    include_usage: bool | None = None


def _only(value: Any) -> str:
    return f"only {json.dumps(value)}"


class ChatRequest(_Strict):
    """What the gateway serves of OpenAI's chat-completions request."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True,
                              title="ChatCompletionRequest")

    model: str = Field(min_length=1, description="a non-empty string (any name: the session "
                                                 "serves its policy)")
    messages: list[Message] = Field(min_length=1, description="a non-empty array of messages")
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = Field(
        default=None, description='auto, none, required, or {"type": "function", "function": '
                                  '{"name": <one of the tools>}}')
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = Field(
        default=None, description=f"a non-empty string or up to {MAX_STOP} of them")
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: the reply is cut after its first tool call")
    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object or json_schema: the reply is decoded "
                                  "under the format by the engine")
    # Accepted, no effect on the reply.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Only their neutral value.
    n: int | None = Field(default=None, ge=1, le=1, description=_only(NEUTRAL["n"]))
    top_logprobs: int | None = Field(default=None, ge=0, le=0,
                                     description=_only(NEUTRAL["top_logprobs"]))
    frequency_penalty: float | None = Field(default=None, ge=0, le=0,
                                            description=_only(NEUTRAL["frequency_penalty"]))
    presence_penalty: float | None = Field(default=None, ge=0, le=0,
                                           description=_only(NEUTRAL["presence_penalty"]))
    modalities: list[Literal["text"]] | None = Field(default=None, min_length=1, max_length=1,
                                                     description=_only(NEUTRAL["modalities"]))
    logit_bias: dict[str, int] | None = Field(default=None, max_length=0,
                                              description=_only(NEUTRAL["logit_bias"]))


def descriptions() -> dict[str, str]:
    """Each described field of `ChatRequest` by its path, indices left out
    (``messages[].content``): what a refusal of its value says."""
    out: dict[str, str] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            path = f"{prefix}{info.alias or name}"
            if info.description and path not in out:
                out[path] = info.description
            for inner, listed in _models_in(info.annotation):
                walk(inner, f"{path}[]." if listed else f"{path}.")

    walk(ChatRequest, "")
    return out


def _models_in(annotation: Any, listed: bool = False) -> list[tuple[type[BaseModel], bool]]:
    """The models an annotation holds, each with whether it is a list's item."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, listed)]
    inner = listed or get_origin(annotation) is list
    return [found for arg in get_args(annotation) for found in _models_in(arg, inner)]


def openapi_schema() -> dict[str, Any]:
    """`ChatRequest`'s JSON schema with its definitions inlined (an OpenAPI request
    body cannot point into a ``$defs`` of its own)."""
    schema = ChatRequest.model_json_schema(by_alias=True)
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            # The discriminator's mapping points at the definitions: the members'
            # constant roles (types) already tell them apart.
            return {k: inline(v) for k, v in node.items() if k != "discriminator"}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    out: dict[str, Any] = inline(schema)
    return out


__all__ = ["MAX_STOP", "MAX_TOKENS", "NEUTRAL", "ChatRequest", "JsonObjectFormat",
           "JsonSchemaFormat", "TextFormat", "descriptions", "openapi_schema"]
