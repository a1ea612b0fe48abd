"""The chat-completions body: the OpenAPI schema the route declares is generated from
the model `wire.parse_chat` validates with, so the schema accepts what the parser
accepts and refuses what it refuses (a table of bodies, each checked both ways);
what no JSON schema can say is refused by the parser alone (a second table). Each
refusal names the parameter, and the value in full."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from treadle.gateway.chat_request import openapi_schema
from treadle.gateway.errors import InvalidRequest
from treadle.gateway.wire import parse_chat
from treadle.types import JsonObjectConstraint, JsonSchemaConstraint

VALIDATOR = jsonschema.Draft202012Validator(openapi_schema())
USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "python", "description": "run code",
                                         "parameters": {"type": "object"}, "strict": True}}
CALL = {"id": "c1", "type": "function",
        "function": {"name": "python", "arguments": '{"code": "1"}'}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def body(**more: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": [USER], **more}


# (body, the parameter a refusal names; None: served)
TABLE: list[tuple[dict[str, Any], str | None]] = [
    (body(), None),
    (body(tools=[TOOL], tool_choice="required"), None),
    (body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "python"}}),
     None),
    (body(tools=[TOOL] * 9), None),  # no cap on the number of tools
    (body(stop="\n\n"), None),  # one stop string, not in a list
    (body(stop=["a", "b", "c", "d"]), None),
    (body(stop=["a", "b", "c", "d", "e"]), "stop"),
    (body(stop=""), "stop"),
    (body(messages=[USER, {"role": "assistant", "content": None, "tool_calls": [CALL],
                           "refusal": None, "audio": None, "function_call": None},
                    {"role": "tool", "tool_call_id": "c1", "content": "1"}]), None),
    (body(messages=[{"role": "developer", "content": [{"type": "text", "text": "be"}]},
                    USER]), None),
    (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0]"),
    (body(messages=[{"role": "function", "content": "x"}]), "messages[0].role"),
    (body(messages=[{"content": "x"}]), "messages[0].role"),
    (body(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
     "messages[0].tool_calls"),
    (body(messages=[{"role": "assistant", "content": "x", "audio": {"id": "a"}}]),
     "messages[0].audio"),
    (body(messages=[{"role": "user"}]), "messages[0].content"),
    (body(messages=[]), "messages"),
    ({"messages": [USER]}, "model"),
    (body(model=""), "model"),
    (body(tool_choice="any"), "tool_choice"),
    (body(temperature=2), None),
    (body(temperature=2.5), "temperature"),
    (body(temperature=True), "temperature"),
    (body(top_p=0), "top_p"),
    (body(max_tokens=0), "max_tokens"),
    (body(max_completion_tokens="5"), "max_completion_tokens"),
    (body(seed=-1), "seed"),
    (body(stream=1), "stream"),
    (body(stream=True, stream_options={"include_usage": True}), None),
    (body(stream_options={"include_obfuscation": False}), "stream_options.include_obfuscation"),
    (body(n=1, top_logprobs=0, frequency_penalty=0.0, presence_penalty=0,
          modalities=["text"], logit_bias={}), None),
    (body(n=2), "n"),
    (body(logit_bias={"50256": -100}), "logit_bias"),
    (body(user="u", metadata={"k": "v"}, store=False, service_tier="auto",
          prompt_cache_key="p", safety_identifier="s"), None),
    (body(response_format={"type": "text"}), None),
    (body(response_format={"type": "json_object"}), None),
    (body(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA, "strict": True}}), None),
    (body(response_format={"type": "json_schema", "json_schema": {"name": "answer"}}),
     "response_format.json_schema.schema"),
    (body(response_format={"type": "structural_tag", "format": {}}), "response_format"),
    (body(reasoning_effort="low"), "reasoning_effort"),
    (body(functions=[]), "functions"),
]


@pytest.mark.parametrize(("sent", "refused"), TABLE)
def test_the_schema_and_the_parser_agree(sent: dict[str, Any], refused: str | None) -> None:
    schema_ok = VALIDATOR.is_valid(sent)
    try:
        parse_chat(sent)
    except InvalidRequest as e:
        assert (e.param, schema_ok) == (refused, False), str(e)
    else:
        assert (None, schema_ok) == (refused, True)


# Valid by the schema, refused by what the parser checks beyond it.
BEYOND: list[tuple[dict[str, Any], str]] = [
    (body(tool_choice="required"), "tool_choice"),  # no tools
    (body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "other"}}),
     "tool_choice"),
    (body(messages=[{"role": "assistant", "tool_calls": [
        {"function": {"name": "python", "arguments": "[1]"}}]}]),
     "messages[0].tool_calls[0].function.arguments"),
    (body(messages=[{"role": "user", "content": "x" * ((8 << 20) + 1)}]), "messages"),
]


@pytest.mark.parametrize(("sent", "refused"), BEYOND)
def test_what_no_schema_says_is_refused_by_the_parser(sent: dict[str, Any],
                                                      refused: str) -> None:
    assert VALIDATOR.is_valid(sent)
    with pytest.raises(InvalidRequest) as e:
        parse_chat(sent)
    assert e.value.param == refused


def test_a_refusal_names_the_value_in_full() -> None:
    value = {"type": "structural_tag", "format": {"type": "triggered_tags",
                                                  "triggers": ["<function=" + "x" * 120]}}
    with pytest.raises(InvalidRequest) as e:
        parse_chat(body(response_format=value))
    assert '"structural_tag"' in str(e.value)
    bias = {str(k): -100 for k in range(12)}  # ~150 characters: once cut at 80
    with pytest.raises(InvalidRequest) as e:
        parse_chat(body(logit_bias=bias))
    assert str(e.value) == (f"logit_bias={__import__('json').dumps(bias)} is not served by "
                            "treadle's gateway (only {})")
    with pytest.raises(InvalidRequest) as e:  # too long to carry: named by its size
        parse_chat(body(logit_bias={str(k): 1 for k in range(500)}))
    assert "characters as JSON" in str(e.value) and "…" not in str(e.value)


def test_response_format_becomes_the_constraint_of_the_call() -> None:
    assert parse_chat(body(response_format={"type": "text"}))[0].constraint is None
    assert parse_chat(body())[0].constraint is None
    assert parse_chat(body(response_format={"type": "json_object"}))[0].constraint == \
        JsonObjectConstraint()
    sent = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    assert parse_chat(body(response_format=sent))[0].constraint == \
        JsonSchemaConstraint(SCHEMA, "answer")
