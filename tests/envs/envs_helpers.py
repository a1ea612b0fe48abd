"""Helpers for the envs tests: a bounded asyncio.run and the sandbox backend (bwrap)."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from treadle.envs import RewardResult, Suite, ToolResult, open_episode
from treadle.errors import SandboxUnavailable
from treadle.sandbox import BwrapBackend, Limits, SandboxBackend
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
    """The backend the integration tests run on, named for assertion messages."""

    backend: SandboxBackend
    name: str  # "bwrap"

    def label(self) -> str:
        return self.name


def pick_backend(work_root: str) -> Backend:
    """bwrap, probed with a python3 run: the tests named for a sandbox must run in one.
    Fails (never falls back to the local backend) when bwrap is missing or cannot run
    here; skips only where TREADLE_ALLOW_NO_BWRAP=1, as tests/sandbox does."""
    allowed = os.environ.get("TREADLE_ALLOW_NO_BWRAP") == "1"
    if shutil.which("bwrap") is None:
        if allowed:
            pytest.skip("bwrap is not installed and TREADLE_ALLOW_NO_BWRAP=1")
        pytest.fail("bubblewrap (bwrap) is not installed: run `bash scripts/system-deps.sh "
                    "bubblewrap` (or set TREADLE_ALLOW_NO_BWRAP=1 to skip these tests)",
                    pytrace=False)
    backend = BwrapBackend(work_root=work_root)

    async def probe() -> None:
        async with await backend.start(TEST_LIMITS) as sb:
            result = await sb.exec(["python3", "-c", "print(1)"], timeout_s=20)
            if not result.ok:
                raise SandboxUnavailable(f"python3 does not run in bwrap: {result}")

    try:
        run(probe())
    except SandboxUnavailable as e:
        if allowed:
            pytest.skip(f"bwrap cannot run sandboxes here ({e}) and TREADLE_ALLOW_NO_BWRAP=1")
        pytest.fail(f"bwrap is installed but cannot run sandboxes here: {e}", pytrace=False)
    return Backend(backend, "bwrap")


async def play(suite: Suite, task: Task, backend: SandboxBackend | None,
               calls: Sequence[tuple[str, Mapping[str, Any] | str]],
               final_message: str | None = None) -> tuple[RewardResult, list[ToolResult]]:
    """Run `calls` as one episode of `task` (a fresh sandbox) and score it."""
    async with open_episode(suite, task, backend, limits=TEST_LIMITS) as episode:
        results = [await episode.call(name, args) for name, args in calls]
        return await episode.score(final_message), results
