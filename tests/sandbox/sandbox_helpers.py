"""Helpers for the sandbox tests: running coroutines, watching host processes and dirs."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from treadle.sandbox import Limits

T = TypeVar("T")

# Small limits keep the battery fast on two cores.
SMALL = Limits(cpu_s=1, memory_mb=256, max_processes=64, max_file_mb=16, max_open_files=64,
               max_output_bytes=64 * 1024, wall_timeout_s=10)


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    """asyncio.run with a hard ceiling, so that a hang fails the test instead of CI."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


def marker() -> str:
    """A unique sleep duration: `sleep <marker>` is findable in /proc afterwards."""
    return f"{4000 + secrets.randbelow(10**6) / 1000:.3f}"


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stat_fields(pid: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].decode().split()
    except OSError:
        return []


def processes_with(text: str) -> list[int]:
    """Live host processes whose command line contains `text` (zombies excluded)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid() and text in _cmdline(pid):
            fields = _stat_fields(pid)
            if fields and fields[0] != "Z":
                found.append(int(pid))
    return found


def sleepers(tag: str) -> list[int]:
    """Live `sleep <tag>` processes on the host (see `marker`)."""
    found = []
    for pid in processes_with(tag):
        argv = _cmdline(str(pid)).split()
        if len(argv) == 2 and os.path.basename(argv[0]) == "sleep" and argv[1] == tag:
            found.append(pid)
    return found


def descendants(root: int | None = None) -> list[int]:
    """Live descendants of `root` (default: this test process)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        fields = _stat_fields(pid) if pid.isdigit() else []
        if fields and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(pid))
    out: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def wait_until(predicate: Any, timeout_s: float = 5.0) -> bool:
    """Poll `predicate` until true or timeout; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return bool(value)
        time.sleep(0.02)


async def eventually(predicate: Any, timeout_s: float = 60.0) -> bool:
    """Poll `predicate` from a coroutine (the loop keeps running the sandbox's own
    I/O) until it is true; False if `timeout_s` passes first, a bound for a hang."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def workdirs(root: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(root) if n.startswith("treadle-sb-"))
    except FileNotFoundError:
        return []


def require_bwrap() -> None:
    """Fail with instructions when bwrap is missing (skip only if TREADLE_ALLOW_NO_BWRAP=1)."""
    if shutil.which("bwrap") is None:
        if os.environ.get("TREADLE_ALLOW_NO_BWRAP") == "1":
            pytest.skip("bwrap is not installed and TREADLE_ALLOW_NO_BWRAP=1")
        pytest.fail("bubblewrap (bwrap) is not installed: run `bash scripts/system-deps.sh "
                    "bubblewrap` (or set TREADLE_ALLOW_NO_BWRAP=1 to skip these tests)",
                    pytrace=False)
