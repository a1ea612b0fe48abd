"""The runtime over a REAL vLLM server (CPU build): a multi-turn trajectory's tokens
are exactly what the engine returned, and the engine's logprobs are the model's.

The model is the tiny seeded Qwen2 of `vllm_server` (random weights: the text is
gibberish, the token ids and logprobs are real). Teacher forcing runs the same
weights in transformers, fp32, on the whole context.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from treadle.agent.chat import IM_END, HermesFormat, prompt_messages
from treadle.agent.loop import tool_messages
from treadle.agent.runner import Sampling
from treadle.agent.tokenizer import HFTokenizer
from treadle.core.policies.baselines import Slime
from treadle.engines.vllm import VLLMEngine
from treadle.runtime.driver import Runtime
from treadle.train.logprobs import teacher_forced_logprobs
from treadle.train.model import load_model
from treadle.types import KVAcrossUpdates, TokenSegment
from vllm_server import RecordingEngine, VLLMServer, serve_vllm

pytestmark = [pytest.mark.integration, pytest.mark.slow]
FMT = HermesFormat()


def teacher_forced(model_dir: Path, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response[i] | prompt + response[:i]) under the model, fp32."""
    return teacher_forced_logprobs(load_model(model_dir), prompt, response)


async def _three_turns(server: VLLMServer) -> tuple[TokenSegment, RecordingEngine, Any]:
    tok = HFTokenizer(server.model_dir)
    engine = RecordingEngine(VLLMEngine(server.url, server.model))
    rt = Runtime(Slime(1, 1))
    rt.register_engine(engine, max_batch=16, kv_capacity_tokens=16_384, label="vllm")
    await rt.start()
    try:
        turns = rt.turns("t0", "g0")
        seg = TokenSegment(prompt_ids=tok.encode(
            FMT.prompt(prompt_messages("the agent calls a tool"), [])))
        context = list(seg.prompt_ids)
        observations = []
        for i in range(3):
            out = await turns.generate(context, 24, Sampling(temperature=1.0),
                                       [tok.token_id(IM_END)])
            context += out.output_ids
            seg.response_ids += out.output_ids
            seg.loss_mask += [1] * len(out.output_ids)
            seg.logprobs += out.logprobs
            seg.policy_versions += out.policy_versions
            turns.turn_finished(len(out.output_ids), len(context), final=i == 2)
            if i == 2:
                break
            turns.tool_started()
            obs = tok.encode(FMT.continuation(
                tool_messages([f"result {i}: the tool returns ok"]), True))
            observations.append(obs)
            context += obs
            seg.response_ids += obs
            seg.loss_mask += [0] * len(obs)
            seg.logprobs += [0.0] * len(obs)
            seg.policy_versions += [0] * len(obs)
            turns.tool_finished(0.0, len(obs), final=False)
    finally:
        await rt.close()
    return seg, engine, observations


def test_a_multi_turn_trajectory_is_what_vllm_returned(vllm_server: VLLMServer) -> None:
    seg, engine, observations = asyncio.run(asyncio.wait_for(_three_turns(vllm_server), 120))
    seg.validate()
    r1, r2, r3 = engine.results
    assert seg.response_ids == (r1.output_ids + observations[0] + r2.output_ids +
                                observations[1] + r3.output_ids)
    sampled = [lp for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if m]
    assert sampled == r1.logprobs + r2.logprobs + r3.logprobs  # bit for bit
    assert sum(seg.loss_mask) == sum(len(r.output_ids) for r in engine.results)
    # Each call's prompt was the trajectory so far, id for id: prompt + replies +
    # observations; and the engine counted those tokens.
    second = seg.prompt_ids + r1.output_ids + observations[0]
    assert [request.prompt_ids for request, _ in engine.calls] == [
        seg.prompt_ids, second, second + r2.output_ids + observations[1]]
    assert [r.prompt_tokens for r in engine.results] == [
        len(request.prompt_ids) for request, _ in engine.calls]

    forced = teacher_forced(vllm_server.model_dir, seg.prompt_ids, seg.response_ids)
    deltas = [abs(f - lp) for f, lp, m in zip(forced, seg.logprobs, seg.loss_mask, strict=True)
              if m]
    assert deltas and max(deltas) < 1e-3, f"max |delta| {max(deltas):.2e}"


@pytest.fixture(scope="module")
def dev_server(vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[VLLMServer, Path]]:
    """A second vLLM with the RL endpoints (dev mode), and a perturbed copy of the
    weights to load into it.

    The embeddings are untied first: vLLM's CPU build (0.32) reloads a model with
    `tie_word_embeddings` in place into logprobs that match neither the old nor the
    new weights (its output projection keeps a stale packed copy), while an untied
    model reloads exactly.
    """
    import torch
    from transformers import AutoModelForCausalLM

    work = tmp_path_factory.mktemp("vllm-dev")
    model_dir, updated = work / "v0", work / "v1"
    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((vllm_server.model_dir / name).read_bytes())
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(updated)
    with serve_vllm(model_dir, work, extra_env={"VLLM_SERVER_DEV_MODE": "1"},
                    tokens_api=True) as server:
        yield server, updated


def test_a_weight_update_changes_the_logprobs_and_stamps_the_version(
        dev_server: tuple[VLLMServer, Path]) -> None:
    server, updated = dev_server
    tok = HFTokenizer(server.model_dir)
    prompt = tok.encode(FMT.prompt(prompt_messages("the agent calls a tool"), []))

    async def main() -> tuple[Any, Any, str | None]:
        engine = VLLMEngine(server.url, server.model)
        rt = Runtime(Slime(1, 1))
        rt.register_engine(engine, max_batch=16, kv_capacity_tokens=16_384)
        await rt.start()
        try:
            before = await rt.turns("a", "g").generate(prompt, 12, Sampling(temperature=0.0),
                                                       [])
            await rt.update_weights(str(updated), policy_version=5)
            after = await rt.turns("b", "g").generate(prompt, 12, Sampling(temperature=0.0),
                                                      [])
            version = await engine.weight_version()
        finally:
            await rt.close()
        return before, after, version

    before, after, version = asyncio.run(asyncio.wait_for(main(), 120))
    assert before.policy_versions == [0] * 12 and after.policy_versions == [5] * 12
    assert version == "5"
    forced = teacher_forced(updated, prompt, after.output_ids)
    assert max(abs(f - lp) for f, lp in zip(forced, after.logprobs, strict=True)) < 1e-3
    old = teacher_forced(server.model_dir, prompt, after.output_ids)
    assert max(abs(f - lp) for f, lp in zip(old, after.logprobs, strict=True)) > 1e-2


LONG_TASK = ("the agent reads a long report, calls a tool, and reads on: " +
             " ".join(f"line {i} of the report says the value is {i * 7 % 13}."
                      for i in range(10)))


async def _across_an_update(server: VLLMServer, weights: tuple[Path, Path],
                            versions: tuple[int, int], kv: KVAcrossUpdates
                            ) -> tuple[list[int], list[int], Any, Any]:
    """Two turns of one trajectory with a "keep" update to `weights[1]` in its tool
    call: (prompt, the second call's prompt, first turn, second turn)."""
    tok = HFTokenizer(server.model_dir)
    stop = [tok.token_id(IM_END)]
    rt = Runtime(Slime(1, 1))
    rt.register_engine(VLLMEngine(server.url, server.model), max_batch=16,
                       kv_capacity_tokens=16_384)
    await rt.start()
    try:
        await rt.update_weights(str(weights[0]), versions[0])
        turns = rt.turns(f"t-{kv.value}", "g", kv)
        prompt = tok.encode(FMT.prompt(prompt_messages(LONG_TASK), []))
        first = await turns.generate(prompt, 16, Sampling(temperature=1.0, seed=3), stop)
        turns.turn_finished(len(first.output_ids), len(prompt) + len(first.output_ids),
                            final=False)
        turns.tool_started()
        await rt.update_weights(str(weights[1]), versions[1], "keep")
        observation = tok.encode(FMT.continuation(tool_messages(["the tool says ok"]), True))
        turns.tool_finished(0.0, len(observation), final=False)
        context = prompt + first.output_ids + observation
        second = await turns.generate(context, 16, Sampling(temperature=1.0, seed=4), stop)
        turns.turn_finished(len(second.output_ids), len(context) + len(second.output_ids),
                            final=True)
    finally:
        await rt.close()
    return prompt, context, first, second


def _gap(model_dir: Path, prompt: list[int], out: Any) -> float:
    forced = teacher_forced(model_dir, prompt, out.output_ids)
    return max(abs(f - lp) for f, lp in zip(forced, out.logprobs, strict=True))


def test_a_trajectory_across_a_keep_update_never_reuses_stale_kv(
        dev_server: tuple[VLLMServer, Path]) -> None:
    """A "keep" update between two turns: each turn's tokens carry the version that
    sampled them, and with KV recomputed (the default) each turn's logprobs are its
    version's weights' over the whole context — the second turn's context (over 128
    tokens: vLLM's CPU blocks) was cached under the old weights, and a stale hit would
    show here. With KV kept, the gap is measured (and must show the stale hit, or the
    first half proves nothing)."""
    server, updated = dev_server
    old = server.model_dir

    prompt, context, first, second = asyncio.run(asyncio.wait_for(_across_an_update(
        server, (old, updated), (10, 11), KVAcrossUpdates.RECOMPUTE), 120))
    assert len(context) > 256
    assert first.policy_versions == [10] * len(first.output_ids)
    assert second.policy_versions == [11] * len(second.output_ids)
    assert _gap(old, prompt, first) < 1e-3
    recomputed = _gap(updated, context, second)
    assert recomputed < 1e-3, f"stale KV: max |delta| {recomputed:.2e}"

    _, context, _, kept = asyncio.run(asyncio.wait_for(_across_an_update(
        server, (old, updated), (12, 13), KVAcrossUpdates.KEEP), 120))
    stale = _gap(updated, context, kept)
    print(f"KV across a keep update: recomputed max |dlogp| {recomputed:.2e}, "
          f"kept {stale:.3f}")
    assert stale > 1e-2


async def _decode_steps(server: VLLMServer, steps: int) -> None:
    """Return once vLLM has run `steps` more decode steps: the reply to a request for
    exactly that many tokens, sent now, is the event. vLLM decodes every running
    request at each step, so a call sent just before it has been decoded alongside."""
    async with httpx.AsyncClient(timeout=None) as client:
        r = await client.post(f"{server.url}/v1/completions", json={
            "model": server.model, "prompt": [1, 2, 3], "max_tokens": steps,
            "ignore_eos": True, "temperature": 0.0})
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == steps


async def _frozen_across_an_update(server: VLLMServer, weights: tuple[Path, Path],
                                   kv: KVAcrossUpdates) -> tuple[list[int], Any, int]:
    """One call frozen in vLLM by a "keep" update from `weights[0]` to `weights[1]`:
    (prompt, its turn, tokens of the old weights). A call that ends (the model's end
    token) before the update reaches it keeps nothing: tried again until one is kept
    (the chance of that is the end token's within the first tokens)."""
    tok = HFTokenizer(server.model_dir)
    prompt = tok.encode(FMT.prompt(prompt_messages(LONG_TASK), []))
    engine = RecordingEngine(VLLMEngine(server.url, server.model, tokens_api=True))
    rt = Runtime(Slime(1, 1))
    rt.register_engine(engine, max_batch=16, kv_capacity_tokens=16_384)
    await rt.start()
    try:
        for attempt in itertools.count():
            version = 30 + 2 * attempt
            await rt.update_weights(str(weights[0]), version)
            turns = rt.turns(f"k-{kv.value}-{attempt}", "g", kv)
            engine.calling.clear()
            call = asyncio.ensure_future(turns.generate(
                prompt, 400, Sampling(temperature=1.0, seed=attempt), []))
            await engine.calling.wait()  # admitted, its request on its way to vLLM
            # Its first tokens sampled (if it reached vLLM first; if not, or if it ends
            # before the update, nothing is kept and it is tried again below).
            await _decode_steps(server, 8)
            update = await rt.update_weights(str(weights[1]), version + 1, "keep")
            out = await call
            # Its one turn ends it: a trajectory left running holds an engine slot, and
            # tried again often enough, would fill the engine's batch.
            turns.turn_finished(len(out.output_ids), len(prompt) + len(out.output_ids),
                                final=True)
            old = out.policy_versions.count(version)
            if update.kept == 1 and 0 < old < len(out.output_ids):
                assert out.policy_versions == [version] * old + [version + 1] * (
                    len(out.output_ids) - old)
                assert len(engine.calls) == attempt + 1  # frozen, never sent again
                assert engine.updates[-1] == ("keep", kv is KVAcrossUpdates.RECOMPUTE)
                return prompt, out, old
    finally:
        await rt.close()
    raise AssertionError("unreachable")


def test_keep_freezes_a_call_in_vllm_and_each_token_carries_the_weights_that_sampled_it(
        dev_server: tuple[VLLMServer, Path]) -> None:
    """A "keep" update in the middle of a call on vLLM's token API: the call is frozen,
    not aborted (nothing sampled is lost), continues under the new weights, and its
    tokens carry two versions. Recomputed (the default), the tokens after the update
    have the new weights' logprobs over the whole context, and those before the old
    weights'; kept, the new tokens were sampled over KV of the old weights (measured
    gap, which must show, or the first half proves nothing)."""
    server, updated = dev_server
    weights = (server.model_dir, updated)
    prompt, out, old = asyncio.run(asyncio.wait_for(_frozen_across_an_update(
        server, weights, KVAcrossUpdates.RECOMPUTE), 300))
    before = teacher_forced(weights[0], prompt, out.output_ids[:old])
    assert max(abs(f - lp) for f, lp in zip(before, out.logprobs[:old], strict=True)) < 1e-3
    after = teacher_forced(weights[1], prompt, out.output_ids)[old:]
    recomputed = max(abs(f - lp) for f, lp in zip(after, out.logprobs[old:], strict=True))
    assert recomputed < 1e-3, f"frozen call went on over stale KV: {recomputed:.2e}"

    prompt, out, old = asyncio.run(asyncio.wait_for(_frozen_across_an_update(
        server, weights, KVAcrossUpdates.KEEP), 300))
    after = teacher_forced(weights[1], prompt, out.output_ids)[old:]
    kept = max(abs(f - lp) for f, lp in zip(after, out.logprobs[old:], strict=True))
    print(f"a call frozen across a keep update: recomputed max |dlogp| {recomputed:.2e}, "
          f"kept {kept:.3f} ({old} of {len(out.output_ids)} tokens before it)")
    assert kept > 1e-2
