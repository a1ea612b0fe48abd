"""One simulated inference engine: continuous batching under the cost model.

Every running sequence advances one token per engine step, so the engine keeps a
single step counter `steps` for the whole batch; a sequence admitted at step s₀
with m tokens to go finishes at step s₀ + m. With n sequences running and total KV
K₀ at the last batch change, step k takes α(n) + β·(K₀ + n·k): the time to any
future step is a closed-form series (`cost_model.series_time`), so the engine jumps
from batch change to batch change instead of stepping token by token.

Also modelled: prefill (it stalls the batch for its duration: no chunked-prefill
overlap), a KV capacity (running sequences first, an LRU prefix cache of idle
trajectories' contexts in what is left), engine-side eviction when the running
batch outgrows the KV cache (the lowest-priority, latest sequence is dropped and
must re-prefill, as vLLM's recompute preemption does), busy time for
utilisation, and pauses (`pause`: weights being loaded, or a colocated trainer
holding the GPUs) during which nothing is decoded and no time is busy. Steps are
continuous (fractional); that error is far below the model's own.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from treadle.core.cost_model import CostModel, series_steps, series_time

ADMIT_HEADROOM = 0.05  # share of the KV cache a join must leave free


@dataclass(slots=True)
class Sequence:
    """A turn generating on the engine."""

    traj_id: str
    done_at_step: float  # engine step at which its last token is sampled
    start_step: float  # engine step at which it joined the batch
    start_tokens: float  # output tokens of this turn already generated when it joined
    priority: float  # lower is more important; evicted last
    seq: int  # admission order (tie-break: latest evicted first)


class SimEngine:
    """Engine state plus closed-form time keeping. The cluster calls `advance(now)`
    before any change, and asks `next_event()` after it."""

    def __init__(self, engine_id: str, tp: int, cost: CostModel, max_batch: int) -> None:
        self.engine_id = engine_id
        self.tp = tp
        self.cost = cost
        self.max_batch = max_batch
        self.kv_capacity = cost.kv_capacity_tokens(tp)
        self.steps = 0.0  # decode steps done by the batch
        self.t = 0.0  # clock time `steps` refers to
        self.stall_until = 0.0  # prefill in progress: no decode before this
        self.paused_until = 0.0  # paused (weights loading, trainer on the GPUs): idle
        self.running: dict[str, Sequence] = {}
        self._done: list[tuple[float, int, str]] = []  # heap of (done_at_step, seq, id)
        self._kv_base = 0.0  # Σ(context at join − start_step): KV = base + n·steps
        self._ctx: dict[str, float] = {}  # traj -> context at join
        self.cache: OrderedDict[str, float] = OrderedDict()  # idle prefixes, LRU first
        self.cache_tokens = 0.0
        self.busy_s = 0.0  # time with at least one sequence (utilisation)
        self._seq = 0
        self.alive = True

    # -- time -----------------------------------------------------------------------

    def kv_used(self) -> float:
        return self._kv_base + len(self.running) * self.steps

    def advance(self, now: float) -> None:
        """Bring `steps` up to clock time `now`."""
        if now <= self.t:
            return
        n = len(self.running)
        if n:
            self.busy_s += max(0.0, now - max(self.t, self.paused_until))
            start = max(self.t, self.stall_until, self.paused_until)
            if now > start:
                alpha, beta = self.cost.step_coeffs(self.tp, n)
                first = alpha + beta * self.kv_used()
                self.steps += series_steps(first, beta * n, now - start)
            self._trim_cache()
        self.t = now

    def next_event(self) -> tuple[float, str] | None:
        """(time, kind) of the next thing the engine does on its own: "done" (a
        sequence finishes) or "kv_full" (the batch outgrows the KV cache)."""
        n = len(self.running)
        if not n:
            return None
        self._drop_stale()
        target, kind = self._done[0][0], "done"
        if n > 1 and self.kv_capacity > 0:
            full_at = (self.kv_capacity - self._kv_base) / n
            if full_at < target:
                target, kind = full_at, "kv_full"
        alpha, beta = self.cost.step_coeffs(self.tp, n)
        start = max(self.t, self.stall_until, self.paused_until)
        ahead = max(0.0, target - self.steps)
        return start + series_time(alpha + beta * self.kv_used(), beta * n, ahead), kind

    # -- batch changes (call advance(now) first) ----------------------------------------

    def fits(self, context_tokens: float) -> bool:
        """Whether a sequence of this context can join with room to grow: like
        vLLM's admission watermark, a join must leave `ADMIT_HEADROOM` of the cache
        free, or an eviction would be followed at once by a re-admission and
        another eviction (a livelock in which prefills stall all decoding)."""
        limit = self.kv_capacity * (1.0 - ADMIT_HEADROOM)
        return len(self.running) < self.max_batch and self.kv_used() + context_tokens <= limit

    def join(self, traj_id: str, now: float, context_tokens: float, new_tokens: float,
             turn_tokens_left: float, turn_tokens_done: float, priority: float) -> float:
        """Add a sequence. Prefills what the prefix cache does not hold (at least
        `new_tokens`), stalling the batch. Returns the prefill time."""
        cached = self.take_cached(traj_id)
        reuse = min(cached, context_tokens - new_tokens)
        prefill = self.cost.prefill_time(self.tp, context_tokens - reuse, reuse)
        self.stall_until = max(self.stall_until, self.paused_until, now) + prefill
        self._seq += 1
        s = Sequence(traj_id, self.steps + turn_tokens_left, self.steps, turn_tokens_done,
                     priority, self._seq)
        self.running[traj_id] = s
        self._ctx[traj_id] = context_tokens
        self._kv_base += context_tokens - self.steps
        heapq.heappush(self._done, (s.done_at_step, s.seq, traj_id))
        self._trim_cache()
        return prefill

    def leave(self, traj_id: str, keep_cache: bool) -> tuple[float, float]:
        """Remove a sequence; returns (its context now, tokens of its turn generated).
        With `keep_cache` its KV stays as a cached prefix."""
        s = self.running.pop(traj_id)
        ctx0 = self._ctx.pop(traj_id)
        self._kv_base -= ctx0 - s.start_step
        generated = self.steps - s.start_step
        context = ctx0 + generated
        if keep_cache:
            self.put_cached(traj_id, context)
        return context, s.start_tokens + generated

    def progress(self, traj_id: str) -> float:
        """Tokens of the running sequence's turn generated so far (as of `advance`)."""
        s = self.running[traj_id]
        return s.start_tokens + self.steps - s.start_step

    def evict_victim(self) -> str:
        """The running sequence the engine drops when KV runs out."""
        return max(self.running.values(), key=lambda s: (s.priority, s.seq)).traj_id

    def finished(self, due: bool) -> list[str]:
        """Sequences whose last token is sampled by now. With `due` (the engine's
        own "done" event fired) the earliest one counts as finished even if the
        closed-form inverse left `steps` a hair short of its target."""
        out = []
        self._drop_stale()
        if due and self._done:
            self.steps = max(self.steps, self._done[0][0])
        while self._done and self._done[0][0] <= self.steps + 1e-6:
            _, seq, tid = heapq.heappop(self._done)
            s = self.running.get(tid)
            if s is not None and s.seq == seq:
                out.append(tid)
        return out

    def _drop_stale(self) -> None:
        """Pop heap entries of sequences that left (or left and joined again)."""
        while self._done:
            _, seq, tid = self._done[0]
            s = self.running.get(tid)
            if s is not None and s.seq == seq:
                return
            heapq.heappop(self._done)

    def pause(self, until: float) -> None:
        """Decode nothing before `until` (call `advance(now)` first); the pause is
        not busy time. Running sequences stay, their KV with them."""
        self.paused_until = max(self.paused_until, until)

    def clear_cache(self) -> None:
        """Drop every cached prefix (KV computed under weights no longer served)."""
        self.cache.clear()
        self.cache_tokens = 0.0

    # -- prefix cache -------------------------------------------------------------------

    def take_cached(self, traj_id: str) -> float:
        tokens = self.cache.pop(traj_id, 0.0)
        self.cache_tokens -= tokens
        return tokens

    def put_cached(self, traj_id: str, tokens: float) -> None:
        self.take_cached(traj_id)
        self.cache[traj_id] = tokens
        self.cache_tokens += tokens
        self._trim_cache()

    def _trim_cache(self) -> None:
        room = self.kv_capacity - self.kv_used()
        while self.cache and self.cache_tokens > room:
            _, tokens = self.cache.popitem(last=False)
            self.cache_tokens -= tokens
