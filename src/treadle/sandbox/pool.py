"""A pool of sandboxes: warm spares, a creation rate limit, a cap on live ones.

    pool = SandboxPool(backend, Limits(memory_mb=512), PoolSettings(warm=4, max_live=64))
    async with pool:
        async with pool.sandbox() as sb:
            result = await sb.exec(["python3", "solve.py"], timeout_s=30)

Contracts:

- At most `max_live` sandboxes exist at once (in use, warm, or being created);
  `sandbox()` waits for a slot. Waiting callers take free slots before the warmer.
- Creations are rate-limited by a token bucket (`create_rate_per_s`, burst
  `create_burst`), so a thousand trajectories starting together do not start a
  thousand sandboxes in the same instant (the "create storm" of remote backends).
- Up to `warm` idle sandboxes are kept ready in the background, within the cap.
- A sandbox is used once: after its `async with` block it is closed, whatever
  happened inside (success, exception, cancellation), and never handed to another
  caller - a used workspace would leak one trajectory's files into the next.
  The close is shielded from cancellation, so it completes even when the task is
  cancelled again meanwhile.
- `close()` stops warming, closes the idle sandboxes, waits up to `grace_s` for
  borrowed ones to come back and then closes them too; later `sandbox()` calls
  raise SandboxClosed.
- A crash of the whole process cannot run Python cleanup; there the backends take
  over: bwrap sandboxes die with their parent, the local reaper gets SIGTERM, and
  the next backend start sweeps the work dirs of dead owners.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType

from treadle.clock import MONOTONIC, Clock
from treadle.errors import SandboxClosed
from treadle.sandbox.base import Limits, Sandbox, SandboxBackend

log = logging.getLogger(__name__)

_WARM_RETRY_S = 1.0  # back-off after a failed warm creation


class TokenBucket:
    """`rate_per_s` tokens a second of `clock`, at most `burst` saved up; waiters queue
    on a lock."""

    def __init__(self, rate_per_s: float, burst: int, clock: Clock = MONOTONIC) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock.now()
        self._lock = asyncio.Lock()  # one waiter sleeps at a time: no thundering herd

    def _refill(self) -> None:
        now = self._clock.now()
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate_per_s)
        self._stamp = now

    async def take(self) -> None:
        """Wait until a token is available and consume it."""
        async with self._lock:
            self._refill()
            while self._tokens < 1.0:
                await self._clock.sleep((1.0 - self._tokens) / self.rate_per_s)
                self._refill()
            self._tokens -= 1.0


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of the pool."""

    live: int  # sandboxes that exist or are being created (<= max_live)
    idle: int  # warm and unused
    in_use: int  # handed out and not yet returned
    created: int  # total ever created
    waiting: int  # callers waiting for a slot


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """How a pool keeps its sandboxes (the module docstring's contracts)."""

    warm: int = 0  # idle sandboxes kept ready (within max_live)
    max_live: int = 16  # sandboxes at once: in use, warm, or being created
    create_rate_per_s: float = 8.0  # sandbox starts a second (token bucket)
    create_burst: int = 4  # starts saved up at most
    grace_s: float = 10.0  # seconds close() waits for borrowed sandboxes

    def __post_init__(self) -> None:
        if self.max_live < 1 or self.warm < 0:
            raise ValueError("max_live must be >= 1 and warm >= 0")
        if self.create_rate_per_s <= 0 or self.create_burst < 1:
            raise ValueError("create_rate_per_s must be > 0 and create_burst >= 1")

    def shared(self, n: int) -> PoolSettings:
        """The settings of one of `n` pools that together keep to these (the copies of
        a service's pools in its `n` runner actors): each count and the rate a 1/n
        share, counts rounded up, so the whole may exceed a count by at most n - 1."""
        if n < 1:
            raise ValueError("n must be >= 1")
        return dataclasses.replace(
            self, warm=math.ceil(self.warm / n), max_live=math.ceil(self.max_live / n),
            create_rate_per_s=self.create_rate_per_s / n,
            create_burst=math.ceil(self.create_burst / n))


class SandboxPool:
    """See the module docstring."""

    def __init__(self, backend: SandboxBackend, limits: Limits,
                 settings: PoolSettings = PoolSettings(), *, clock: Clock = MONOTONIC) -> None:
        self.backend = backend
        self.limits = limits
        self.warm = min(settings.warm, settings.max_live)
        self.max_live = settings.max_live
        self.grace_s = settings.grace_s  # seconds of `clock` close() waits for borrowed ones
        self.clock = clock  # the rate limit's, the close grace's and the warm retry's
        self._bucket = TokenBucket(settings.create_rate_per_s, settings.create_burst, clock)
        self._cond = asyncio.Condition()
        self._idle: collections.deque[Sandbox] = collections.deque()
        self._in_use: set[Sandbox] = set()
        self._live = 0  # idle + in use + being created
        self._creating_warm = 0
        self._created = 0
        self._waiting = 0
        self._closed = False
        self._warmer: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # shielded releases

    # -- public ---------------------------------------------------------------

    def stats(self) -> PoolStats:
        return PoolStats(live=self._live, idle=len(self._idle), in_use=len(self._in_use),
                         created=self._created, waiting=self._waiting)

    async def start(self) -> None:
        """Begin warming (also done lazily by the first `sandbox()`)."""
        if self._closed:
            raise SandboxClosed("pool is closed")
        self._kick_warmer()

    @contextlib.asynccontextmanager
    async def sandbox(self) -> AsyncIterator[Sandbox]:
        """Borrow a fresh sandbox for the block; it is closed afterwards, always."""
        sb = await self.acquire()
        try:
            yield sb
        finally:
            await self._release_shielded(sb)

    async def acquire(self) -> Sandbox:
        """A fresh sandbox, waiting for a slot. Pair with `release` (or use `sandbox()`)."""
        async with self._cond:
            self._waiting += 1
            try:
                while True:
                    if self._closed:
                        raise SandboxClosed("pool is closed")
                    if self._idle:
                        sb = self._idle.popleft()
                        self._in_use.add(sb)
                        self._kick_warmer()
                        return sb
                    if self._live < self.max_live:
                        self._live += 1  # reserve the slot, then create outside the lock
                        break
                    await self._cond.wait()
            finally:
                self._waiting -= 1
        try:
            sb = await self._create()
        except BaseException:
            await self._unreserve()
            raise
        async with self._cond:
            if self._closed:  # closed while we were creating: do not hand it out
                self._live -= 1
                self._cond.notify_all()
                await asyncio.shield(sb.close())
                raise SandboxClosed("pool is closed")
            self._in_use.add(sb)
        self._kick_warmer()
        return sb

    async def release(self, sb: Sandbox) -> None:
        """Close a borrowed sandbox and free its slot. Idempotent."""
        await self._release_shielded(sb)

    async def close(self) -> None:
        """Close the pool; see the module docstring. Idempotent."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._warmer is not None:
            self._warmer.cancel()
            await asyncio.gather(self._warmer, return_exceptions=True)
        async with self._cond:
            idle = list(self._idle)
            self._idle.clear()
            self._live -= len(idle)
            self._cond.notify_all()
        await asyncio.gather(*(asyncio.shield(sb.close()) for sb in idle), return_exceptions=True)
        try:
            async with self.clock.timeout(self.grace_s), self._cond:
                await self._cond.wait_for(lambda: not self._in_use)
        except TimeoutError:
            log.warning("closing %d sandbox(es) still borrowed after %.0fs", len(self._in_use),
                        self.grace_s)
            for sb in list(self._in_use):
                await self._release_shielded(sb)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- internals --------------------------------------------------------------

    async def _create(self) -> Sandbox:
        await self._bucket.take()
        sb = await self.backend.start(self.limits)
        self._created += 1
        return sb

    async def _unreserve(self) -> None:
        async with self._cond:
            self._live -= 1
            self._cond.notify_all()

    async def _release_shielded(self, sb: Sandbox) -> None:
        # A task of its own, referenced until done: a cancelled caller cannot stop
        # the close halfway, and the task cannot be garbage-collected meanwhile.
        task = asyncio.ensure_future(self._release(sb))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        await asyncio.shield(task)

    async def _release(self, sb: Sandbox) -> None:
        async with self._cond:
            if sb not in self._in_use:
                return  # already released
            self._in_use.discard(sb)
        try:
            await sb.close()
        finally:
            async with self._cond:
                self._live -= 1
                self._cond.notify_all()
            self._kick_warmer()

    def _kick_warmer(self) -> None:
        if self._closed or self.warm == 0:
            return
        if self._warmer is None or self._warmer.done():
            self._warmer = asyncio.ensure_future(self._keep_warm())

    async def _keep_warm(self) -> None:
        """Create idle sandboxes until `warm` are idle or the cap is reached."""
        while not self._closed:
            async with self._cond:
                # Waiters come first: they get the free slots, the warmer only the rest.
                if (len(self._idle) + self._creating_warm >= self.warm
                        or self._live + self._waiting >= self.max_live):
                    return
                self._live += 1
                self._creating_warm += 1
            try:
                sb = await self._create()
            except asyncio.CancelledError:
                await self._unreserve()
                raise
            except Exception as e:
                log.warning("warm sandbox creation failed (retrying in %.0fs): %s",
                            _WARM_RETRY_S, e)
                await self._unreserve()
                await self.clock.sleep(_WARM_RETRY_S)
                continue
            finally:
                self._creating_warm -= 1
            async with self._cond:
                if self._closed:
                    self._live -= 1
                    await asyncio.shield(sb.close())
                    return
                self._idle.append(sb)
                self._cond.notify_all()
