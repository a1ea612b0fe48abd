"""The service's sandbox pools: one per suite (and per image), all with the same settings.

A suite's trajectories share a pool (`sandbox.pool.SandboxPool`) made on first use
with the suite's limits and the service's `PoolSettings`; a suite whose tasks run
on their own images (`Suite.sandbox_backend`, e.g. swe-images) gets one per image,
without warm spares.
The job runner and the gateway (a harness run's verifier) are given the same
`SuitePools`. `close` closes them all.
"""

from __future__ import annotations

import asyncio
import dataclasses

from treadle.envs.base import Suite
from treadle.envs.errors import EnvConfigError
from treadle.sandbox.base import SandboxBackend
from treadle.sandbox.pool import PoolSettings, PoolStats, SandboxPool
from treadle.types import Task


class SuitePools:
    """A sandbox pool per suite over one backend (module docstring); no pools
    without a backend."""

    def __init__(self, backend: SandboxBackend | None, settings: PoolSettings) -> None:
        self.backend = backend  # None: the service runs no sandbox
        self.settings = settings
        self._pools: dict[str, SandboxPool] = {}

    def pool(self, suite: Suite, task: Task | None = None) -> SandboxPool | None:
        """The pool of a suite's trajectories (of `task`'s, when the suite runs it on a
        backend of its own); None: the service has no sandbox. A backend the suite
        refuses for the task gets the suite's plain pool: `open_episode` then fails the
        trajectory's init with the suite's reason."""
        if self.backend is None:
            return None
        backend, key = self.backend, suite.name
        if task is not None:
            try:
                backend = suite.sandbox_backend(task, self.backend)
            except EnvConfigError:
                backend = self.backend
            if backend is not self.backend:
                key = f"{suite.name} {backend.image or id(backend)}"
        pool = self._pools.get(key)
        if pool is None:
            # No warm spares on a task's own image: with one image per task they would
            # pile up idle, `warm` per image.
            settings = self.settings if backend is self.backend \
                else dataclasses.replace(self.settings, warm=0)
            pool = SandboxPool(backend, suite.limits, settings)
            self._pools[key] = pool
        return pool

    def stats(self) -> list[tuple[str, PoolStats]]:
        """Each suite's pool now, by suite name."""
        return [(name, pool.stats()) for name, pool in sorted(self._pools.items())]

    def waiting(self) -> int:
        """Callers waiting for a sandbox in every pool (the demand a fleet follows)."""
        return sum(pool.stats().waiting for pool in self._pools.values())

    async def close(self) -> None:
        await asyncio.gather(*(p.close() for p in self._pools.values()), return_exceptions=True)


__all__ = ["SuitePools"]
