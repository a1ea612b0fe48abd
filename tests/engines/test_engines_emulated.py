"""The emulated engine, for real over HTTP on 127.0.0.1, driven by the vLLM client.

Timing assertions compare ratios with generous margins, never absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator

import httpx
import pytest

from treadle.core.cost_model import CostModel
from treadle.engines import EngineRequestError, GenerateRequest, GenerateResult
from treadle.engines.cli import add_engine_parser, run_emulate
from treadle.engines.emulated import BLOCK, VOCAB, EmulatedEngine, PrefixCache
from treadle.engines.emulated_server import RunningEngine, serve_in_thread
from treadle.engines.vllm import VLLMEngine

COST = CostModel.named("qwen3-8b", "h100")


@pytest.fixture
def emulated() -> Iterator[RunningEngine]:
    with serve_in_thread(EmulatedEngine(COST, time_scale=0.05, seed=1),
                         "qwen3-8b-emulated") as srv:
        yield srv


def _engine(srv: RunningEngine) -> VLLMEngine:
    return VLLMEngine(srv.url, srv.model)


def test_token_ids_logprobs_and_model_name(emulated: RunningEngine) -> None:
    async def main() -> list[GenerateResult]:
        async with _engine(emulated) as engine:
            return [await engine.generate(GenerateRequest(f"r{i}", [1, 2, 3], max_tokens=20))
                    for i in range(2)]

    a, b = asyncio.run(main())
    for r in (a, b):
        assert r.finish_reason == "length" and len(r.output_ids) == len(r.logprobs) == 20
        assert all(0 <= t < VOCAB for t in r.output_ids) and all(lp <= 0 for lp in r.logprobs)
        assert r.prompt_tokens == 3 and r.queued_s is not None and r.queued_s >= 0
    assert a.output_ids != b.output_ids  # siblings differ
    models = httpx.get(f"{emulated.url}/v1/models").json()
    assert models["data"][0]["id"] == "qwen3-8b-emulated"


def test_same_seed_same_tokens() -> None:
    outs = []
    for _ in range(2):
        with serve_in_thread(EmulatedEngine(COST, time_scale=0.01, seed=7), "m") as srv:
            async def main(srv: RunningEngine = srv) -> list[int]:
                async with VLLMEngine(srv.url, srv.model) as engine:
                    return (await engine.generate(GenerateRequest("x", [1], 8))).output_ids
            outs.append(asyncio.run(main()))
    assert outs[0] == outs[1]


def test_stop_token_ends_with_stop(emulated: RunningEngine) -> None:
    async def main() -> GenerateResult:
        async with _engine(emulated) as engine:
            # Synthetic ids are random: stopping on every id stops at the first token.
            return await engine.generate(GenerateRequest(
                "s1", [1], 50, stop_token_ids=list(range(VOCAB))))

    r = asyncio.run(main())
    assert r.finish_reason == "stop" and len(r.output_ids) == 1


def _decode_step_s(tp: int, n: int) -> float:
    """Modelled seconds a decode step took with `n` requests of a 4,000-token prompt
    running together on an engine of degree `tp` (its steps' modelled time, not the
    wall clock's, which a loaded machine stretches and the engine's catching up
    squeezes)."""
    async def main() -> float:
        engine = EmulatedEngine(COST, tp=tp, time_scale=0.01)
        engine.start()
        prompt = list(range(4000))
        # Queued before the engine's loop first runs: admitted together, one batch.
        futures = [engine.submit(f"b{i}", prompt, 60) for i in range(n)]
        results = await asyncio.gather(*futures)
        await engine.stop()
        assert all(len(r.output_ids) == 60 for r in results)
        assert engine.steps == 60  # all n in every step
        return engine.decode_s / engine.steps
    return asyncio.run(main())


def test_per_token_time_grows_with_batch_and_falls_with_tp() -> None:
    solo, batch = _decode_step_s(1, 1), _decode_step_s(1, 64)
    tp4 = _decode_step_s(4, 1)
    # Model: ~8.2 ms/step alone, ~23 ms at 64 x 4k context (KV reads); tp4 ~3.8 ms. The
    # context grows by a token a step, so the mean step is a little above the first.
    expected_batch = COST.step_time(1, 64, 64 * 4030) / COST.step_time(1, 1, 4030)
    expected_tp = COST.step_time(1, 1, 4030) / COST.step_time(4, 1, 4030)
    assert expected_batch > 2.0 and expected_tp > 1.8
    assert batch / solo == pytest.approx(expected_batch, rel=0.02)
    assert solo / tp4 == pytest.approx(expected_tp, rel=0.02)


async def _until_load(client: VLLMEngine, running: int, waiting: int) -> None:
    """Poll the engine's load until it is (running, waiting): an event, not a duration."""
    while True:
        load = await client.load()
        if (load.running, load.waiting) == (running, waiting):
            return
        await asyncio.sleep(0.01)


def test_priority_orders_a_full_batch() -> None:
    engine = EmulatedEngine(COST, max_num_seqs=1, time_scale=1.0)
    with serve_in_thread(engine, "m") as srv:
        async def main() -> list[str]:
            order: list[str] = []
            async with VLLMEngine(srv.url, srv.model) as client:
                async def run(rid: str, prio: int, tokens: int) -> None:
                    await client.generate(GenerateRequest(rid, [1, 2], tokens, priority=prio))
                    order.append(rid)
                # Busy for hours, until the queue is complete and it is aborted.
                first = asyncio.create_task(run("busy", 0, 30000))
                await _until_load(client, 1, 0)
                rest = []
                for n, (rid, prio) in enumerate((("late-low", 5), ("mid", 1), ("high", -3),
                                                 ("mid2", 1)), start=1):
                    rest.append(asyncio.create_task(run(rid, prio, 2)))
                    await _until_load(client, 1, n)  # arrivals in this order (FCFS among ties)
                await client.abort("busy")
                await asyncio.gather(first, *rest)
            return order

        assert asyncio.run(main()) == ["busy", "high", "mid", "mid2", "late-low"]


def test_abort_frees_capacity_and_returns_tokens_so_far() -> None:
    engine = EmulatedEngine(COST, max_num_seqs=1, time_scale=1.0)
    with serve_in_thread(engine, "m") as srv:
        async def main() -> None:
            async with VLLMEngine(srv.url, srv.model) as client:
                hog = asyncio.create_task(client.generate(GenerateRequest("hog", [1], 30000)))
                await _until_load(client, 1, 0)
                waiter = asyncio.create_task(client.generate(GenerateRequest("w", [1], 3)))
                await _until_load(client, 1, 1)
                assert not waiter.done() and (await client.load()).kv_usage > 0
                await client.abort("hog")  # a client disconnect
                # The hog has hours of tokens left: the waiter ends only because the
                # abort freed its slot (a broken abort fails here, not at the timeout).
                aborted, done = await asyncio.wait_for(asyncio.gather(hog, waiter), 60)
                assert aborted.finish_reason == "abort" and done.finish_reason == "length"
                # The explicit abort endpoint returns the tokens so far to the caller.
                steps = engine.steps  # read across threads: a counter of the engine's steps
                second = asyncio.create_task(client.generate(GenerateRequest("h2", [1], 30000)))
                while engine.steps < steps + 6:  # it has sampled more than 5 tokens
                    await asyncio.sleep(0.01)
                async with httpx.AsyncClient() as raw:
                    reply = await raw.post(f"{srv.url}/abort_request", json={"request_id": "h2"})
                assert reply.json() == {"aborted": True}
                r = await second
                assert r.finish_reason == "abort" and len(r.output_ids) > 5
                assert len(r.logprobs) == len(r.output_ids)
                load = await client.load()
                assert (load.running, load.waiting) == (0, 0)

        asyncio.run(main())


def test_prefix_cache_hits_reported(emulated: RunningEngine) -> None:
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks

    async def main() -> tuple[GenerateResult, GenerateResult, GenerateResult]:
        async with _engine(emulated) as engine:
            a = await engine.generate(GenerateRequest("p1", prompt, 10))
            b = await engine.generate(GenerateRequest("p2", prompt + a.output_ids + [5], 10))
            c = await engine.generate(GenerateRequest("p3", [7, *prompt], 10))
            return a, b, c

    a, b, c = asyncio.run(main())
    assert a.cached_tokens == 0
    assert b.cached_tokens == (len(prompt) + 10) // BLOCK * BLOCK  # the first turn's KV
    assert c.cached_tokens == 0  # a different first token: no shared prefix
    metrics = httpx.get(f"{emulated.url}/metrics").text
    assert "vllm:prefix_cache_hits_total" in metrics and "vllm:kv_cache_usage_perc" in metrics


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"prompt": "hello", "max_tokens": 3}, 400, "no tokenizer"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [], "max_tokens": 3}, 400, "at least one token"),
    ({"prompt": [VOCAB], "max_tokens": 3}, 400, "vocabulary"),
    ({"prompt": [1], "max_tokens": 10**6}, 400, "maximum model length"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": [1], "max_tokens": 3, "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": [1], "max_tokens": 3, "stream": True}, 400, "stream"),
])
def test_bad_requests_get_4xx_with_message(emulated: RunningEngine, body: dict[str, object],
                                           status: int, message: str) -> None:
    reply = httpx.post(f"{emulated.url}/v1/completions", json=body)
    assert reply.status_code == status
    assert message in reply.json()["error"]["message"]


def test_bad_request_through_client_is_request_error(emulated: RunningEngine) -> None:
    async def main() -> None:
        async with _engine(emulated) as engine:
            with pytest.raises(EngineRequestError, match="vocabulary"):
                await engine.generate(GenerateRequest("bad", [-1], 3))

    asyncio.run(main())


def test_prefix_cache_blocks_and_lru() -> None:
    cache = PrefixCache()
    ids = list(range(40))
    cache.insert(ids)
    assert len(cache) == 2 and cache.match(ids) == 32 and cache.match(ids[:20]) == 16
    assert cache.match([99, *ids]) == 0
    cache.insert(list(range(100, 116)))
    cache.trim(2)  # the least recent block goes: ids' tail, before its head
    assert cache.match(ids) == 16 and cache.match(list(range(100, 116))) == 16
    cache.trim(0)
    assert len(cache) == 0 and cache.match(ids) == 0


def test_cli_parser_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="treadle")
    add_engine_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["engine", "emulate", "--port", "8123", "--model", "qwen3-32b",
                              "--gpu", "h200", "--tp", "2", "--time-scale", "0.05"])
    assert (args.port, args.model, args.gpu, args.tp, args.time_scale, args.seed) == (
        8123, "qwen3-32b", "h200", 2, 0.05, 0)
    assert args.func is run_emulate
    bad = parser.parse_args(["engine", "emulate", "--model", "llama-9000"])
    assert run_emulate(bad) == 2
    assert "unknown model" in capsys.readouterr().err
    assert run_emulate(parser.parse_args(["engine", "emulate", "--time-scale", "0"])) == 2


def test_kv_overflow_preempts_and_every_request_still_finishes() -> None:
    cost = CostModel.named("qwen3-32b", "h100")  # ~13k KV tokens on one H100
    capacity = cost.kv_capacity_tokens(1)
    prompt_len = capacity // 4  # three fit at admission, then outgrow the cache

    class Checked(EmulatedEngine):
        """The KV kept as it changes, and each request's block hashes, checked against
        a recount at every step, through admissions, preemptions and finishes."""

        def _step(self) -> None:
            super()._step()
            running = list(self._running.values())
            assert self._kv_used() == sum(s.context for s in running)
            for s in running:
                assert s.chain == PrefixCache.hashes(s.prompt + s.output)[:len(s.chain)]

    async def main() -> tuple[list[GenerateResult], int]:
        engine = Checked(cost, time_scale=1e-4)
        engine.start()
        futures = [engine.submit(f"k{i}", [i + 1] * prompt_len, prompt_len // 2)
                   for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*futures), 60)
        await engine.stop()
        assert engine._kv_used() == 0
        return results, engine.preemptions

    results, preemptions = asyncio.run(main())
    assert preemptions >= 1
    assert all(r.finish_reason == "length" and len(r.output_ids) == prompt_len // 2
               for r in results)
    assert results[2].queued_s is not None


def test_a_weight_update_runs_against_the_emulator_as_against_vllm(
        emulated: RunningEngine) -> None:
    async def main() -> str | None:
        async with _engine(emulated) as engine:
            await engine.update_weights("/nonexistent/weights", 3)
            version = await engine.weight_version()
            r = await engine.generate(GenerateRequest("after-update", [1, 2, 3], max_tokens=4))
            assert len(r.output_ids) == 4
            return version

    assert asyncio.run(main()) == "3"
    bad = httpx.post(f"{emulated.url}/collective_rpc", json={"method": "rm_rf"})
    assert bad.status_code == 400 and "no method" in bad.text


def test_prefix_hashes_chain_blocks_and_take_any_integer_ids() -> None:
    ids = list(range(40))
    hashes = PrefixCache.hashes(ids)
    assert len(hashes) == 40 // BLOCK  # full blocks only
    assert PrefixCache.hashes([*ids[:BLOCK], 999, *ids[BLOCK + 1:]])[0] == hashes[0]
    assert PrefixCache.hashes([*ids[:BLOCK], 999, *ids[BLOCK + 1:]])[1] != hashes[1]
    # An id no 64-bit integer holds (a client's bad request) still hashes, by its text.
    assert len(PrefixCache.hashes([1 << 70] * BLOCK)) == 1
