"""The runtime's engines: how they join, carry calls, fail, leave and are replaced.

`EnginePool` holds every engine of a `Runtime` (`EngineSlot`), the GPUs they take and
the calls in flight on them, and tells its owner (`PoolOwner`, the runtime) what
happens to them as scheduler events (`EngineAdded`, `EngineDraining`, `EngineFailed`,
`EngineRemoved`) and as capacity changes:

- engines join by `register` (started elsewhere) or `launch` (the launcher starts
  one on GPUs of the pool's budget; the owner may prepare it — load the current
  weights — before it joins);
- after a failed call, `call_failed` checks the engine's health: a dead one is
  failed, a live one is retried by its runner, and one that says it does not serve
  the model (`EngineModelMissing`) is failed without a check, since no turn can run
  there; an engine that misses two health checks in a row (one every
  `health_interval_s`, busy engines too: a stopped process holds its calls until
  their timeout, which may be minutes) is failed too;
- a failed engine is stopped and its GPUs freed. If the pool launched it and has a
  `RelaunchPolicy`, a replacement of the same TP degree is launched on those GPUs
  once the old process is gone, after a back-off on the clock that doubles with each
  failure in a row of that line of engines (failed starts and replacements that die
  within `reset_after_s` both count), at most `attempts` times; each is logged. An
  engine removed (`fail(..., replace=False)`) or drained is not replaced;
- a draining engine admits nothing and is removed once no call is in flight on it
  and no turn admitted to it is still to be sent.

Every duration here is on the pool's clock. Everything runs on the owner's event
loop; `close` cancels the pool's background work and stops what it launched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from treadle.clock import Clock
from treadle.core.events import EngineAdded, EngineDraining, EngineFailed, EngineRemoved, Event
from treadle.engines.base import Engine
from treadle.engines.errors import (
    EngineError,
    EngineModelMissing,
    EngineStartError,
    NoEngineAvailable,
)
from treadle.runtime.launcher import EngineLauncher, LaunchedEngine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineSlot:
    """One engine as the runtime holds it."""

    engine_id: str  # the scheduler's name for it
    engine: Engine  # its client
    tp: int  # GPUs it takes
    max_batch: int  # sequences it runs at once
    kv_capacity_tokens: int  # its KV cache
    label: str  # for logs and status
    launched: LaunchedEngine | None = None  # set when this runtime started it
    calls: int = 0  # calls in flight
    draining: bool = False  # admits nothing more; removed once idle
    failed: bool = False  # failed or removed; gone from the pool
    health_failures: int = 0  # consecutive failed background checks
    joined_at: float = 0.0  # clock time it joined the pool
    relaunches: int = 0  # failures in a row of its line before it (0: not a replacement)


@dataclass(frozen=True, slots=True)
class RelaunchPolicy:
    """When a launched engine that failed is replaced (clock seconds)."""

    attempts: int = 3  # replacements in a row of one line before giving up on it
    backoff_s: float = 1.0  # wait before the first replacement; doubles for each next
    reset_after_s: float = 600.0  # a replacement up this long ends its line's run

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.reset_after_s < 0:
            raise ValueError("attempts must be >= 1, backoff_s and reset_after_s >= 0")


DEFAULT_RELAUNCH = RelaunchPolicy()


class PoolOwner(Protocol):
    """What an `EnginePool` tells the runtime that holds it."""

    def engine_event(self, event: Event) -> None:
        """An engine joined, began draining, failed or left (the scheduler's event)."""
        ...

    def capacity_changed(self) -> None:
        """The number of live engines, or of engines starting, may have changed."""
        ...

    def holds_admission(self, engine_id: str) -> bool:
        """Whether a turn admitted to the engine has yet to be sent there."""
        ...

    async def prepare(self, launched: LaunchedEngine) -> None:
        """Make a launched engine fit to join (e.g. load the current weights); raises
        `EngineStartError` if it cannot be."""
        ...


class EnginePool:
    """The engines of one runtime. See the module docstring."""

    def __init__(self, owner: PoolOwner, clock: Clock, *, launcher: EngineLauncher | None,
                 gpus: int, health_interval_s: float,
                 relaunch: RelaunchPolicy | None, id_prefix: str = "e") -> None:
        self.launcher = launcher
        self.id_prefix = id_prefix  # engine ids are this and a number (unique per service)
        self.gpus = gpus  # GPUs the launcher may use (0: no budget is kept)
        self.health_interval_s = health_interval_s  # clock seconds between idle checks
        self.relaunch = relaunch  # None: failed engines are not replaced
        self.failures: deque[tuple[str, str]] = deque(maxlen=8)  # (engine, why), latest
        self.relaunched = 0  # replacements launched so far
        self.idle = asyncio.Event()  # no call in flight on any engine
        self.idle.set()
        self._call_ended = asyncio.Event()  # a call ended (`quiet` looks again)
        self._owner = owner
        self._clock = clock
        self._slots: dict[str, EngineSlot] = {}
        self._next_id = 0
        self._gpus_used = 0
        self._starting = 0  # launches in flight plus replacements waiting to launch
        self._inflight = 0
        self._tasks: set[asyncio.Task[Any]] = set()  # replacements; cancelled on close
        self._stopping: set[asyncio.Task[None]] = set()  # engines being stopped; awaited
        self._watch: asyncio.Task[None] | None = None
        self._closed = False

    # -- reading ---------------------------------------------------------------------

    def get(self, engine_id: str) -> EngineSlot | None:
        return self._slots.get(engine_id)

    def slot(self, engine_id: str) -> EngineSlot:
        """The engine's slot; KeyError naming the engines there are."""
        slot = self._slots.get(engine_id)
        if slot is None:
            raise KeyError(f"no engine {engine_id!r}; engines: {', '.join(self._slots)}")
        return slot

    def slots(self) -> list[EngineSlot]:
        return list(self._slots.values())

    def live(self) -> int:
        """Engines that take work (neither failed nor draining)."""
        return sum(not s.failed and not s.draining for s in self._slots.values())

    @property
    def starting(self) -> int:
        """Engines being launched, or waiting out a back-off to be."""
        return self._starting

    def no_engine_error(self) -> NoEngineAvailable:
        failed = "; ".join(f"{label}: {why}" for label, why in self.failures)
        return NoEngineAvailable("no engine left to run the turn" +
                                 (f" (failed: {failed})" if failed else ""))

    # -- joining -------------------------------------------------------------------

    def register(self, engine: Engine, *, tp: int, max_batch: int, kv_capacity_tokens: int,
                 label: str, launched: LaunchedEngine | None = None,
                 relaunches: int = 0) -> str:
        """Add a healthy engine; its id. Its client is closed on removal (and the
        engine stopped, if `launched`)."""
        eid = f"{self.id_prefix}{self._next_id:03d}"
        self._next_id += 1
        self._slots[eid] = EngineSlot(eid, engine, tp, max_batch, kv_capacity_tokens,
                                      label or eid, launched, joined_at=self._clock.now(),
                                      relaunches=relaunches)
        self._owner.engine_event(EngineAdded(eid, tp, max_batch, kv_capacity_tokens))
        self._owner.capacity_changed()
        return eid

    async def launch(self, tp: int, *, relaunches: int = 0) -> str:
        """Start a TP-`tp` engine with the launcher and register it; its id.
        EngineStartError when there is no room for it or it did not come up."""
        if self.launcher is None:
            raise EngineStartError("the runtime has no launcher")
        if self.gpus and self._gpus_used + tp > self.gpus:
            raise EngineStartError(f"no room for a TP-{tp} engine: {self._gpus_used}/"
                                   f"{self.gpus} GPUs in use")
        self._gpus_used += tp
        self._starting += 1
        try:
            launched = await self.launcher.start(tp)
            try:
                await self._owner.prepare(launched)
            except BaseException:
                await launched.stop()
                raise
        except BaseException:
            self._gpus_used -= tp
            self._starting -= 1
            self._owner.capacity_changed()
            raise
        self._starting -= 1
        return self.register(launched.engine, tp=tp, max_batch=launched.max_batch,
                             kv_capacity_tokens=launched.kv_capacity_tokens,
                             label=launched.label, launched=launched, relaunches=relaunches)

    async def launch_or_log(self, tp: int) -> None:
        """The scheduler's `AddEngine`: launched once the engines being stopped have
        stopped (a merge's new engine takes the GPUs of the ones it drained, which a
        local process holds until it exits); a failure is logged."""
        if self._stopping:
            # `wait`, not `gather`: cancelling this launch (the runtime's close) must not
            # cancel the stops, which would leave their processes and GPUs held.
            await asyncio.wait(set(self._stopping))
        try:
            await self.launch(tp)
        except EngineError as e:
            log.error("could not add a TP-%d engine: %s", tp, e)

    # -- calls ----------------------------------------------------------------------

    def call_started(self, slot: EngineSlot) -> None:
        slot.calls += 1
        self._inflight += 1
        self.idle.clear()

    def call_ended(self, slot: EngineSlot) -> None:
        slot.calls -= 1
        self._inflight -= 1
        self._call_ended.set()
        if not self._inflight:
            self.idle.set()
        if slot.draining:
            self.remove_if_idle(slot)

    async def quiet(self, except_on: set[str]) -> None:
        """Return once no call is in flight on any engine but those of `except_on`."""
        while any(s.calls for s in self._slots.values() if s.engine_id not in except_on):
            self._call_ended.clear()
            await self._call_ended.wait()

    async def call_failed(self, slot: EngineSlot, error: EngineError) -> Literal["failed", "retry"]:
        """After a failed call: "failed" if the engine is dead (now failed), else "retry"."""
        if slot.failed:
            return "failed"
        if isinstance(error, EngineModelMissing):
            self.fail(slot, str(error))
            return "failed"
        if not await slot.engine.health():
            self.fail(slot, f"{type(error).__name__}: {error}")
            return "failed"
        log.warning("engine %s: a call failed but the engine is healthy: %s", slot.label, error)
        return "retry"

    # -- leaving ----------------------------------------------------------------------

    def drain(self, engine_id: str) -> None:
        """Send nothing more to the engine (tells the scheduler); removed once idle."""
        slot = self.slot(engine_id)
        if not slot.draining:
            self._owner.engine_event(EngineDraining(engine_id))
            slot.draining = True  # at once: the scheduler's DrainEngine comes at its next decide
            self._owner.capacity_changed()

    def drain_decided(self, engine_id: str) -> None:
        """The scheduler's `DrainEngine`: admit nothing more there; remove it once idle."""
        slot = self._slots.get(engine_id)
        if slot is not None:
            slot.draining = True
            self.remove_if_idle(slot)
            self._owner.capacity_changed()

    def remove_if_idle(self, slot: EngineSlot) -> None:
        if slot.calls or slot.failed or slot.engine_id not in self._slots:
            return
        if self._owner.holds_admission(slot.engine_id):
            return  # admitted before the drain; it runs there first
        del self._slots[slot.engine_id]
        self._gpus_used -= slot.tp if slot.launched is not None else 0
        self._owner.engine_event(EngineRemoved(slot.engine_id))
        self._stop_later(slot)

    def fail(self, slot: EngineSlot, reason: str, *, replace: bool = True) -> None:
        """Take the engine away now (its turns go elsewhere) and stop it; `replace`:
        relaunch it under the `RelaunchPolicy` if the pool launched it."""
        if slot.failed or slot.engine_id not in self._slots:
            return
        slot.failed = True
        self.failures.append((slot.label, reason))
        log.warning("engine %s failed: %s", slot.label, reason)
        self._owner.engine_event(EngineFailed(slot.engine_id, reason))
        del self._slots[slot.engine_id]
        if slot.launched is not None:
            self._gpus_used -= slot.tp
        stopped = self._stop_later(slot)
        if replace and slot.launched is not None:
            self._replace(slot, stopped)
        self._owner.capacity_changed()

    # -- replacing ------------------------------------------------------------------------

    def _replace(self, slot: EngineSlot, stopped: asyncio.Task[None]) -> None:
        policy = self.relaunch
        if policy is None or self.launcher is None or self._closed:
            return
        young = self._clock.now() - slot.joined_at < policy.reset_after_s
        attempt = slot.relaunches + 1 if young else 1
        if attempt > policy.attempts:
            log.error("engine %s failed again after %d replacements in a row; not relaunching "
                      "its TP-%d engine", slot.label, slot.relaunches, slot.tp)
            return
        self._starting += 1
        self._spawn(self._relaunch(slot.tp, attempt, stopped))

    async def _relaunch(self, tp: int, attempt: int, stopped: asyncio.Task[None]) -> None:
        """Replace a failed TP-`tp` engine: attempt `attempt`, `attempt + 1`, ... of its
        line, each after its back-off, until one comes up or the attempts run out."""
        policy = self.relaunch
        assert policy is not None
        try:
            await asyncio.wait({stopped})  # its GPUs are free (and a cancel leaves the stop be)
            while attempt <= policy.attempts:
                delay = policy.backoff_s * 2 ** (attempt - 1)
                log.warning("relaunching a TP-%d engine in %.1fs (attempt %d of %d)", tp, delay,
                            attempt, policy.attempts)
                await self._clock.sleep(delay)
                if self.gpus and self._gpus_used + tp > self.gpus:
                    log.warning("not relaunching the TP-%d engine: its GPUs were taken", tp)
                    return
                try:
                    eid = await self.launch(tp, relaunches=attempt)
                except Exception as e:  # a launcher off its contract must not end the line
                    log.warning("relaunch %d of %d of a TP-%d engine failed: %s: %s", attempt,
                                policy.attempts, tp, type(e).__name__, e)
                    attempt += 1
                    continue
                self.relaunched += 1
                log.warning("relaunched a TP-%d engine as %s", tp, eid)
                return
            log.error("gave up relaunching a TP-%d engine after %d attempts", tp,
                      policy.attempts)
        finally:
            self._starting -= 1
            self._owner.capacity_changed()

    # -- background --------------------------------------------------------------------

    def watch_health(self) -> None:
        """Start the background health checks (once)."""
        if self._watch is None and not self._closed:
            self._watch = asyncio.get_running_loop().create_task(self._check_engines())

    async def _check_engines(self) -> None:
        while True:
            await self._clock.sleep(self.health_interval_s)
            slots = [s for s in self._slots.values() if not s.failed]
            # At once: a stopped engine's check takes its whole timeout. A check that
            # raises (an engine client breaking its "never raises") counts as failed:
            # it must not end the checks of every engine.
            answers = await asyncio.gather(*(s.engine.health() for s in slots),
                                           return_exceptions=True)
            for slot, healthy in zip(slots, answers, strict=True):
                if healthy is True:
                    slot.health_failures = 0
                    continue
                slot.health_failures += 1
                if slot.health_failures >= 2:
                    self.fail(slot, "stopped answering its health check")

    async def close(self) -> None:
        """Cancel the background work, stop what was launched, close every client.
        Stops already under way are finished, not cancelled: a process half-stopped
        would outlive the runtime."""
        self._closed = True
        tasks = [t for t in (self._watch, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._stopping, *(self._stop(s) for s in self._slots.values()),
                             return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _stop_later(self, slot: EngineSlot) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._stop(slot))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        return task

    @staticmethod
    async def _stop(slot: EngineSlot) -> None:
        with contextlib.suppress(Exception):
            if slot.launched is not None:
                await slot.launched.stop()
            else:
                await slot.engine.aclose()
