"""vLLM's token API (`/inference/v1/generate`): the body sent and the reply read.

Against the real server in tests/runtime/test_runtime_vllm_real.py (a call frozen
across a "keep" update); here, what the client makes of each field.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from treadle.engines.base import GenerateRequest, VersionSpan
from treadle.engines.errors import EngineProtocolError, EngineRequestError
from treadle.engines.vllm import VLLMEngine
from treadle.engines.vllm_tokens import TokensReply, generate_body, parse_tokens_reply

REQUEST = GenerateRequest("t1-turn0", [5, 6, 7], max_tokens=3, stop_token_ids=(2,), seed=4,
                          priority=9, cache_salt="policy-3-x")


def _reply(**choice: Any) -> TokensReply:
    base: dict[str, Any] = {
        "finish_reason": "length", "token_ids": [11, 12, 13],
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5, "rank": 1,
                                  "top_logprobs": []} for t in (11, 12, 13)]},
        "weight_versions": [{"version": "default", "start": 0, "end": 2},
                            {"version": "4", "start": 2, "end": 3}]}
    raw = {"request_id": "x", "choices": [{**base, **choice}],
           "usage": {"prompt_tokens": 3, "total_tokens": 6,
                     "prompt_tokens_details": {"cached_tokens": 2}}}
    return msgspec.json.decode(msgspec.json.encode(raw), type=TokensReply)


def test_the_body_carries_vllms_sampling_params_and_the_salt() -> None:
    body = generate_body(REQUEST, "m", None)
    assert body["token_ids"] == [5, 6, 7] and body["model"] == "m"
    assert body["cache_salt"] == "policy-3-x" and body["priority"] == 9
    sampling = body["sampling_params"]
    assert sampling["max_tokens"] == 3 and sampling["seed"] == 4
    assert sampling["stop_token_ids"] == [2] and sampling["logprobs"] == 0
    assert sampling["detokenize"] is False and "structured_outputs" not in sampling


def test_a_reply_gives_ids_logprobs_and_which_weights_sampled_them() -> None:
    result = parse_tokens_reply(_reply(), REQUEST, 0.25)
    assert result.output_ids == [11, 12, 13] and result.logprobs == [-0.5] * 3
    # vLLM's "default" is the weights it started with: never labelled.
    assert result.version_spans == (VersionSpan(None, 0, 2), VersionSpan("4", 2, 3))
    assert (result.prompt_tokens, result.cached_tokens) == (3, 2)


@pytest.mark.parametrize("choice, field", [
    ({"weight_versions": None}, "weight_versions"),
    ({"weight_versions": [{"version": "4", "start": 0, "end": 2}]}, "weight_versions"),
    ({"logprobs": {"content": [{"token_id": 11, "logprob": -1.0}]}}, "logprobs"),
    ({"token_ids": None}, "token_ids"),
    ({"finish_reason": None}, "finish_reason"),
])
def test_a_reply_that_does_not_account_for_every_token_is_a_protocol_error(
        choice: dict[str, Any], field: str) -> None:
    with pytest.raises(EngineProtocolError, match=field):
        parse_tokens_reply(_reply(**choice), REQUEST, 0.1)


def test_keep_is_declared_only_with_the_token_api() -> None:
    assert "keep" not in VLLMEngine("http://h:1", "m").capabilities.pause_modes
    assert "keep" in VLLMEngine("http://h:1", "m", tokens_api=True).capabilities.pause_modes


def test_a_keep_update_without_the_token_api_is_refused() -> None:
    async def main() -> None:
        engine = VLLMEngine("http://h:1", "m")
        try:
            with pytest.raises(EngineRequestError, match="keep"):
                await engine.update_weights("/w", 3, "keep")
        finally:
            await engine.aclose()

    asyncio.run(main())
