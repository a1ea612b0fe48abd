"""Test doubles for the runtime: an in-process engine with controllable failures."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from treadle.core.scheduler import EngineState, Phase, TrajectoryScheduler, TrajState
from treadle.engines.base import Engine, EngineLoad, GenerateRequest, GenerateResult
from treadle.engines.errors import EngineUnavailable


@dataclass
class _Call:
    request: GenerateRequest
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    produced: int = 0


class FakeEngine(Engine):
    """Samples `max_tokens` ids (its own counter) at `tokens_per_s`, logprob -0.5 each.
    `abort` ends a call with its tokens so far; `kill()` makes every call and health
    check fail from then on (as a dead process would)."""

    def __init__(self, name: str, tokens_per_s: float = 2000.0) -> None:
        self.name = name
        self.tokens_per_s = tokens_per_s
        self.dead = False
        self.flaky = 0  # the next `flaky` calls raise although the engine stays healthy
        self.requests: list[GenerateRequest] = []
        self._calls: dict[str, _Call] = {}
        self._next_id = 1000
        self.closed = False

    def kill(self) -> None:
        self.dead = True
        for call in self._calls.values():
            call.aborted.set()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.dead:
            raise EngineUnavailable(f"{self.name}: connection refused")
        if self.flaky:
            self.flaky -= 1
            raise EngineUnavailable(f"{self.name}: 503")
        self.requests.append(request)
        call = _Call(request)
        self._calls[request.request_id] = call
        started = time.monotonic()
        ids: list[int] = []
        try:
            step = 1.0 / self.tokens_per_s
            while len(ids) < request.max_tokens:
                try:
                    await asyncio.wait_for(call.aborted.wait(), step)
                except TimeoutError:
                    ids.append(self._next_id % 50_000)
                    self._next_id += 1
                    continue
                if self.dead:
                    raise EngineUnavailable(f"{self.name}: connection reset")
                return GenerateResult(request.request_id, ids, [-0.5] * len(ids), "abort",
                                      len(request.prompt_ids), 0, 0.0,
                                      time.monotonic() - started)
        finally:
            self._calls.pop(request.request_id, None)
        return GenerateResult(request.request_id, ids, [-0.5] * len(ids), "length",
                              len(request.prompt_ids), 0, 0.0, time.monotonic() - started)

    async def abort(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is not None:
            call.aborted.set()

    async def load(self) -> EngineLoad:
        return EngineLoad(len(self._calls), 0, 0.0)

    async def health(self) -> bool:
        return not self.dead

    async def aclose(self) -> None:
        self.closed = True



class FakeManualScheduler(TrajectoryScheduler):
    """Least-loaded routing with an optional admission cap; preempts the trajectories
    put in `to_preempt` at the next decision (a test's hand on the scheduler)."""

    name = "fake-manual"

    def __init__(self, cap: int | None = None) -> None:
        super().__init__()
        self.cap = cap
        self.to_preempt: list[str] = []

    def route(self, t: TrajState, now: float) -> str | None:
        return self.least_loaded()

    def admission_cap(self, e: EngineState) -> int:
        return e.max_batch if self.cap is None else self.cap

    def rebalance(self, now: float) -> None:
        for tid in self.to_preempt:
            t = self.trajs.get(tid)
            if t is not None and t.phase is Phase.RUNNING:
                self._preempt(t, now)
        self.to_preempt.clear()
