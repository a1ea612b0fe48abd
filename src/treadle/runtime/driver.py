"""The live runtime: treadle's scheduling core driven by real engines on a real clock.

    runtime = Runtime(build_policy(...), launcher=LocalLauncher(EmulatedProcess()), gpus=8)
    await runtime.start()                              # the policy's initial pool
    turns = runtime.turns("t0", group_id="g0")         # a TurnRunner for the agent loop
    traj = await run_agent(episode, tokenizer, turns, traj_id="t0", key=...)
    await runtime.close()

It is the counterpart of the simulator's `Cluster`: it feeds the scheduler
(`core.scheduler.Scheduler`) the events of real trajectories in time order and
carries out its decisions —

- `Admit`: the trajectory's waiting turn is sent to that engine with that priority;
- `Preempt`: the engine aborts the call; the turn keeps its tokens and waits for
  its next admission (see `runtime.turns`);
- `Migrate`: counted; the next turn goes to the new engine, which prefills the
  context itself (no engine here can receive KV from another);
- `AddEngine`: the launcher starts an engine of that TP degree (`EngineAdded` when
  it is healthy); `DrainEngine`: nothing more is sent there and it is stopped and
  removed (`EngineRemoved`) once no call is in flight on it.

Time is the `Clock`'s (`ScaledClock` replays a trace faster than real while the
scheduler sees the trace's seconds). The scheduler is called synchronously on the
event loop; its calls are timed (`Runtime.control`), since a slow decision delays
every trajectory. Nothing else blocking runs on the loop: engines are HTTP
clients, tools run in sandboxes (subprocesses), file I/O goes to threads.

Failures: an engine whose call fails is health-checked; a dead one is failed
(`EngineFailed`, every trajectory it held is re-routed, re-prefilled elsewhere)
and stopped. A background check fails engines that stop answering while idle.
When the last engine fails and none is starting, trajectories waiting for a turn
end at once with `NoEngineAvailable`; with no engine at all, a waiting turn gives
up after `engine_wait_s`. Every engine call carries `request_timeout_s`.

Weight updates: `pause("wait")` holds new calls and waits until none is in flight;
`pause("abort")` also aborts the calls in flight (their turns resume later). After
the engines' weights change, `resume(policy_version=v)` stamps `v` on every token
sampled from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from treadle.core.events import (
    AddEngine,
    Admit,
    Decision,
    DrainEngine,
    EngineAdded,
    EngineDraining,
    EngineFailed,
    EngineRemoved,
    Event,
    Migrate,
    Preempt,
    TurnFinished,
)
from treadle.core.scheduler import Scheduler
from treadle.engines.base import Engine
from treadle.engines.errors import EngineError, EngineStartError, NoEngineAvailable
from treadle.runtime.clock import Clock, WallClock
from treadle.runtime.launcher import EngineLauncher, LaunchedEngine
from treadle.runtime.turns import ScheduledTurns

log = logging.getLogger(__name__)
_CONTROL_SAMPLES = 200_000  # decision timings kept for percentiles


@dataclass(slots=True)
class EngineSlot:
    """One engine as the runtime holds it."""

    engine_id: str  # the scheduler's name for it
    engine: Engine  # its client
    tp: int
    max_batch: int
    kv_capacity_tokens: int
    label: str  # for logs and status
    launched: LaunchedEngine | None = None  # set when this runtime started it
    calls: int = 0  # calls in flight
    draining: bool = False
    failed: bool = False
    health_failures: int = 0  # consecutive failed background checks


def _samples() -> deque[float]:
    return deque(maxlen=_CONTROL_SAMPLES)


@dataclass(slots=True)
class ControlStats:
    """What the control plane cost. One sample per `decide`: its CPU time plus that
    of the `on_event` calls since the previous one (the scheduler's work for that
    instant: a turn's end, a tool's return, and whatever it set off). CPU time of
    the thread, not wall time: on a loaded machine the operating system's own
    preemption would otherwise be counted as the scheduler's. Samples in
    which the scheduler re-placed the whole batch (`Scheduler.replans` went up: at
    arrivals and periodically) are kept apart from the others, so that both costs
    are seen. Under load one decision covers the events of several turns, so each
    plain sample is also divided by the turns that ended in it (at least one) for
    the cost per turn. The latest `_CONTROL_SAMPLES` of each are kept."""

    plain: deque[float] = field(default_factory=_samples)  # decisions without a re-plan
    replans: deque[float] = field(default_factory=_samples)  # decisions with one
    per_turn: deque[float] = field(default_factory=_samples)  # plain ones / turns ended
    decisions: int = 0  # decide() calls
    events: int = 0  # on_event() calls
    max_live: int = 0  # most trajectories alive at once
    observer: Callable[[float], None] | None = None  # told every sample (e.g. metrics)

    def record(self, seconds: float, turns: int, replanned: bool) -> None:
        self.decisions += 1
        if self.observer is not None:
            self.observer(seconds)
        if replanned:
            self.replans.append(seconds)
        else:
            self.plain.append(seconds)
            self.per_turn.append(seconds / max(1, turns))

    def percentile_ms(self, q: float, which: str = "all") -> float:
        """The q-quantile (0-1) in milliseconds (0 with no samples) of "plain",
        "replans", "per_turn" or "all" (plain and replans together)."""
        samples = ([*self.plain, *self.replans] if which == "all"
                   else list(getattr(self, which)))
        if not samples:
            return 0.0
        samples.sort()
        return 1000.0 * samples[min(len(samples) - 1, int(q * len(samples)))]


class Runtime:
    """Drives one `Scheduler` over a pool of engines. See the module docstring."""

    def __init__(self, scheduler: Scheduler, *, launcher: EngineLauncher | None = None,
                 gpus: int = 0, clock: Clock | None = None,
                 request_timeout_s: float | None = 600.0, turn_retries: int = 3,
                 engine_wait_s: float = 60.0, health_interval_s: float = 5.0) -> None:
        self.scheduler = scheduler
        self.launcher = launcher
        self.gpus = gpus  # GPUs the launcher may use (initial pool and AddEngine)
        self.clock: Clock = clock or WallClock()
        self.request_timeout_s = request_timeout_s  # real seconds per engine call
        self.turn_retries = turn_retries  # calls repeated on a live engine before giving up
        self.engine_wait_s = engine_wait_s  # real seconds a turn waits with no engine at all
        self.health_interval_s = health_interval_s  # real seconds between idle checks
        self.policy_version = 0  # stamped on every sampled token
        self.control = ControlStats()
        self.failures: deque[tuple[str, str]] = deque(maxlen=8)  # (engine, why), latest
        self._slots: dict[str, EngineSlot] = {}
        self._runners: dict[str, ScheduledTurns] = {}
        self._next_engine = 0
        self._launching = 0
        self._gpus_used = 0
        self._pending_control = 0.0
        self._pending_turns = 0
        self._decide_soon = False
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at: float | None = None
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()  # no call in flight anywhere
        self._idle.set()
        self._inflight = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._monitor: asyncio.Task[None] | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------

    async def start(self, pool: Sequence[int] | None = None) -> None:
        """Start `pool` (TP degrees; default the scheduler's initial pool on `gpus`)
        with the launcher, if there is one, and the health checks. EngineStartError if
        no engine of the pool came up."""
        if self.launcher is not None and (self.gpus > 0 or pool):
            pool = list(pool) if pool else self.scheduler.initial_pool(self.gpus)
            results = await asyncio.gather(*(self._launch(tp) for tp in pool),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors and len(errors) == len(results):
                raise EngineStartError(f"no engine of the pool {pool} started: {errors[0]}")
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch_health())

    async def close(self) -> None:
        """Stop engines this runtime launched, close every client; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._wake is not None:
            self._wake.cancel()
        tasks = [t for t in (self._monitor, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(self._stop(s) for s in self._slots.values()),
                             return_exceptions=True)

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    # -- trajectories -------------------------------------------------------------------

    def turns(self, traj_id: str, group_id: str) -> ScheduledTurns:
        """The runner of a new trajectory (its first `generate` announces it)."""
        if traj_id in self._runners:
            raise ValueError(f"trajectory {traj_id!r} is already running")
        runner = ScheduledTurns(self, traj_id, group_id)
        self._runners[traj_id] = runner
        self.control.max_live = max(self.control.max_live, len(self._runners))
        return runner

    @property
    def live_trajectories(self) -> int:
        return len(self._runners)

    # -- engines --------------------------------------------------------------------------

    def register_engine(self, engine: Engine, *, tp: int = 1, max_batch: int = 256,
                        kv_capacity_tokens: int = 1 << 20, label: str = "",
                        launched: LaunchedEngine | None = None) -> str:
        """Add a healthy engine to the pool; returns its id. The runtime closes its
        client on removal (and stops it if `launched`)."""
        eid = f"e{self._next_engine:03d}"
        self._next_engine += 1
        self._slots[eid] = EngineSlot(eid, engine, tp, max_batch, kv_capacity_tokens,
                                      label or eid, launched)
        self._emit(EngineAdded(eid, tp, max_batch, kv_capacity_tokens))
        return eid

    def drain_engine(self, engine_id: str) -> None:
        """Send nothing more to the engine; it is removed once idle."""
        slot = self._slot(engine_id)
        if not slot.draining:
            self._emit(EngineDraining(engine_id))
            slot.draining = True  # at once: its DrainEngine decision comes at the next decide

    def remove_engine(self, engine_id: str, reason: str = "removed") -> None:
        """Take the engine away now; its trajectories move elsewhere (re-prefill)."""
        self._fail_engine(self._slot(engine_id), reason)

    def engines(self) -> list[EngineSlot]:
        """The engines in the pool (failed and removed ones are gone)."""
        return list(self._slots.values())

    def has_engines(self) -> bool:
        """True while an engine is live or starting."""
        return self._launching > 0 or any(not s.failed and not s.draining
                                          for s in self._slots.values())

    def no_engine_error(self) -> NoEngineAvailable:
        failed = "; ".join(f"{label}: {why}" for label, why in self.failures)
        return NoEngineAvailable("no engine left to run the turn" +
                                 (f" (failed: {failed})" if failed else ""))

    # -- weight updates -------------------------------------------------------------------

    async def pause(self, mode: Literal["wait", "abort"] = "wait") -> None:
        """Hold new engine calls; return once none is in flight. "abort" aborts the
        calls in flight (their turns keep their tokens and resume after `resume`)."""
        self._gate.clear()
        if mode == "abort":
            for runner in list(self._runners.values()):
                runner._abort_for_pause()
        await self._idle.wait()

    async def update_weights(self, weights_path: str, policy_version: int,
                             mode: Literal["wait", "abort"] = "wait") -> None:
        """The weight-update barrier: pause (`mode`), load `weights_path` into every
        engine, resume stamping `policy_version`. ValueError (before pausing) if an
        engine cannot load weights; an engine that fails to load them is failed (its
        turns move to the others, which serve the new weights) so that no token of
        the old weights is stamped with the new version."""
        slots = list(self._slots.values())
        unable = [s.label for s in slots if not hasattr(s.engine, "update_weights")]
        if unable:
            raise ValueError(f"engines cannot load weights: {', '.join(unable)}")
        await self.pause(mode)
        try:
            results = await asyncio.gather(
                *(s.engine.update_weights(weights_path, policy_version)  # type: ignore[attr-defined]
                  for s in slots), return_exceptions=True)
            for slot, result in zip(slots, results, strict=True):
                if isinstance(result, BaseException):
                    self._fail_engine(slot, f"weight update failed: {result}")
        finally:
            self.resume(policy_version)

    @property
    def paused(self) -> bool:
        return not self._gate.is_set()

    def resume(self, policy_version: int | None = None) -> None:
        """Let calls go again, stamping `policy_version` (if given) from now on."""
        if policy_version is not None:
            self.policy_version = policy_version
        self._gate.set()

    # -- the scheduler ----------------------------------------------------------------------

    def _emit(self, event: Event) -> None:
        started = time.thread_time()
        self.scheduler.on_event(event, self.clock.now())
        self._pending_control += time.thread_time() - started
        self._pending_turns += isinstance(event, TurnFinished)
        self.control.events += 1
        if not self._decide_soon and not self._closed:
            self._decide_soon = True
            asyncio.get_running_loop().call_soon(self._decide)

    def _decide(self) -> None:
        self._decide_soon = False
        if self._closed:
            return
        replans = self.scheduler.replans
        started = time.thread_time()
        decisions = self.scheduler.decide(self.clock.now())
        self.control.record(time.thread_time() - started + self._pending_control,
                            self._pending_turns, self.scheduler.replans != replans)
        self._pending_control, self._pending_turns = 0.0, 0
        for d in decisions:
            self._apply(d)
        self._plan_wakeup()

    def _plan_wakeup(self) -> None:
        wake = self.scheduler.wakeup()
        if wake is None or not self._runners:
            return
        if self._wake is not None and self._wake_at is not None and self._wake_at <= wake:
            return
        if self._wake is not None:
            self._wake.cancel()
        delay = self.clock.real_seconds(wake - self.clock.now())
        self._wake_at = wake
        self._wake = asyncio.get_running_loop().call_later(delay, self._woken)

    def _woken(self) -> None:
        self._wake = self._wake_at = None
        if not self._decide_soon:
            self._decide()

    def _apply(self, d: Decision) -> None:
        if isinstance(d, Admit):
            runner = self._runners.get(d.traj_id)
            if runner is not None:
                runner._admit(d.engine_id, d.priority)
        elif isinstance(d, Preempt):
            runner = self._runners.get(d.traj_id)
            if runner is not None:
                runner._preempt(d.engine_id)
        elif isinstance(d, Migrate):
            pass  # live, a move is the next Admit naming the new engine (re-prefill)
        elif isinstance(d, AddEngine):
            if self.launcher is None:
                log.warning("the scheduler asked for a TP-%d engine, but the runtime has "
                            "no launcher", d.tp)
            else:
                self._spawn(self._launch_or_log(d.tp))
        elif isinstance(d, DrainEngine):
            slot = self._slots.get(d.engine_id)
            if slot is not None:
                slot.draining = True
                self._remove_if_idle(slot)

    # -- engine bookkeeping ---------------------------------------------------------------------

    async def _launch(self, tp: int) -> str:
        assert self.launcher is not None
        if self.gpus and self._gpus_used + tp > self.gpus:
            raise EngineStartError(f"no room for a TP-{tp} engine: {self._gpus_used}/"
                                   f"{self.gpus} GPUs in use")
        self._gpus_used += tp
        self._launching += 1
        try:
            launched = await self.launcher.start(tp)
        except BaseException:
            self._gpus_used -= tp
            self._launching -= 1
            if not self.has_engines():  # that was the last hope of the waiting turns
                self._fail_waiters()
            raise
        self._launching -= 1
        return self.register_engine(launched.engine, tp=tp, max_batch=launched.max_batch,
                                    kv_capacity_tokens=launched.kv_capacity_tokens,
                                    label=launched.label, launched=launched)

    async def _launch_or_log(self, tp: int) -> None:
        try:
            await self._launch(tp)
        except EngineError as e:
            log.error("could not add a TP-%d engine: %s", tp, e)

    def _slot(self, engine_id: str) -> EngineSlot:
        slot = self._slots.get(engine_id)
        if slot is None:
            raise KeyError(f"no engine {engine_id!r}; engines: {', '.join(self._slots)}")
        return slot

    def _calls_started(self, slot: EngineSlot) -> None:
        slot.calls += 1
        self._inflight += 1
        self._idle.clear()

    def _calls_ended(self, slot: EngineSlot) -> None:
        slot.calls -= 1
        self._inflight -= 1
        if not self._inflight:
            self._idle.set()
        if slot.draining:
            self._remove_if_idle(slot)

    def _remove_if_idle(self, slot: EngineSlot) -> None:
        if slot.calls or slot.failed or slot.engine_id not in self._slots:
            return
        if any(r._admission is not None and r._admission[0] == slot.engine_id
               for r in self._runners.values()):
            return  # admitted before the drain; it runs there first
        del self._slots[slot.engine_id]
        self._gpus_used -= slot.tp if slot.launched is not None else 0
        self._emit(EngineRemoved(slot.engine_id))
        self._spawn(self._stop(slot))

    async def _engine_trouble(self, slot: EngineSlot, error: EngineError) -> str:
        """After a failed call: "failed" if the engine is dead (now failed), else "retry"."""
        if slot.failed:
            return "failed"
        if not await slot.engine.health():
            self._fail_engine(slot, f"{type(error).__name__}: {error}")
            return "failed"
        log.warning("engine %s: a call failed but the engine is healthy: %s", slot.label, error)
        return "retry"

    def _fail_engine(self, slot: EngineSlot, reason: str) -> None:
        if slot.failed or slot.engine_id not in self._slots:
            return
        slot.failed = True
        self.failures.append((slot.label, reason))
        log.warning("engine %s failed: %s", slot.label, reason)
        self._emit(EngineFailed(slot.engine_id, reason))
        for runner in list(self._runners.values()):
            runner._engine_lost(slot.engine_id)
        del self._slots[slot.engine_id]
        if slot.launched is not None:
            self._gpus_used -= slot.tp
        self._spawn(self._stop(slot))
        if not self.has_engines():
            self._fail_waiters()

    def _fail_waiters(self) -> None:
        error = self.no_engine_error()
        for runner in list(self._runners.values()):
            if runner.waiting:
                runner._fail(error)

    async def _stop(self, slot: EngineSlot) -> None:
        with contextlib.suppress(Exception):
            if slot.launched is not None:
                await slot.launched.stop()
            else:
                await slot.engine.aclose()

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for slot in list(self._slots.values()):
                if slot.calls or slot.failed:
                    continue  # calls in flight report failures themselves
                if await slot.engine.health():
                    slot.health_failures = 0
                else:
                    slot.health_failures += 1
                    if slot.health_failures >= 2:
                        self._fail_engine(slot, "stopped answering its health check")

    def _trajectory_done(self, runner: ScheduledTurns) -> None:
        self._runners.pop(runner.traj_id, None)
        self.scheduler.forget(runner.traj_id)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
