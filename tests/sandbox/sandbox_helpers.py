"""Helpers for the sandbox tests: running coroutines, watching host processes and dirs."""

from __future__ import annotations

import asyncio
import os
import secrets
import select
import shutil
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

from treadle.sandbox import Limits

T = TypeVar("T")

# Small limits keep the battery fast on two cores.
SMALL = Limits(cpu_s=1, memory_mb=256, max_processes=64, max_file_mb=16, max_open_files=64,
               max_output_bytes=64 * 1024, wall_timeout_s=10)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run. No ceiling of its own: a hang is pytest-timeout's, and a test on a
    loaded machine is never failed for being slow."""
    return asyncio.run(coro)


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


def ended(pids: Callable[[], list[int]]) -> None:
    """Until `pids()` (host processes found by their command lines) is empty: each one's
    end is awaited as its pidfd becoming readable, an event, and the list read again
    after (a process may have started one more). A process that never ends is a hang,
    pytest-timeout's."""
    while found := pids():
        for pid in found:
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:  # ended since it was listed
                continue
            try:
                select.select([pidfd], [], [])
            finally:
                os.close(pidfd)


def wait_until(predicate: Callable[[], object]) -> None:
    """Until `predicate` holds: a state that pushes no event this test can wait on (a
    process appearing in /proc, another thread's counter), so it is looked at again
    after a short pause. No deadline decides: a hang is pytest-timeout's."""
    while not predicate():
        time.sleep(0.02)  # between two looks, not a wait for the state


async def eventually(predicate: Callable[[], object]) -> None:
    """`wait_until` from a coroutine: the loop keeps running the sandbox's own I/O
    between two looks."""
    while not predicate():
        await asyncio.sleep(0.02)


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
