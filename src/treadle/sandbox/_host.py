"""What the bwrap and local sandboxes share: a host work dir, exec bookkeeping, close.

A subclass says only how to launch one command (`_launch`); this class validates
arguments, clamps the timeout, sets up the exec's cgroups, tracks in-flight execs
so that `close` can stop them, and does the host-side file I/O off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from abc import abstractmethod
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from treadle.errors import SandboxClosed
from treadle.sandbox import _files, _process, _workdir
from treadle.sandbox._cgroup import Cgroups
from treadle.sandbox.base import DEFAULT_MAX_GET_BYTES, ExecResult, Limits, Sandbox

log = logging.getLogger(__name__)

BASE_LANG = "C.UTF-8"


class HostSandbox(Sandbox):
    """A sandbox whose work dir is a directory on this host."""

    def __init__(self, *, host_dir: str, limits: Limits, cgroups: Cgroups | None,
                 owner: tuple[int, int] | None) -> None:
        self._host_dir = host_dir  # the work dir as the host sees it
        self._limits = limits
        self._cgroups = cgroups
        self._owner = owner  # who owns files we put (the sandbox's uid, gid), or None
        self._closed = False
        self._running: set[asyncio.Task[ExecResult]] = set()
        self._closing: asyncio.Future[None] | None = None

    @property
    def host_dir(self) -> str:
        """The work dir's path on the host (tests and debugging only)."""
        return self._host_dir

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def closed(self) -> bool:
        return self._closed

    @abstractmethod
    def _launch(self, argv: list[str], env: dict[str, str]) -> _process.Launch:
        """The launcher for one exec; `env` is already validated and merged."""

    @abstractmethod
    def _base_env(self) -> dict[str, str]:
        """The minimal environment every command starts from."""

    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        args, merged, timeout = self._checked(argv, timeout_s, env)
        return await self._submit(self._run(args, merged, timeout, stdin))

    def _checked(self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None,
                 ) -> tuple[list[str], dict[str, str], float]:
        """An exec's argv, merged env and clamped timeout; raises as `exec` does."""
        args, extra, timeout = self._checked_exec(argv, timeout_s, env)
        return args, {**self._base_env(), **extra}, timeout

    async def _submit(self, run: Coroutine[Any, Any, ExecResult]) -> ExecResult:
        """Await `run` as a task close() can cancel (which kills its tree)."""
        task = asyncio.ensure_future(run)
        self._running.add(task)
        # Discarded when the task ends, not when we stop waiting: close() must wait
        # for the cleanup of an exec whose caller has already given up on it.
        task.add_done_callback(self._running.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is None or me.cancelling():
                # Our caller was cancelled: stop the exec, wait until its tree is gone.
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
            raise SandboxClosed("sandbox was closed while the command ran") from None

    async def _run(self, argv: list[str], env: dict[str, str], timeout_s: float,
                   stdin: bytes | None) -> ExecResult:
        launch = self._launch(argv, env)
        try:
            cgroup = self._cgroups.create(self._limits) if self._cgroups is not None else None
            return await _process.run(
                launch,
                timeout_s=timeout_s,
                max_output_bytes=self._limits.max_output_bytes,
                stdin=stdin,
                cgroup=cgroup,
            )
        finally:
            status = () if launch.status_fd is None else (launch.status_fd,)
            for fd in (*launch.pass_fds, *status):
                _close_quiet(fd)

    async def put_file(self, path: str, data: bytes) -> None:
        self._check_open()
        parts = _files.split_path(path, self.workdir)
        await asyncio.to_thread(_files.write_file, self._host_dir, parts, bytes(data), self._owner)

    async def get_file(self, path: str, max_bytes: int = DEFAULT_MAX_GET_BYTES) -> bytes:
        self._check_open()
        parts = _files.split_path(path, self.workdir)
        return await asyncio.to_thread(_files.read_file, self._host_dir, parts, max_bytes)

    async def close(self) -> None:
        if self._closing is None:
            self._closed = True
            running = list(self._running)
            for task in running:
                task.cancel()
            self._closing = asyncio.ensure_future(self._finish_close(running))
        # Every caller waits for the one cleanup. Shielded: a cancelled close must
        # still finish, or processes and dirs leak.
        await asyncio.shield(self._closing)

    async def _finish_close(self, running: list[asyncio.Task[ExecResult]]) -> None:
        await asyncio.gather(*running, return_exceptions=True)
        try:  # remove_workdir itself never raises; the thread hand-off might
            await asyncio.to_thread(_workdir.remove_workdir, self._host_dir)
        except Exception as e:  # close() must not fail: the next sweep removes the dir
            log.warning("cannot remove sandbox work dir %s: %s", self._host_dir, e)


def _close_quiet(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
