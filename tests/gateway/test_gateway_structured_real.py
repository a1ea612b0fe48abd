"""Structured output on REAL vLLM (CPU build) serving the small trained model: a
request's json_schema constraint, sent by `VLLMEngine` as vLLM's
``structured_outputs``, is decoded under — the reply is JSON valid against the
schema, ended by the chat format's stop token, with vLLM's logprob for every
sampled id. (The engine of the gateway's `served` fixture: one vLLM for the
session, launched as treadle launches vLLM, JSON compact: `VLLMProcess.compact_json`.)

The schema's values are bounded (an enum, a boolean): the small model never learnt
JSON, and a value it may extend without end (an integer, a string) it does extend
to its token budget; the grammar is what this checks, not the model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from gateway.gateway_real import Served
from treadle.engines.base import GenerateRequest, GenerateResult
from treadle.engines.vllm import VLLMEngine
from treadle.types import JsonSchemaConstraint

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["apples", "pears"]},
                                           "many": {"type": "boolean"}},
          "required": ["unit", "many"], "additionalProperties": False}
PROMPT = ("<|im_start|>user\nI had 6 bags of 7 apples. How many apples? Answer in "
          "JSON.<|im_end|>\n<|im_start|>assistant\n")


def test_vllm_decodes_under_a_json_schema_with_a_logprob_per_id(
        served: Served, trained_checkpoint: Path) -> None:
    constraint = JsonSchemaConstraint(SCHEMA, "count")
    tokenizer = Tokenizer.from_file(str(trained_checkpoint / "tokenizer.json"))
    stop = tokenizer.token_to_id("<|im_end|>")
    served_by = served.engine.inner  # the service's client (its own event loop's)
    assert isinstance(served_by, VLLMEngine)

    async def sample() -> tuple[list[GenerateResult], int | None]:
        async with VLLMEngine(served_by.base_url, served_by.model) as engine:
            return [await engine.generate(GenerateRequest(
                f"structured-{seed}", tokenizer.encode(PROMPT).ids, max_tokens=96,
                temperature=1.0, seed=seed, stop_token_ids=[stop], constraint=constraint))
                for seed in range(4)], await engine.context_window()

    results, window = asyncio.run(sample())
    assert window == 1024  # the served max_model_len
    for result in results:  # sampled at T=1: each draw must still fit
        ids, logprobs, finish = result.output_ids, result.logprobs, result.finish_reason
        assert finish == "stop", (finish, tokenizer.decode(ids, skip_special_tokens=False))
        assert len(logprobs) == len(ids) and all(lp <= 0.0 for lp in logprobs)
        assert ids[-1] == stop  # the grammar ends where the chat format's turn ends
        jsonschema.validate(json.loads(tokenizer.decode(ids[:-1], skip_special_tokens=False)),
                            SCHEMA)
