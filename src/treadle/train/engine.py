"""`TorchEngine`: an `Engine` that samples from a transformers causal LM in this process.

    async with TorchEngine.from_checkpoint(path, seed=0) as engine:
        result = await engine.generate(GenerateRequest("t1-0", prompt_ids, max_tokens=64))

For evaluating and testing checkpoints where no inference server runs. Requests
that arrive while the model is busy wait; each time it is free, up to `max_batch`
waiting requests run together as one batch (left-padded prompts, a KV cache, one
token per step for every row), in a worker thread so the event loop stays free for
tool calls. A batch runs until its last row stops; rows that arrive meanwhile wait
for the next batch (no continuous batching).

Sampling follows vLLM: temperature (0 = greedy) and top-p; a row stops at any of
its `stop_token_ids` or at the model's EOS (its generation config), the stop token
included in `output_ids`, or at `max_tokens`. `logprobs` are the raw model
log-softmax of each sampled token (fp32, before temperature), as vLLM reports by
default. Every request samples from its own generator seeded by its `seed`, or
else by (engine seed, request id): the same request gives the same tokens whatever
else is batched with it, up to float rounding of padded batches (~1e-6 in the
logits, which changes a sample only when a draw falls that close to a boundary).
It has no grammar: a request with a `constraint` (structured output) is refused
(EngineRequestError), as its `capabilities` declare none.

Abort: a waiting request ends at once with no tokens; a running one at the next
step with the tokens so far. `load()` reports the running batch and the queue;
`kv_usage` is always 0.0 (the cache is per batch, not a pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.engines.base import (
    Engine,
    EngineLoad,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    derived_seed,
)
from treadle.engines.errors import EngineRequestError, EngineTimeout, EngineUnavailable

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


@dataclass(eq=False, slots=True)
class _Slot:
    request: GenerateRequest  # what was asked
    future: asyncio.Future[GenerateResult]  # resolved by the worker (or by abort)
    enqueued: float  # perf_counter when it arrived


@dataclass(slots=True)
class _Row:
    """One request's progress inside a running batch (worker thread only)."""

    request: GenerateRequest
    generator: Any  # torch.Generator seeded for this request
    stops: frozenset[int]  # stop ids plus the model's EOS
    output_ids: list[int]
    logprobs: list[float]
    finish: FinishReason | None = None


def _seed(engine_seed: int, request: GenerateRequest) -> int:
    """The request's own seed, else one derived from the engine's and the request id."""
    if request.seed is not None:
        return request.seed
    return derived_seed(engine_seed, request.request_id)


class TorchEngine(Engine):
    """See the module docstring."""

    def __init__(self, model: PreTrainedModel, *, seed: int = 0, max_batch: int = 64,
                 max_model_len: int | None = None, batch_window_s: float = 0.005) -> None:
        self.model = model.eval()  # type: ignore[no-untyped-call]
        self.seed = seed
        self.max_batch = max_batch
        self.max_model_len = max_model_len or int(model.config.max_position_embeddings)
        self.batch_window_s = batch_window_s  # wait this long for more requests to batch
        self.vocab_size = int(model.config.vocab_size)
        eos = model.generation_config.eos_token_id
        self._eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._pending: list[_Slot] = []
        self._in_flight: set[str] = set()  # request ids waiting or running
        self._aborted: set[str] = set()  # read by the worker thread between steps
        self._running = 0
        self._worker: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    def from_checkpoint(cls, path: str | Path, **options: Any) -> TorchEngine:
        from treadle.train.model import load_model

        return cls(load_model(path), **options)

    def _check(self, r: GenerateRequest) -> None:
        problem = None
        if self._closed:
            raise EngineUnavailable("the engine is closed")
        if not r.prompt_ids:
            problem = "prompt_ids is empty"
        elif r.max_tokens < 1:
            problem = f"max_tokens must be >= 1, got {r.max_tokens}"
        elif len(r.prompt_ids) + r.max_tokens > self.max_model_len:
            problem = (f"prompt ({len(r.prompt_ids)} tokens) + max_tokens ({r.max_tokens}) "
                       f"exceeds the model length {self.max_model_len}")
        elif any(not 0 <= t < self.vocab_size for t in r.prompt_ids):
            problem = f"a prompt token id is outside the vocabulary [0, {self.vocab_size})"
        elif r.temperature < 0:
            problem = f"temperature must be >= 0, got {r.temperature}"
        elif not 0 < r.top_p <= 1:
            problem = f"top_p must be in (0, 1], got {r.top_p}"
        elif r.request_id in self._in_flight:
            problem = f"request id {r.request_id!r} is already in flight"
        elif r.constraint is not None:
            problem = self.capabilities.refusal(r.constraint)
        if problem is not None:
            raise EngineRequestError(problem)

    async def context_window(self) -> int | None:
        return self.max_model_len

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._check(request)
        slot = _Slot(request, asyncio.get_running_loop().create_future(), time.perf_counter())
        self._pending.append(slot)
        self._in_flight.add(request.request_id)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work())
        try:
            return await asyncio.wait_for(asyncio.shield(slot.future), request.timeout_s)
        except TimeoutError:
            await self.abort(request.request_id)
            raise EngineTimeout(f"request {request.request_id!r} ran past "
                                f"{request.timeout_s} s") from None
        except asyncio.CancelledError:
            await self.abort(request.request_id)
            raise

    async def abort(self, request_id: str) -> None:
        for slot in self._pending:
            if slot.request.request_id == request_id:
                self._pending.remove(slot)
                self._finish(slot, _aborted_result(slot))
                return
        if request_id in self._in_flight:
            self._aborted.add(request_id)

    async def load(self) -> EngineLoad:
        return EngineLoad(running=self._running, waiting=len(self._pending), kv_usage=0.0)

    async def health(self) -> bool:
        return not self._closed

    async def aclose(self) -> None:
        self._closed = True
        for slot in self._pending:
            slot.future.cancel()
        self._pending.clear()
        self._aborted.update(self._in_flight)
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker

    def _finish(self, slot: _Slot, result: GenerateResult) -> None:
        self._in_flight.discard(slot.request.request_id)
        self._aborted.discard(slot.request.request_id)
        if not slot.future.done():
            slot.future.set_result(result)

    async def _work(self) -> None:
        while self._pending:
            await asyncio.sleep(self.batch_window_s)  # let concurrent requests join
            batch = self._pending[:self.max_batch]
            del self._pending[:self.max_batch]
            if not batch:
                continue
            started = time.perf_counter()
            self._running = len(batch)
            try:
                rows = await asyncio.to_thread(self._sample, [s.request for s in batch])
            except Exception as e:  # the model failed: infrastructure, not the request
                for slot in batch:
                    self._in_flight.discard(slot.request.request_id)
                    if not slot.future.done():
                        slot.future.set_exception(EngineUnavailable(f"the model failed: {e!r}"))
                continue
            finally:
                self._running = 0
            done = time.perf_counter()
            for slot, row in zip(batch, rows, strict=True):
                self._finish(slot, GenerateResult(
                    request_id=slot.request.request_id, output_ids=row.output_ids,
                    logprobs=row.logprobs if slot.request.logprobs else [],
                    finish_reason=row.finish or "length",
                    prompt_tokens=len(slot.request.prompt_ids), cached_tokens=None,
                    queued_s=started - slot.enqueued, generating_s=done - started))

    def _sample(self, requests: list[GenerateRequest]) -> list[_Row]:
        """Run one batch to its end (worker thread)."""
        import torch

        from treadle.train.model import PAD_ID

        n, width = len(requests), max(len(r.prompt_ids) for r in requests)
        ids = torch.full((n, width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding: every row's next token is last
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rows = [_Row(r, torch.Generator().manual_seed(_seed(self.seed, r)),
                     self._eos | frozenset(r.stop_token_ids), [], []) for r in requests]
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             use_cache=True)
            while True:
                logits = out.logits[:, -1, :].float()
                logp = torch.log_softmax(logits, dim=-1)
                step_ids = torch.full((n,), PAD_ID, dtype=torch.long)
                for i, row in enumerate(rows):
                    if row.finish is None:
                        self._step(row, logits[i], logp[i])
                        step_ids[i] = row.output_ids[-1] if row.output_ids else PAD_ID
                if all(row.finish is not None for row in rows):
                    return rows
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
                positions = positions[:, -1:] + 1
                out = self.model(input_ids=step_ids[:, None], attention_mask=mask,
                                 position_ids=positions, past_key_values=out.past_key_values,
                                 use_cache=True)

    def _step(self, row: _Row, logits: torch.Tensor, logp: torch.Tensor) -> None:
        """Sample one token for `row` (or end it when aborted)."""
        import torch

        r = row.request
        if r.request_id in self._aborted:
            row.finish = "abort"
            return
        if r.temperature == 0:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / r.temperature, dim=-1)
            if r.top_p < 1:
                sorted_p, order = torch.sort(probs, descending=True)
                outside = (sorted_p.cumsum(-1) - sorted_p) >= r.top_p  # beyond the nucleus
                probs = probs.scatter(0, order[outside], 0.0)
            token = int(torch.multinomial(probs, 1, generator=row.generator))
        row.output_ids.append(token)
        row.logprobs.append(float(logp[token]))
        if token in row.stops:
            row.finish = "stop"
        elif len(row.output_ids) >= r.max_tokens:
            row.finish = "length"


def _aborted_result(slot: _Slot) -> GenerateResult:
    return GenerateResult(request_id=slot.request.request_id, output_ids=[], logprobs=[],
                          finish_reason="abort", prompt_tokens=len(slot.request.prompt_ids),
                          cached_tokens=None, queued_s=time.perf_counter() - slot.enqueued,
                          generating_s=0.0)
