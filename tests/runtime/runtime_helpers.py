"""Test doubles for the runtime: an in-process engine and launcher on a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from treadle.clock import MONOTONIC, Clock
from treadle.core.scheduler import EngineState, Phase, TrajectoryScheduler, TrajState
from treadle.engines.base import (
    Engine,
    EngineCapabilities,
    EngineLoad,
    GenerateRequest,
    GenerateResult,
    PauseMode,
)
from treadle.engines.errors import EngineModelMissing, EngineStartError, EngineUnavailable
from treadle.runtime.launcher import EngineLauncher, LaunchedEngine


@dataclass
class _Call:
    request: GenerateRequest
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class FakeEngine(Engine):
    """Samples `max_tokens` ids (its own counter) at `tokens_per_s` of `clock` (real
    time unless given a fake one), logprob -0.5 each, so a call of n tokens takes
    exactly n / tokens_per_s clock seconds.
    `abort` ends a call with the tokens of the time it ran; `kill()` makes every call
    and health check fail from then on (as a dead process would); `stop()` makes it
    answer nothing, health checks included, and its calls in flight never end (as a
    SIGSTOPped process); `model_missing` makes every call a 404 for its model;
    `update_weights` takes `load_s` of its clock and records what it was told (it
    declares no pause mode: nothing may be in flight while it loads)."""

    def __init__(self, name: str, clock: Clock = MONOTONIC, tokens_per_s: float = 2000.0, *,
                 dead: bool = False, load_s: float = 0.0) -> None:
        self.name = name
        self.clock = clock
        self.tokens_per_s = tokens_per_s
        self.dead = dead
        self.stopped = False  # answers nothing, ends no call (see `stop`)
        self.model_missing = False  # every call: "the model does not exist"
        self.flaky = 0  # the next `flaky` calls raise although the engine stays healthy
        self.requests: list[GenerateRequest] = []
        self.weights: tuple[str, int] | None = None  # the last update_weights
        self.load_s = load_s
        self.loading_with_calls = 0  # loads begun while a call was in flight
        self._calls: dict[str, _Call] = {}
        self._next_id = 1000
        self.closed = False

    def kill(self) -> None:
        self.dead = True
        for call in self._calls.values():
            call.aborted.set()

    def stop(self) -> None:
        self.stopped = True

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.dead:
            raise EngineUnavailable(f"{self.name}: connection refused")
        if self.model_missing:
            raise EngineModelMissing(f"{self.name}: the model `m` does not exist")
        if self.flaky:
            self.flaky -= 1
            raise EngineUnavailable(f"{self.name}: 503")
        self.requests.append(request)
        call = _Call(request)
        self._calls[request.request_id] = call
        started = self.clock.now()
        try:
            try:
                async with self.clock.timeout(request.max_tokens / self.tokens_per_s):
                    await call.aborted.wait()
            except TimeoutError:
                if self.stopped:  # a stopped process answers only when cancelled
                    await asyncio.Event().wait()
                return self._result(request, request.max_tokens, "length", started)
            if self.dead:
                raise EngineUnavailable(f"{self.name}: connection reset")
            ran = (self.clock.now() - started) * self.tokens_per_s
            return self._result(request, min(request.max_tokens, int(ran + 1e-6)), "abort",
                                started)
        finally:
            self._calls.pop(request.request_id, None)

    def _result(self, request: GenerateRequest, n: int, finish: str,
                started: float) -> GenerateResult:
        ids = [(self._next_id + i) % 50_000 for i in range(n)]
        self._next_id += n
        return GenerateResult(request.request_id, ids, [-0.5] * n, finish,  # type: ignore[arg-type]
                              len(request.prompt_ids), 0, 0.0, self.clock.now() - started)

    async def abort(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is not None:
            call.aborted.set()

    async def load(self) -> EngineLoad:
        return EngineLoad(len(self._calls), 0, 0.0)

    async def health(self) -> bool:
        return not self.dead and not self.stopped

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(weight_updates=True)

    async def update_weights(self, weights_path: str, policy_version: int,
                             mode: PauseMode = "drain", *, recompute_kept: bool = True) -> None:
        if self.dead:
            raise EngineUnavailable(f"{self.name}: connection refused")
        self.loading_with_calls += bool(self._calls)
        await self.clock.sleep(self.load_s)
        self.weights = (weights_path, policy_version)

    async def aclose(self) -> None:
        self.closed = True


class FakeLauncher(EngineLauncher):
    """Starts a `FakeEngine` after `startup_s` of `clock`, as a process takes to come
    up. `refuse` makes starts from the n-th on (0-based) raise EngineStartError;
    `doomed` makes engines from the n-th on dead on arrival (they die at their first
    call). Keeps every engine it started and the clock time of every start."""

    def __init__(self, clock: Clock, *, startup_s: float = 2.0, tokens_per_s: float = 2000.0,
                 refuse: int | None = None, doomed: int | None = None) -> None:
        self.clock = clock
        self.startup = startup_s
        self.tokens_per_s = tokens_per_s
        self.refuse = refuse
        self.doomed = doomed
        self.started: list[FakeEngine] = []  # engines that came up, in order
        self.starts: list[float] = []  # clock time of every start, failed ones too
        self.stopped: list[str] = []  # names of engines stopped

    async def start(self, tp: int) -> LaunchedEngine:
        index = len(self.starts)
        self.starts.append(self.clock.now())
        await self.clock.sleep(self.startup)
        if self.refuse is not None and index >= self.refuse:
            raise EngineStartError(f"start {index} refused")
        name = f"launched-{index}"
        engine = FakeEngine(name, self.clock, self.tokens_per_s,
                            dead=self.doomed is not None and index >= self.doomed)
        self.started.append(engine)

        async def stop() -> None:
            self.stopped.append(name)

        return LaunchedEngine(engine, tp, 16, 1 << 20, f"fake://{name}", name, stop)

    def startup_s(self, tp: int) -> float:
        return self.startup


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop until `condition` holds: an event, never a duration. An
    autojumping fake clock does not move meanwhile (the loop is never idle), so the
    condition must come about without time passing."""
    while not condition():
        await asyncio.sleep(0)


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
