"""SandboxPool: the cap on live sandboxes, the creation rate limit, warm spares, and a
cleanup that happens on success, error, cancellation and a crash of the whole process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sandbox_helpers import (
    SMALL,
    descendants,
    ended,
    eventually,
    marker,
    run,
    sleepers,
    wait_until,
    workdirs,
)

from treadle.errors import SandboxClosed, SandboxStartError
from treadle.sandbox import (
    BwrapBackend,
    Limits,
    LocalBackend,
    PoolSettings,
    Sandbox,
    SandboxBackend,
    SandboxPool,
)
from treadle.sandbox._cgroup import GROUP_DIR, detect_cgroups


def test_live_sandboxes_never_exceed_the_cap(local: LocalBackend) -> None:
    async def body() -> tuple[int, int]:
        pool = SandboxPool(local, SMALL, PoolSettings(max_live=2, create_rate_per_s=1000,
                                                         create_burst=10))
        peak = busy = 0

        async def job() -> None:
            nonlocal peak, busy
            async with pool.sandbox() as sb:
                busy += 1
                peak = max(peak, busy, pool.stats().live)
                await sb.exec(["sleep", "0.1"], timeout_s=5)
                busy -= 1

        async with pool:
            await asyncio.gather(*(job() for _ in range(6)))
            created = pool.stats().created
        return peak, created

    peak, created = run(body())
    assert peak == 2 and created == 6


def test_creation_is_rate_limited(local: LocalBackend) -> None:
    async def body() -> float:
        pool = SandboxPool(local, SMALL, PoolSettings(max_live=8, create_rate_per_s=10,
                                                         create_burst=1))
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def job() -> None:
            async with pool.sandbox():
                pass

        async with pool:
            await asyncio.gather(*(job() for _ in range(4)))
        return loop.time() - start

    assert run(body()) >= 0.3 - 0.02  # one at once, then three 100 ms apart


def test_warm_spares_are_kept_and_cleaned_up(local: LocalBackend, work_root: str) -> None:
    async def body() -> None:
        pool = SandboxPool(local, SMALL, PoolSettings(warm=2, max_live=3, create_rate_per_s=1000))
        async with pool:
            await eventually(lambda: pool.stats().idle == 2)
            assert len(workdirs(work_root)) == 2
            async with pool.sandbox() as sb:
                result = await sb.exec(["sh", "-c", "echo used > mark"], timeout_s=5)
                assert result.ok
            await eventually(lambda: pool.stats().idle == 2)
            stats = pool.stats()
            assert stats.idle == 2 and stats.in_use == 0 and stats.live == 2
            # The used sandbox is gone; the spares are fresh.
            async with pool.sandbox() as sb:
                assert not (await sb.exec(["test", "-e", "mark"], timeout_s=5)).ok
        assert workdirs(work_root) == []

    run(body())


def _backend(kind: str, request: pytest.FixtureRequest) -> SandboxBackend:
    backend: SandboxBackend = request.getfixturevalue(kind)
    return backend


@pytest.mark.parametrize("kind", ["local", pytest.param("bwrap", marks=pytest.mark.integration)])
def test_cleanup_on_success_error_and_cancellation(kind: str, request: pytest.FixtureRequest,
                                                   work_root: str) -> None:
    backend = _backend(kind, request)
    tag = marker()
    children_before = set(descendants())

    async def body() -> None:
        pool = SandboxPool(backend, SMALL, PoolSettings(max_live=4))
        async with pool:
            # Success.
            async with pool.sandbox() as sb:
                assert (await sb.exec(["true"], timeout_s=5)).ok
            # An exception inside the block.
            with pytest.raises(RuntimeError, match="tool crashed"):
                async with pool.sandbox() as sb:
                    await sb.exec(["sh", "-c", f"sleep {tag} & echo"], timeout_s=5)
                    raise RuntimeError("tool crashed")
            assert not sleepers(tag) and workdirs(work_root) == []

            # A task cancelled while its command runs.
            async def trajectory() -> None:
                async with pool.sandbox() as sb:
                    await sb.exec(["sleep", tag], timeout_s=30)

            task = asyncio.ensure_future(trajectory())
            await asyncio.to_thread(wait_until, lambda: sleepers(tag))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not sleepers(tag) and workdirs(work_root) == []
            assert pool.stats().live == 0

    run(body())
    assert set(descendants()) - children_before == set()
    assert workdirs(work_root) == []


def test_close_reclaims_borrowed_sandboxes_after_the_grace(local: LocalBackend) -> None:
    tag = marker()

    async def body() -> None:
        pool = SandboxPool(local, SMALL, PoolSettings(grace_s=0.3))
        sb = await pool.acquire()
        running = asyncio.ensure_future(sb.exec(["sleep", tag], timeout_s=30))
        await eventually(lambda: sleepers(tag))
        await pool.close()
        with pytest.raises(SandboxClosed):
            await running
        assert not sleepers(tag)
        with pytest.raises(SandboxClosed):
            await pool.acquire()
        await pool.release(sb)  # late release is harmless

    run(body())


_CRASHING_OWNER = textwrap.dedent("""
    import asyncio, os, sys
    from treadle.sandbox import BwrapBackend, LocalBackend, Limits, SandboxPool

    def running(tag):  # processes that are `sleep TAG`
        found = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found += f.read().split(b"\\0")[:2] == [b"sleep", tag.encode()]
            except OSError:
                pass
        return found

    async def main(kind, root, tag):
        backend = BwrapBackend(work_root=root) if kind == "bwrap" else LocalBackend(work_root=root)
        # Past pytest's timeout: processes that outlive their owner fail the test.
        pool = SandboxPool(backend, Limits(wall_timeout_s=3600))
        async with pool.sandbox() as sb:
            exec_task = asyncio.ensure_future(
                sb.exec(["sh", "-c", f"setsid sleep {tag} & sleep {tag}"], timeout_s=3600))
            while running(tag) < 2:  # both sleeps have started
                await asyncio.sleep(0.02)
            print("ready", flush=True)
            await exec_task

    asyncio.run(main(*sys.argv[1:]))
""")


@pytest.mark.parametrize("kind", ["local", pytest.param("bwrap", marks=pytest.mark.integration)])
def test_a_crashed_owner_leaves_no_process_and_its_dirs_are_swept(
        kind: str, request: pytest.FixtureRequest, work_root: str, tmp_path: Path) -> None:
    _backend(kind, request)  # fails early if bwrap is missing
    tag = marker()
    script = tmp_path / "owner.py"
    script.write_text(_CRASHING_OWNER)
    owner = subprocess.Popen([sys.executable, str(script), kind, work_root, tag],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "ready"
        assert len(sleepers(tag)) == 2
        os.kill(owner.pid, signal.SIGKILL)  # no Python cleanup runs
        owner.wait()
        ended(lambda: sleepers(tag))
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert len(workdirs(work_root)) == 1  # only a later start can remove it

    async def restart() -> None:  # as a new owner process would: a fresh backend
        fresh = BwrapBackend(work_root=work_root) if kind == "bwrap" else \
            LocalBackend(work_root=work_root)
        async with await fresh.start(SMALL):
            pass

    run(restart())
    assert workdirs(work_root) == []
    cgroups = detect_cgroups()
    if cgroups is not None:
        for base in cgroups.bases.values():
            assert not [n for n in os.listdir(base) if n.startswith(f"{owner.pid}-")], GROUP_DIR


class _FailingBackend(SandboxBackend):
    """A backend whose starts fail, like a remote sandbox server that is down."""

    name = "failing"

    def __init__(self) -> None:
        self.attempts = 0

    async def start(self, limits: Limits) -> Sandbox:
        self.attempts += 1
        raise SandboxStartError("server unreachable")


def test_failed_creations_free_their_slot() -> None:
    async def body() -> None:
        backend = _FailingBackend()
        pool = SandboxPool(backend, SMALL, PoolSettings(max_live=1, create_rate_per_s=1000))
        async with pool:
            for _ in range(3):  # with a leaked slot the second attempt would wait forever
                with pytest.raises(SandboxStartError):
                    async with pool.sandbox():
                        pass
            assert pool.stats().live == 0 and backend.attempts == 3

    run(body())


def test_pools_sharing_settings_keep_to_them_together() -> None:
    settings = PoolSettings(warm=5, max_live=16, create_rate_per_s=8.0, create_burst=4)
    share = settings.shared(3)
    assert (share.warm, share.max_live, share.create_burst) == (2, 6, 2)
    assert share.create_rate_per_s * 3 == pytest.approx(8.0)
    assert settings.shared(1) == settings
    assert PoolSettings(max_live=1).shared(4).max_live == 1  # never below one
    with pytest.raises(ValueError):
        settings.shared(0)
