"""The local backend: same limits, timeout, output cap and tree kill as bwrap; no isolation."""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import pytest
from sandbox_helpers import SMALL, eventually, marker, run, sleepers

from treadle.errors import SandboxClosed
from treadle.sandbox import Limits, LocalBackend
from treadle.sandbox import local as local_module


def test_runs_in_its_work_dir_with_a_cleared_environment(
        local: LocalBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_TEST_SECRET", "local-secret-value")

    async def body() -> None:
        async with await local.start(SMALL) as sb:
            await sb.put_file("in.txt", b"hello")
            result = await sb.exec(["sh", "-c", "pwd; cat in.txt; echo; env; cat >out.txt"],
                                   timeout_s=5, stdin=b"from stdin", env={"EXTRA": "1"})
            assert result.ok, result
            lines = result.stdout.splitlines()
            assert lines[0] == sb.workdir and lines[1] == "hello"
            assert "EXTRA=1" in lines and f"HOME={sb.workdir}" in lines
            assert "local-secret-value" not in result.stdout
            assert await sb.get_file("out.txt") == b"from stdin"

    run(body())


def test_timeout_kills_the_whole_tree(local: LocalBackend) -> None:
    tag = marker()

    async def body() -> None:
        async with await local.start(SMALL) as sb:
            result = await sb.exec(["sh", "-c", f"sleep {tag} & sleep {tag}"], timeout_s=1)
            assert result.timed_out and result.killed == "timeout" and result.exit_code is None
            assert 0.9 < result.duration_s < 4
            assert sleepers(tag) == []

    run(body())


def test_output_cap_truncates_and_kills(local: LocalBackend) -> None:
    async def body() -> None:
        async with await local.start(SMALL) as sb:
            result = await sb.exec(["yes"], timeout_s=5)
            assert result.truncated and result.killed == "output_limit"
            assert len(result.stdout) == SMALL.max_output_bytes

    run(body())


def test_background_and_daemonised_processes_die_with_the_exec(local: LocalBackend) -> None:
    tags = [marker() for _ in range(3)]
    script = (f"sleep {tags[0]} & "
              f"setsid sh -c 'sleep {tags[1]}' & "
              f"( ( setsid sleep {tags[2]} & ) & ) ; echo started")

    async def body() -> None:
        sb = await local.start(SMALL)
        result = await sb.exec(["sh", "-c", script], timeout_s=5)
        assert result.ok and result.stdout == "started\n"
        for tag in tags:  # gone as soon as exec returns, before close
            assert sleepers(tag) == [], tag
        await sb.close()

    run(body())


def test_cpu_limit(local: LocalBackend) -> None:
    async def body() -> None:
        async with await local.start(SMALL) as sb:
            result = await sb.exec(["sh", "-c", "while :; do :; done"], timeout_s=8)
            assert result.killed == "cpu" and result.exit_code is None

    run(body())


def test_cancelled_exec_and_close_leave_nothing(local: LocalBackend) -> None:
    tag = marker()

    async def body() -> None:
        sb = await local.start(SMALL)
        task = asyncio.ensure_future(sb.exec(["sh", "-c", f"sleep {tag}"], timeout_s=30))
        await eventually(lambda: sleepers(tag))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sleepers(tag) == []
        # An exec interrupted by close() raises SandboxClosed, not CancelledError.
        running = asyncio.ensure_future(sb.exec(["sleep", tag], timeout_s=30))
        await eventually(lambda: sleepers(tag))
        await sb.close()
        with pytest.raises(SandboxClosed):
            await running
        assert sleepers(tag) == []
        await sb.close()  # idempotent
        with pytest.raises(SandboxClosed):
            await sb.exec(["true"], timeout_s=1)

    run(body())


def test_local_does_not_isolate_and_says_so(local: LocalBackend,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """The contrast to the bwrap battery: local reaches the host's loopback."""
    monkey_warned = local_module._warned
    local_module._warned = False
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    async def body() -> None:
        with caplog.at_level(logging.WARNING, logger="treadle.sandbox.local"):
            async with await local.start(Limits()) as sb:
                result = await sb.exec(["bash", "-c", f"echo hi >/dev/tcp/127.0.0.1/{port}"],
                                       timeout_s=5)
                assert result.ok, result
        assert any("does not isolate" in r.message for r in caplog.records)

    try:
        run(body())
    finally:
        listener.close()
        local_module._warned = monkey_warned or local_module._warned


def test_work_dir_is_removed_on_close(local: LocalBackend) -> None:
    async def body() -> str:
        async with await local.start(SMALL) as sb:
            await sb.exec(["sh", "-c", "mkdir -p a/b && touch a/b/c && chmod 500 a/b a"],
                          timeout_s=5)
            return sb.workdir

    path = run(body())
    assert not os.path.exists(path)
