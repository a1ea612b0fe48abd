"""An emulated engine: continuous batching in wall-clock time under the cost model.

`EmulatedEngine` holds one engine's state and runs one asyncio task (`run`) that
wakes at each step boundary; `emulated_server` puts vLLM's HTTP API in front of it
(`treadle engine emulate`). Tokens are synthetic; only the timing and the batching
behaviour are modelled, so a runtime, a scheduler or a benchmark can be driven
against "a 14B model on H100s" on a laptop.

What it models (`treadle.core.cost_model.CostModel`):

- Continuous batching: every running request gains one token per step; a step takes
  `step_time(tp, batch, KV tokens of the batch) × time_scale`.
- Prefill: a newly admitted request's uncached prompt tokens cost
  `prefill_time(tp, new, cached) × time_scale`, stalling the batch (no chunked
  prefill), as in `treadle.sim.engine`.
- Admission: a priority queue (lower `priority` first, FCFS ties), at most
  `max_num_seqs` running, and the KV capacity (`kv_capacity_tokens(tp)`, 5% kept
  free as vLLM's watermark does). A batch that outgrows the KV cache preempts its
  lowest-priority, latest request back to the queue (recompute, like vLLM).
- A prefix cache of 16-token blocks, keyed by a chained hash of the token ids (as
  vLLM's block hashes are), LRU, in the KV left over by the running batch; a hit
  skips prefill of those tokens and is reported as `cached_tokens`.
- Abort: `abort(id)` ends a request at once with its tokens so far; its slot is free
  for the next step.
- Weight updates, as vLLM's RL endpoints do them: `pause(mode)` with "abort" (every
  request ends now, with its tokens), "drain" (nothing new is admitted; returns once
  the running batch has finished) or "keep" (nothing steps or is admitted: requests
  freeze with their KV); `reload()` takes `load_s` (scaled) and labels the weights
  (`weight_version`); `resume()`. Each result says which weights sampled which of
  its tokens (`GenerateResult.version_spans`). A request's `cache_salt` roots its
  block hashes, so KV cached under one salt never serves another.

What it does not model: real token content (ids and logprobs come from a seeded
RNG), sampling parameters other than `max_tokens` and `stop_token_ids`, chunked
prefill, speculative decoding, shared prompt blocks counted once in KV (each running
request counts its whole context), CPU-side overheads of a real server. Timing is
wall clock: when the event loop wakes late it catches up by running the missed steps
at once, so long-run rates follow the model even where one step is shorter than the
loop's timer resolution.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import heapq
import itertools
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from treadle.core.cost_model import CostModel
from treadle.engines.base import EngineLoad, FinishReason, GenerateResult, PauseMode, VersionSpan

BLOCK = 16  # prefix-cache block size in tokens (vLLM's default)
VOCAB = 151_936  # Qwen3's vocabulary size: synthetic ids fall in [0, VOCAB)
WATERMARK = 0.05  # share of KV kept free at admission (vLLM's watermark)
_MAX_CATCH_UP_STEPS = 10_000  # steps run in one wake-up when far behind


@dataclass(eq=False, slots=True)
class _Seq:
    request_id: str
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    priority: int
    arrival: int  # FCFS tie-break and preemption order
    rng: random.Random
    done: asyncio.Future[GenerateResult]
    arrived_at: float  # clock time the request arrived
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    started_at: float | None = None  # clock time of its first admission
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    # Block hashes of the context's full blocks hashed so far: the context only grows,
    # so each block is hashed once per request, not at every lookup and insert.
    chain: list[bytes] = field(default_factory=list)
    salt: bytes = b""  # roots the chain (the request's cache_salt)
    # (weights label, index of the first output token it sampled), in order.
    version_starts: list[tuple[str | None, int]] = field(default_factory=list)

    @property
    def context(self) -> int:
        return len(self.prompt) + len(self.output)


class PrefixCache:
    """LRU set of block hashes; `match` gives how many leading tokens are cached."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    @staticmethod
    def hashes(ids: list[int]) -> list[bytes]:
        """Chained hashes of the full blocks of `ids`: block k's hash covers blocks 0..k."""
        return PrefixCache.extend([], ids)

    @staticmethod
    def extend(chain: list[bytes], tail: list[int], root: bytes = b"") -> list[bytes]:
        """`chain` (the hashes of some whole blocks) extended in place by the full
        blocks of `tail`, the ids that follow those blocks; returned. `root` (a cache
        salt) is hashed into the first block, and so into every block after it."""
        prev = chain[-1] if chain else root
        try:
            # Fixed-width bytes, packed once: the same blocks hash alike, as with text,
            # at a tenth of the cost (this ran on every request of every engine).
            raw, width = array.array("q", tail).tobytes(), 8
        except OverflowError:  # an id past 64 bits (a client's bad request): as text
            raw, width = None, 0
        for start in range(0, len(tail) - BLOCK + 1, BLOCK):
            block = (raw[start * width:(start + BLOCK) * width] if raw is not None
                     else ",".join(map(str, tail[start:start + BLOCK])).encode())
            prev = hashlib.blake2b(prev + block, digest_size=16).digest()
            chain.append(prev)
        return chain

    def match(self, ids: list[int]) -> int:
        return self.match_chain(self.hashes(ids))

    def match_chain(self, chain: list[bytes]) -> int:
        """How many leading tokens of the blocks `chain` hashes are cached (touched)."""
        hits = 0
        for h in chain:
            if h not in self._blocks:
                break
            hits += 1
        self._touch(chain[:hits])
        return hits * BLOCK

    def insert(self, ids: list[int]) -> None:
        self.insert_chain(self.hashes(ids))

    def insert_chain(self, chain: list[bytes]) -> None:
        for h in chain:
            self._blocks[h] = None
        self._touch(chain)

    def _touch(self, chain: list[bytes]) -> None:
        # Deepest block first, so a prefix's tail is evicted before its head (as vLLM
        # frees blocks in reverse): an evicted head would orphan the blocks after it.
        for h in reversed(chain):
            self._blocks.move_to_end(h)

    def trim(self, max_blocks: int) -> None:
        while len(self._blocks) > max(0, max_blocks):
            self._blocks.popitem(last=False)


class EmulatedEngine:
    """One emulated engine. Create, `start()` inside the event loop, then `submit`.

    `time_scale` multiplies every modelled duration (0.05 = 20x faster than real).
    `max_model_len` bounds prompt + max_tokens (default: the model's context).
    `load_s`: how long loading new weights takes (before `time_scale`).
    All methods must be called from the loop that ran `start`.
    """

    def __init__(self, cost: CostModel, *, tp: int = 1, time_scale: float = 1.0,
                 max_num_seqs: int = 256, max_model_len: int | None = None, seed: int = 0,
                 load_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if tp < 1 or time_scale <= 0 or max_num_seqs < 1 or load_s < 0:
            raise ValueError("tp and max_num_seqs must be >= 1, time_scale > 0 and "
                             "load_s >= 0")
        self.cost = cost
        self.tp = tp
        self.time_scale = time_scale
        self.max_num_seqs = max_num_seqs
        self.kv_capacity = cost.kv_capacity_tokens(tp)
        if self.kv_capacity <= 0:
            raise ValueError(f"{cost.model.name} does not fit on {tp} x {cost.gpu.name}")
        self.max_model_len = min(max_model_len or cost.model.max_context, self.kv_capacity)
        self.seed = seed
        self.load_s = load_s
        self.weight_version: str | None = None  # the label of the weights served
        self.paused: PauseMode | None = None  # the pause in force ("abort" holds new ones)
        self._drained = asyncio.Event()  # set when the running batch empties
        self._clock = clock
        self._waiting: list[tuple[int, int, _Seq]] = []  # heap (priority, arrival, seq)
        self._running: dict[str, _Seq] = {}
        self._kv = 0  # tokens of context of the running batch (its KV), kept as it changes
        self._known: dict[str, _Seq] = {}  # every unfinished request, by id
        self._cache = PrefixCache()
        self._arrivals = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0  # decode steps run so far
        self.decode_s = 0.0  # modelled seconds of those steps (time_scale applied)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.generated = 0  # tokens sampled by requests that ended (aborted ones included)
        self.preemptions = 0  # requests sent back to the queue because KV ran out

    # -- public ---------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        """End the loop; every unfinished request ends with finish "abort"."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for rid in list(self._known):
            self.abort(rid)

    def check(self, prompt: list[int], max_tokens: int) -> None:
        """ValueError (with the reason) if this request can never run here."""
        if not prompt:
            raise ValueError("prompt must hold at least one token id")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        bad = next((t for t in prompt if not 0 <= t < VOCAB), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {VOCAB})")
        if len(prompt) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                             f"exceeds the maximum model length {self.max_model_len}")

    def submit(self, request_id: str, prompt: list[int], max_tokens: int, *,
               priority: int = 0, stop_token_ids: list[int] | None = None,
               cache_salt: str | None = None) -> asyncio.Future[GenerateResult]:
        """Queue a request; the future resolves with its result (or abort). While the
        engine is paused it waits in the queue."""
        self.check(prompt, max_tokens)
        if request_id in self._known:
            raise ValueError(f"request id {request_id!r} is already in flight")
        arrival = next(self._arrivals)
        # Seeded per engine and arrival order: the same seed and arrival sequence
        # gives the same tokens, while GRPO siblings of one prompt still differ.
        digest = hashlib.blake2b(f"{self.seed}:{arrival}:{len(prompt)}".encode(),
                                 digest_size=8).digest()
        seq = _Seq(request_id, list(prompt), max_tokens, frozenset(stop_token_ids or ()),
                   priority, arrival, random.Random(int.from_bytes(digest, "big")),
                   asyncio.get_running_loop().create_future(), self._clock(),
                   salt=b"" if cache_salt is None else cache_salt.encode())
        self._known[request_id] = seq
        heapq.heappush(self._waiting, (priority, arrival, seq))
        self._wake.set()
        return seq.done

    def abort(self, request_id: str) -> bool:
        """End a request now with its tokens so far; False if it is not in flight."""
        seq = self._known.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        self._wake.set()
        return True

    async def pause(self, mode: PauseMode) -> None:
        """Stop admitting requests; "abort" ends every request now, "drain" returns
        once the running batch has finished, "keep" freezes it (no step runs)."""
        self.paused = mode
        if mode == "abort":
            for rid in list(self._known):
                self.abort(rid)
        elif mode == "drain":
            while self._running:
                self._drained.clear()
                await self._drained.wait()
        self._wake.set()

    async def reload(self) -> None:
        """Load new weights: `load_s`, scaled (there are none to load)."""
        await asyncio.sleep(self.load_s * self.time_scale)

    def label_weights(self, version: str) -> None:
        """Name the weights served; tokens sampled from now on carry `version`."""
        self.weight_version = version

    def resume(self) -> None:
        """Admit and step again after `pause`."""
        self.paused = None
        self._wake.set()

    @property
    def generating(self) -> int:
        """Tokens sampled so far by requests not ended yet (what an abort would end)."""
        return sum(len(seq.output) for seq in self._known.values())

    def load(self) -> EngineLoad:
        return EngineLoad(len(self._running), len(self._known) - len(self._running),
                          self._kv_used() / self.kv_capacity)

    # -- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        """Admit, prefill, step, finish; sleep until the next step boundary."""
        next_t = self._clock()
        while True:
            stall = self._admit()
            if not self._running or self.paused == "keep":
                self._wake.clear()
                await self._wake.wait()
                next_t = self._clock()
                continue
            next_t = max(next_t, self._clock() - 1.0)  # forget debts older than 1 s
            next_t += stall
            steps = 0
            # Run every step whose boundary has passed (catch-up), at least one.
            while self._running and steps < _MAX_CATCH_UP_STEPS:
                took = self._step_duration()
                next_t += took
                self.decode_s += took
                self._step()
                steps += 1
                if next_t > self._clock() or self._waiting_can_join():
                    break
            # An arrival does not cut a step short; it is admitted at the boundary.
            # Sleep even when behind (0 s), or HTTP handlers would starve.
            await asyncio.sleep(max(0.0, next_t - self._clock()))

    def _step_duration(self) -> float:
        return self.cost.step_time(self.tp, len(self._running), self._kv_used()) \
            * self.time_scale

    def _step(self) -> None:
        self.steps += 1
        self._kv += len(self._running)  # one token each, before any of them finishes
        for seq in list(self._running.values()):
            if not seq.version_starts or seq.version_starts[-1][0] != self.weight_version:
                seq.version_starts.append((self.weight_version, len(seq.output)))
            token = seq.rng.randrange(VOCAB)
            seq.output.append(token)
            seq.logprobs.append(-seq.rng.expovariate(1.5))  # ≤ 0, mean -0.67
            if token in seq.stop_ids:
                self._finish(seq, "stop")
            elif len(seq.output) >= seq.max_tokens:
                self._finish(seq, "length")
        self._preempt_if_full()

    def _kv_used(self) -> int:
        return self._kv

    def _chain(self, seq: _Seq) -> list[bytes]:
        """`seq.chain` extended over the full blocks of its context not hashed yet."""
        done, prompt = len(seq.chain) * BLOCK, len(seq.prompt)
        tail = (seq.prompt[done:] + seq.output) if done < prompt else seq.output[done - prompt:]
        return PrefixCache.extend(seq.chain, tail, seq.salt)

    def _waiting_can_join(self) -> bool:
        return (bool(self._waiting) and len(self._running) < self.max_num_seqs
                and self.paused is None)

    def _admit(self) -> float:
        """Move waiting requests into the batch while they fit; the prefill time (scaled)."""
        limit = self.kv_capacity * (1.0 - WATERMARK)
        used = self._kv_used()
        prefill = 0.0
        while self._waiting and len(self._running) < self.max_num_seqs and self.paused is None:
            _, _, seq = self._waiting[0]
            if self._known.get(seq.request_id) is not seq:  # aborted while waiting
                heapq.heappop(self._waiting)
                continue
            if used + seq.context > limit and self._running:
                break  # the head waits for room; nothing overtakes it (no starvation)
            heapq.heappop(self._waiting)
            chain, context = self._chain(seq), seq.context
            # vLLM always computes at least the last token, so a full hit is capped.
            cached = min(self._cache.match_chain(chain), (context - 1) // BLOCK * BLOCK)
            if seq.started_at is None:
                seq.started_at = self._clock()
                seq.cached_tokens = cached
                self.prefix_queries += context
                self.prefix_hits += cached
            prefill += self.cost.prefill_time(self.tp, context - cached, cached)
            self._cache.insert_chain(chain)
            self._running[seq.request_id] = seq
            self._kv += context
            used += context
        self._trim_cache()
        return prefill * self.time_scale

    def _preempt_if_full(self) -> None:
        while len(self._running) > 1 and self._kv_used() > self.kv_capacity:
            victim = max(self._running.values(), key=lambda s: (s.priority, s.arrival))
            del self._running[victim.request_id]
            self._kv -= victim.context
            self.preemptions += 1
            heapq.heappush(self._waiting, (victim.priority, victim.arrival, victim))
        self._trim_cache()

    def _trim_cache(self) -> None:
        self._cache.trim((self.kv_capacity - self._kv_used()) // BLOCK)

    def _finish(self, seq: _Seq, reason: FinishReason) -> None:
        self.generated += len(seq.output)
        self._known.pop(seq.request_id, None)
        if self._running.pop(seq.request_id, None) is not None:  # a waiting one is
            self._kv -= seq.context  # skipped when popped
            if not self._running:
                self._drained.set()
        if reason != "abort":
            self._cache.insert_chain(self._chain(seq))  # the turn's KV stays cached
        now = self._clock()
        started = seq.started_at if seq.started_at is not None else now
        if not seq.done.done():
            seq.done.set_result(GenerateResult(
                request_id=seq.request_id, output_ids=list(seq.output),
                logprobs=list(seq.logprobs), finish_reason=reason,
                prompt_tokens=len(seq.prompt), cached_tokens=seq.cached_tokens,
                queued_s=started - seq.arrived_at, generating_s=now - started,
                version_spans=_spans(seq)))


def _spans(seq: _Seq) -> tuple[VersionSpan, ...]:
    """Which weights sampled which output tokens of `seq`."""
    ends = [start for _, start in seq.version_starts[1:]] + [len(seq.output)]
    return tuple(VersionSpan(label, start, end)
                 for (label, start), end in zip(seq.version_starts, ends, strict=True))
