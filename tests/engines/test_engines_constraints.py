"""Structured output on the engine side: a request's constraint as each engine's wire
takes it (vLLM's `structured_outputs`, SGLang's `sampling_params.json_schema`), the
kinds each engine declares, and engines without a grammar refusing a constraint
instead of sampling freely (TorchEngine's refusal: tests/train/test_train_engine.py);
and the context an engine serves (`context_window`).
The constraint decoded by real vLLM: tests/gateway/test_gateway_structured_real.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from treadle.core.cost_model import CostModel
from treadle.engines import EngineRequestError, GenerateRequest
from treadle.engines.base import EngineCapabilities
from treadle.engines.emulated import EmulatedEngine
from treadle.engines.emulated_client import EmulatedEngineClient
from treadle.engines.emulated_server import serve_in_thread
from treadle.engines.sglang import SGLangEngine, generate_body
from treadle.engines.vllm import VLLMEngine, completion_body
from treadle.types import ConstraintKind, JsonObjectConstraint, JsonSchemaConstraint

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"], "additionalProperties": False}
BOTH = frozenset({ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT})


def _req(constraint: JsonSchemaConstraint | JsonObjectConstraint | None) -> GenerateRequest:
    return GenerateRequest("r", [1, 2, 3], max_tokens=8, constraint=constraint)


def test_vllm_takes_the_constraint_as_its_structured_outputs() -> None:
    assert "structured_outputs" not in completion_body(_req(None), "m")
    assert completion_body(_req(JsonSchemaConstraint(SCHEMA, "answer")), "m")[
        "structured_outputs"] == {"json": SCHEMA}
    assert completion_body(_req(JsonObjectConstraint()), "m")["structured_outputs"] == {
        "json_object": True}


def test_sglang_takes_the_constraint_as_a_json_schema_string() -> None:
    assert "json_schema" not in generate_body(_req(None))["sampling_params"]
    params = generate_body(_req(JsonSchemaConstraint(SCHEMA)))["sampling_params"]
    assert json.loads(params["json_schema"]) == SCHEMA
    # Any JSON object: the schema SGLang's own OpenAI server sends for json_object.
    params = generate_body(_req(JsonObjectConstraint()))["sampling_params"]
    assert json.loads(params["json_schema"]) == {"type": "object"}


def test_each_engine_declares_the_kinds_it_decodes_under() -> None:
    assert VLLMEngine("http://127.0.0.1:9", "m").capabilities.constraints == BOTH
    assert SGLangEngine("http://127.0.0.1:9").capabilities.constraints == BOTH
    emulated = EmulatedEngineClient("http://127.0.0.1:9", "m").capabilities
    assert emulated.constraints == frozenset() and emulated.weight_updates
    none = EngineCapabilities()
    assert none.refusal(None) is None
    assert none.refusal(JsonObjectConstraint()) == (
        "the engine cannot decode under a json_object constraint (structured output it "
        "serves: none)")
    assert EngineCapabilities(constraints=BOTH).refusal(JsonSchemaConstraint(SCHEMA)) is None


@pytest.mark.parametrize("constraint", [JsonSchemaConstraint(SCHEMA), JsonObjectConstraint()])
def test_the_emulated_engine_refuses_a_constraint(
        constraint: JsonSchemaConstraint | JsonObjectConstraint) -> None:
    engine = EmulatedEngine(CostModel.named("qwen3-8b", "h100"), time_scale=0.01, seed=1)

    async def main(url: str, model: str) -> None:
        async with EmulatedEngineClient(url, model) as client:
            with pytest.raises(EngineRequestError, match="no structured-output constraint"):
                await client.generate(_req(constraint))
            assert (await client.generate(_req(None))).output_ids  # unconstrained: served

    with serve_in_thread(engine, "m") as srv:
        asyncio.run(main(srv.url, srv.model))


def test_an_engine_says_how_long_a_context_it_serves() -> None:
    engine = EmulatedEngine(CostModel.named("qwen3-8b", "h100"), time_scale=0.01, seed=1,
                            max_model_len=3000)

    async def main(url: str, model: str) -> None:
        async with EmulatedEngineClient(url, model) as client:
            assert await client.context_window() == 3000
        async with VLLMEngine(url, "another-model") as other:
            assert await other.context_window() is None  # not the model it serves
        async with VLLMEngine("http://127.0.0.1:9", "m") as nowhere:
            assert await nowhere.context_window() is None  # cannot tell: never raises

    with serve_in_thread(engine, "m") as srv:
        asyncio.run(main(srv.url, srv.model))
