"""The service's sandbox pools: one per suite, all with the same settings.

A suite's trajectories share a pool (`sandbox.pool.SandboxPool`) made on first use
with the suite's limits and the service's `PoolSettings`; the job runner and the
gateway (a harness run's verifier) are given the same `SuitePools`. `close` closes
them all.
"""

from __future__ import annotations

import asyncio

from treadle.envs.base import Suite
from treadle.sandbox.base import SandboxBackend
from treadle.sandbox.pool import PoolSettings, PoolStats, SandboxPool


class SuitePools:
    """A sandbox pool per suite over one backend (module docstring); no pools
    without a backend."""

    def __init__(self, backend: SandboxBackend | None, settings: PoolSettings) -> None:
        self.backend = backend  # None: the service runs no sandbox
        self.settings = settings
        self._pools: dict[str, SandboxPool] = {}

    def pool(self, suite: Suite) -> SandboxPool | None:
        """The pool of a suite's trajectories (None: the service has no sandbox)."""
        if self.backend is None:
            return None
        pool = self._pools.get(suite.name)
        if pool is None:
            pool = SandboxPool(self.backend, suite.limits, self.settings)
            self._pools[suite.name] = pool
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
