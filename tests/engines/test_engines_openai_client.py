"""The official `openai` client talks to the emulated engine and to real vLLM as it
talks to any OpenAI-compatible server: the wire format treadle's clients read is the
one the ecosystem's own client reads."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from openai import AsyncOpenAI

from treadle.core.cost_model import CostModel
from treadle.engines.emulated import EmulatedEngine
from treadle.engines.emulated_server import RunningEngine, serve_in_thread
from vllm_server import MODEL, VLLMServer


@pytest.fixture(scope="module")
def emulated() -> Iterator[RunningEngine]:
    engine = EmulatedEngine(CostModel.named("qwen3-14b", "h100"), time_scale=0.05, seed=2)
    with serve_in_thread(engine, "qwen3-14b-emulated") as running:
        yield running


async def _complete(base_url: str, model: str) -> object:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    try:
        return await client.completions.create(
            model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=1.0, logprobs=1,
            extra_body={"return_token_ids": True})
    finally:
        await client.close()


def _check(reply: object, model: str) -> None:
    r = reply  # an openai.types.Completion
    choice = r.choices[0]  # type: ignore[attr-defined]
    ids = choice.model_extra["token_ids"]  # vLLM's extension, kept by the client
    assert r.model == model and choice.finish_reason == "length"  # type: ignore[attr-defined]
    assert len(ids) == 6 and len(choice.logprobs.token_logprobs) == 6
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 6  # type: ignore[attr-defined]


def test_the_openai_client_reads_the_emulated_engine(emulated: RunningEngine) -> None:
    _check(asyncio.run(_complete(emulated.url, emulated.model)), emulated.model)


@pytest.mark.integration
@pytest.mark.slow
def test_the_openai_client_reads_real_vllm(vllm_server: VLLMServer) -> None:
    _check(asyncio.run(_complete(vllm_server.url, MODEL)), MODEL)
