"""TorchEngine: sampling, logprobs, stops, seeding, aborts and request checks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from treadle.engines import EngineRequestError, GenerateRequest
from treadle.train.engine import TorchEngine
from treadle.train.logprobs import teacher_forced_logprobs
from treadle.train.model import IM_END_ID, load_model
from treadle.types import JsonObjectConstraint

PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 60], [1, 70, 71, 72, 73, 74, 75, 76]]


def _req(rid: str, prompt: list[int], **kw: object) -> GenerateRequest:
    return GenerateRequest(rid, prompt, **{"max_tokens": 12, "stop_token_ids": [], **kw})  # type: ignore[arg-type]


def test_batched_samples_have_teacher_forced_logprobs_and_are_seeded(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)

    async def main() -> None:
        async with TorchEngine(model, seed=3) as engine:
            rs = await asyncio.gather(*(engine.generate(_req(f"r{i}", p))
                                        for i, p in enumerate(PROMPTS)))
            alone = await engine.generate(_req("r1", PROMPTS[1]))
            other = await engine.generate(_req("r1-again", PROMPTS[1]))
        for p, r in zip(PROMPTS, rs, strict=True):
            assert r.prompt_tokens == len(p) and len(r.logprobs) == len(r.output_ids) >= 1
            tf = teacher_forced_logprobs(model, p, r.output_ids)
            assert max(abs(a - b) for a, b in zip(tf, r.logprobs, strict=True)) < 1e-4
            assert r.finish_reason in ("stop", "length")
        assert alone.output_ids == rs[1].output_ids  # same id and seed, other batch
        assert other.output_ids != rs[1].output_ids or len(other.output_ids) < 3

    asyncio.run(main())


def test_a_request_seed_overrides_the_engine_seed(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)

    async def main() -> None:
        async with TorchEngine(model, seed=3) as a, TorchEngine(model, seed=4) as b:
            x = await a.generate(_req("x", PROMPTS[2], max_tokens=24, seed=11))
            y = await b.generate(_req("y", PROMPTS[2], max_tokens=24, seed=11))
            others = [await a.generate(_req(f"z{s}", PROMPTS[2], max_tokens=24, seed=s))
                      for s in (12, 13, 14, 15)]
        assert x.output_ids == y.output_ids  # other engine seed, other id, same seed
        assert any(z.output_ids != x.output_ids for z in others)

    asyncio.run(main())


def test_greedy_stop_tokens_eos_and_max_tokens(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)

    async def main() -> None:
        async with TorchEngine(model) as engine:
            a = await engine.generate(_req("g1", PROMPTS[0], temperature=0.0))
            b = await engine.generate(_req("g2", PROMPTS[0], temperature=0.0))
            assert a.output_ids == b.output_ids
            first = a.output_ids[0]
            s = await engine.generate(_req("g3", PROMPTS[0], temperature=0.0,
                                           stop_token_ids=[first]))
            assert (s.output_ids, s.finish_reason) == ([first], "stop")
            n = await engine.generate(_req("g4", PROMPTS[0], max_tokens=3, temperature=0.0))
            assert n.output_ids == a.output_ids[:3]
            if IM_END_ID not in a.output_ids[:3]:
                assert n.finish_reason == "length"
            nolp = await engine.generate(_req("g5", PROMPTS[0], logprobs=False))
            assert nolp.logprobs == []
            assert engine._eos == {IM_END_ID}  # the checkpoint's EOS always stops

    asyncio.run(main())


def test_abort_of_a_waiting_request_returns_no_tokens(tiny_dir: Path) -> None:
    async def main() -> None:
        async with TorchEngine(load_model(tiny_dir), max_batch=1,
                               batch_window_s=0.05) as engine:
            first = asyncio.create_task(engine.generate(_req("a1", PROMPTS[0], max_tokens=40)))
            second = asyncio.create_task(engine.generate(_req("a2", PROMPTS[1])))
            await asyncio.sleep(0)
            await engine.abort("a2")
            r2, r1 = await second, await first
            assert (r2.finish_reason, r2.output_ids) == ("abort", [])
            assert r1.finish_reason != "abort"
            await engine.abort("unknown")  # a no-op

    asyncio.run(main())


@pytest.mark.parametrize("kw", [
    {"max_tokens": 0}, {"max_tokens": 2000}, {"prompt": []}, {"prompt": [10**6]},
    {"temperature": -1.0}, {"top_p": 0.0},
    {"constraint": JsonObjectConstraint()},  # no grammar: refused, never sampled freely
])
def test_bad_requests_are_engine_request_errors(tiny_dir: Path, kw: dict[str, object]) -> None:
    kw = dict(kw)
    prompt = kw.pop("prompt", PROMPTS[0])

    async def main() -> None:
        async with TorchEngine(load_model(tiny_dir)) as engine:
            with pytest.raises(EngineRequestError):
                await engine.generate(_req("bad", prompt, **kw))  # type: ignore[arg-type]
            assert await engine.health()

    asyncio.run(main())


def test_top_p_keeps_only_the_nucleus(tiny_dir: Path) -> None:
    async def main() -> None:
        async with TorchEngine(load_model(tiny_dir)) as engine:
            greedy = await engine.generate(_req("p0", PROMPTS[2], temperature=0.0))
            tiny_p = await engine.generate(_req("p1", PROMPTS[2], top_p=1e-6))
            assert tiny_p.output_ids == greedy.output_ids  # only the top token survives

    asyncio.run(main())
