"""The vLLM and SGLang clients against fakes of their servers' wire formats, on both
HTTP stacks (`_wire.WirePool` with msgspec, and the httpx one kept for comparison)."""

from __future__ import annotations

import asyncio

import pytest
from engines_fakes import FakeSGLangServer, FakeVLLMServer

from treadle.engines import (
    EngineLoad,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    GenerateRequest,
)
from treadle.engines._http import HTTP_STACK_ENV, parse_prometheus
from treadle.engines.sglang import SGLangEngine, generate_body
from treadle.engines.vllm import VLLMEngine, completion_body

PROMPT = [5, 6, 7, 100]


@pytest.fixture(autouse=True, params=["wire", "httpx"])
def http_stack(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on each stack: the same wire format, the same errors."""
    monkeypatch.setenv(HTTP_STACK_ENV, request.param)
    return str(request.param)


def req(rid: str = "r1", **kw: object) -> GenerateRequest:
    return GenerateRequest(rid, list(PROMPT), **{"max_tokens": 4, **kw})  # type: ignore[arg-type]


# -- vLLM ------------------------------------------------------------------------------


def test_vllm_generate_sends_token_ids_and_reads_them_back(
        fake_vllm: tuple[FakeVLLMServer, str]) -> None:
    fake, url = fake_vllm

    async def main() -> None:
        async with VLLMEngine(url, "m") as engine:
            r = await engine.generate(req(priority=3, stop_token_ids=[2], temperature=0.7))
            assert r.output_ids == [101, 102, 103, 104]
            assert r.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
            assert (r.finish_reason, r.prompt_tokens, r.cached_tokens) == ("length", 4, 16)
            assert r.queued_s is None and r.generating_s > 0

    asyncio.run(main())
    body = fake.requests[0]
    assert body["prompt"] == PROMPT and body["return_token_ids"] is True
    assert body["logprobs"] == 1 and body["priority"] == 3 and body["stop_token_ids"] == [2]
    assert body["max_tokens"] == 4 and body["temperature"] == 0.7 and body["model"] == "m"
    assert body["request_id"] == "r1" and fake.headers[0]["x-request-id"] == "r1"


def test_vllm_reads_old_reply_shape_and_no_logprobs(
        fake_vllm: tuple[FakeVLLMServer, str]) -> None:
    fake, url = fake_vllm
    fake.mode = "old_shape"  # no usage: prompt length from prompt_token_ids

    async def main() -> None:
        async with VLLMEngine(url, "m") as engine:
            r = await engine.generate(req(logprobs=False))
            assert r.output_ids == [101, 102, 103, 104] and r.logprobs == []
            assert r.prompt_tokens == 4 and r.cached_tokens is None

    asyncio.run(main())
    assert "logprobs" not in fake.requests[0] and "priority" not in fake.requests[0]


@pytest.mark.parametrize(("mode", "error", "names"), [
    ("no_token_ids", EngineProtocolError, "token_ids"),
    ("bad_logprobs", EngineProtocolError, "token_logprobs"),
    ("not_json", EngineProtocolError, "not JSON"),
    ("error500", EngineUnavailable, "500"),
    ("reject400", EngineRequestError, "priority not enabled"),
])
def test_vllm_errors_name_the_problem(fake_vllm: tuple[FakeVLLMServer, str], mode: str,
                                      error: type[Exception], names: str) -> None:
    fake, url = fake_vllm
    fake.mode = mode

    async def main() -> None:
        async with VLLMEngine(url, "m") as engine:
            with pytest.raises(error, match=names):
                await engine.generate(req())

    asyncio.run(main())


def test_vllm_abort_cancels_the_http_call(fake_vllm: tuple[FakeVLLMServer, str]) -> None:
    fake, url = fake_vllm
    fake.mode = "hang"

    async def main() -> None:
        async with VLLMEngine(url, "m") as engine:
            task = asyncio.create_task(engine.generate(req("slow")))
            while not fake.requests:
                await asyncio.sleep(0.01)
            await engine.abort("slow")
            await engine.abort("slow")  # idempotent
            await engine.abort("unknown")  # no-op
            r = await task
            assert (r.finish_reason, r.output_ids, r.request_id) == ("abort", [], "slow")
            while not fake.disconnects:  # the server sees the connection drop
                await asyncio.sleep(0.01)
            assert fake.disconnects == 1

    asyncio.run(main())


def test_vllm_timeout_and_caller_cancel(fake_vllm: tuple[FakeVLLMServer, str]) -> None:
    fake, url = fake_vllm
    fake.mode = "hang"

    async def main() -> None:
        async with VLLMEngine(url, "m") as engine:
            with pytest.raises(EngineTimeout):
                await engine.generate(req("t", timeout_s=0.2))
            task = asyncio.create_task(engine.generate(req("c")))
            while len(fake.requests) < 2:  # the call is at the server
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())


def test_vllm_unreachable_and_health(fake_vllm: tuple[FakeVLLMServer, str]) -> None:
    _fake, url = fake_vllm

    async def main() -> None:
        async with VLLMEngine("http://127.0.0.1:1", "m", connect_timeout_s=2) as dead:
            assert not await dead.health()
            with pytest.raises(EngineUnavailable):
                await dead.generate(req())
            with pytest.raises(EngineUnavailable):
                await dead.load()
        async with VLLMEngine(url, "m") as engine:
            assert await engine.health()

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["ok", "old_metrics"])
def test_vllm_load_from_metrics(fake_vllm: tuple[FakeVLLMServer, str], mode: str) -> None:
    fake, url = fake_vllm
    fake.mode = mode

    async def main() -> EngineLoad:
        async with VLLMEngine(url, "m") as engine:
            return await engine.load()

    assert asyncio.run(main()) == EngineLoad(running=5, waiting=4, kv_usage=0.25)


def test_vllm_load_missing_metric_is_protocol_error(
        fake_vllm: tuple[FakeVLLMServer, str]) -> None:
    fake, url = fake_vllm
    fake.mode = "no_metrics"

    async def main() -> None:
        async with VLLMEngine(url, "m") as engine:
            with pytest.raises(EngineProtocolError, match="num_requests_running"):
                await engine.load()

    asyncio.run(main())


def test_parse_prometheus_sums_label_sets_and_rejects_garbage() -> None:
    text = ('# HELP x\nx{a="1 2",b="}"} 1.5\nx 2\nxy 7\ny{a="1"} 3e-1 1700000000\n')
    assert parse_prometheus(text, {"x": "x", "y": "y"}) == {"x": 3.5, "y": 0.3}
    with pytest.raises(EngineProtocolError, match="x"):
        parse_prometheus("x{a=\"1\"} nope\n", {"x": "x"})


def test_a_seed_is_sent_only_when_set() -> None:
    assert "seed" not in completion_body(req(), "m")
    assert completion_body(req(seed=7), "m")["seed"] == 7
    assert "sampling_seed" not in generate_body(req())["sampling_params"]
    assert generate_body(req(seed=7))["sampling_params"]["sampling_seed"] == 7
    big = (1 << 62) + 5  # a derived seed has 63 bits; SGLang keeps 31
    assert generate_body(req(seed=big))["sampling_params"]["sampling_seed"] == 5


# -- SGLang ----------------------------------------------------------------------------


def test_sglang_generate_wire_format(fake_sglang: tuple[FakeSGLangServer, str]) -> None:
    fake, url = fake_sglang

    async def main() -> None:
        async with SGLangEngine(url) as engine:
            r = await engine.generate(req(priority=2, stop_token_ids=[9], top_p=0.9))
            assert r.output_ids == [101, 102, 103, 104]
            assert r.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
            assert (r.finish_reason, r.prompt_tokens, r.cached_tokens) == ("length", 4, 8)
            assert r.generating_s == 0.5  # meta_info.e2e_latency
            assert await engine.load() == EngineLoad(7, 1, 0.5)
            assert await engine.health()

    asyncio.run(main())
    body = fake.requests[0]
    assert body["input_ids"] == PROMPT and body["rid"] == "r1" and body["priority"] == 2
    assert body["return_logprob"] is True
    assert body["sampling_params"] == {"max_new_tokens": 4, "temperature": 1.0, "top_p": 0.9,
                                       "skip_special_tokens": False, "stop_token_ids": [9]}


def test_sglang_abort_returns_tokens_so_far(fake_sglang: tuple[FakeSGLangServer, str]) -> None:
    fake, url = fake_sglang
    fake.mode = "wait_abort"

    async def main() -> None:
        async with SGLangEngine(url) as engine:
            task = asyncio.create_task(engine.generate(req("a1", max_tokens=50)))
            while not fake.requests:
                await asyncio.sleep(0.01)
            await engine.abort("a1")
            r = await task
            assert r.finish_reason == "abort" and r.output_ids == [101, 102, 103]
            assert len(r.logprobs) == 3

    asyncio.run(main())
    assert fake.aborts == ["a1"]


def test_sglang_abort_falls_back_to_cancel(fake_sglang: tuple[FakeSGLangServer, str]) -> None:
    fake, url = fake_sglang
    fake.mode = "hang"

    async def main() -> None:
        async with SGLangEngine(url, abort_grace_s=0.2) as engine:
            task = asyncio.create_task(engine.generate(req("h1")))
            while not fake.requests:
                await asyncio.sleep(0.01)
            await engine.abort("h1")
            r = await task
            assert r.finish_reason == "abort" and r.output_ids == []

    asyncio.run(main())


@pytest.mark.parametrize(("mode", "error", "names"), [
    ("mismatch", EngineProtocolError, "output_token_logprobs"),
    ("error500", EngineUnavailable, "500"),
])
def test_sglang_errors(fake_sglang: tuple[FakeSGLangServer, str], mode: str,
                       error: type[Exception], names: str) -> None:
    fake, url = fake_sglang
    fake.mode = mode

    async def main() -> None:
        async with SGLangEngine(url) as engine:
            with pytest.raises(error, match=names):
                await engine.generate(req())

    asyncio.run(main())


def test_sglang_malformed_reply_names_field() -> None:
    from treadle.engines.sglang import parse_generate

    with pytest.raises(EngineProtocolError, match=r"meta_info\.prompt_tokens"):
        parse_generate({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}},
                       req(logprobs=False), 0.1)
    with pytest.raises(EngineProtocolError, match="finish_reason"):
        parse_generate({"output_ids": [1], "meta_info": {"prompt_tokens": 1,
                                                         "finish_reason": {"type": "eos"}}},
                       req(logprobs=False), 0.1)
