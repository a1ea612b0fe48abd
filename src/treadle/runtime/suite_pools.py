"""Sandbox pools per suite (and per image), all with the same settings.

A suite's trajectories share a pool (`sandbox.pool.SandboxPool`) made on first use
with the suite's limits and the service's `PoolSettings`; a suite whose tasks run
on their own images (`Suite.sandbox_backend`, e.g. swe-images) gets one per image,
without warm spares.
In a service, the job runner and the gateway (a harness run's verifier) are given
the same `SuitePools`; each runner actor has its own (`runtime.runner_actor`), over
the service's backend. `close` closes them all.

Pre-warming: the job runner calls `prepare` for the trajectories that start next
(`jobs.PREWARM_AHEAD`), so that an image is unpacked while the trajectories before
it run, not when its own sandbox is asked for; each image once. A failure there is
logged and left to the trajectory's own start, which reports it as its init failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from treadle.envs.base import Suite
from treadle.envs.errors import EnvConfigError
from treadle.sandbox.base import SandboxBackend
from treadle.sandbox.pool import PoolSettings, PoolStats, SandboxPool
from treadle.types import Task

log = logging.getLogger(__name__)


class SuitePools:
    """A sandbox pool per suite over one backend (module docstring); no pools
    without a backend."""

    def __init__(self, backend: SandboxBackend | None, settings: PoolSettings) -> None:
        self.backend = backend  # None: the service runs no sandbox
        self.settings = settings
        self._pools: dict[str, SandboxPool] = {}
        self._prepared: set[str] = set()  # pool keys whose backend was prepared
        self._preparing: set[asyncio.Task[None]] = set()

    def pool(self, suite: Suite, task: Task | None = None) -> SandboxPool | None:
        """The pool of a suite's trajectories (of `task`'s, when the suite runs it on a
        backend of its own); None: the service has no sandbox. A backend the suite
        refuses for the task gets the suite's plain pool: `open_episode` then fails the
        trajectory's init with the suite's reason."""
        if self.backend is None:
            return None
        backend = self._backend(suite, task)
        key = self._key(suite, backend)
        pool = self._pools.get(key)
        if pool is None:
            # No warm spares on a task's own image: with one image per task they would
            # pile up idle, `warm` per image.
            settings = self.settings if backend is self.backend \
                else dataclasses.replace(self.settings, warm=0)
            pool = SandboxPool(backend, suite.limits, settings)
            self._pools[key] = pool
        return pool

    def prepare(self, suite: Suite, task: Task) -> None:
        """Open `task`'s image in the background if it runs on one of its own and it was
        not opened yet (module docstring). Needs a running event loop."""
        pool = self.pool(suite, task)
        if pool is None or pool.backend is self.backend:
            return
        key = self._key(suite, pool.backend)
        if key in self._prepared:
            return
        self._prepared.add(key)
        job = asyncio.get_running_loop().create_task(self._prepare(key, pool.backend))
        self._preparing.add(job)
        job.add_done_callback(self._preparing.discard)

    @staticmethod
    async def _prepare(key: str, backend: SandboxBackend) -> None:
        try:
            await backend.prepare()
        except Exception as e:  # the trajectory's own start reports it
            log.info("pre-warming the sandbox of %s failed: %s", key, e)

    def _backend(self, suite: Suite, task: Task | None) -> SandboxBackend:
        """The backend `task`'s sandbox starts from (the service's, unless the suite
        runs the task on one of its own)."""
        assert self.backend is not None
        if task is None:
            return self.backend
        try:
            return suite.sandbox_backend(task, self.backend)
        except EnvConfigError:
            return self.backend

    def _key(self, suite: Suite, backend: SandboxBackend) -> str:
        return suite.name if backend is self.backend \
            else f"{suite.name} {backend.image or id(backend)}"

    def stats(self) -> list[tuple[str, PoolStats]]:
        """Each suite's pool now, by suite name."""
        return [(name, pool.stats()) for name, pool in sorted(self._pools.items())]

    def waiting(self) -> int:
        """Callers waiting for a sandbox in every pool (the demand a fleet follows)."""
        return sum(pool.stats().waiting for pool in self._pools.values())

    async def close(self) -> None:
        for job in self._preparing:
            job.cancel()
        await asyncio.gather(*self._preparing, *(p.close() for p in self._pools.values()),
                             return_exceptions=True)


__all__ = ["SuitePools"]
