"""Helpers for the envs tests: a bounded asyncio.run and the sandbox backend in use."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from treadle.envs import RewardResult, Suite, ToolResult, open_episode
from treadle.errors import SandboxUnavailable
from treadle.sandbox import BwrapBackend, Limits, LocalBackend, SandboxBackend
from treadle.types import Task

T = TypeVar("T")
# Small enough to keep the suite fast on two cores, large enough for python3 and unittest.
TEST_LIMITS = Limits(cpu_s=10, memory_mb=512, max_processes=64, wall_timeout_s=30)


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    """asyncio.run with a hard ceiling, so that a hang fails the test instead of CI."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


@dataclass
class Backend:
    """The backend the integration tests run on, and why, for assertion messages."""

    backend: SandboxBackend
    name: str  # "bwrap" or "local"
    why: str  # "" for bwrap; the reason bwrap could not be used otherwise

    def label(self) -> str:
        return self.name if not self.why else f"{self.name} (bwrap unavailable: {self.why})"


def pick_backend(work_root: str) -> Backend:
    """bwrap when it runs here; else the local backend, saying why (CI installs bwrap)."""
    if shutil.which("bwrap") is None:
        return Backend(LocalBackend(work_root=work_root), "local", "bwrap is not installed")
    backend = BwrapBackend(work_root=work_root)

    async def probe() -> None:
        async with await backend.start(TEST_LIMITS) as sb:
            result = await sb.exec(["python3", "-c", "print(1)"], timeout_s=20)
            if not result.ok:
                raise SandboxUnavailable(f"python3 does not run in bwrap: {result}")

    try:
        run(probe())
    except SandboxUnavailable as e:
        return Backend(LocalBackend(work_root=work_root), "local", str(e))
    return Backend(backend, "bwrap", "")


async def play(suite: Suite, task: Task, backend: SandboxBackend | None,
               calls: Sequence[tuple[str, Mapping[str, Any] | str]],
               final_message: str | None = None) -> tuple[RewardResult, list[ToolResult]]:
    """Run `calls` as one episode of `task` (a fresh sandbox) and score it."""
    async with open_episode(suite, task, backend, limits=TEST_LIMITS) as episode:
        results = [await episode.call(name, args) for name, args in calls]
        return await episode.score(final_message), results
