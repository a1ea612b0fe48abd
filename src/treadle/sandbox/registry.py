"""Backends by name, and `exec_once` for one-off commands (the CLI uses it)."""

from __future__ import annotations

from collections.abc import Sequence

from treadle.sandbox.base import ExecResult, Limits, SandboxBackend
from treadle.sandbox.bwrap import BwrapBackend
from treadle.sandbox.local import LocalBackend

BACKENDS: dict[str, type[SandboxBackend]] = {
    "bwrap": BwrapBackend,
    "local": LocalBackend,
}


def get_backend(name: str) -> SandboxBackend:
    """A backend with default options; KeyError naming the valid choices."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown sandbox backend {name!r}; choose one of "
                       f"{', '.join(sorted(BACKENDS))}") from None
    return cls()


async def exec_once(
    backend_name: str,
    argv: Sequence[str],
    timeout_s: float,
    memory_mb: int,
    *,
    stdin: bytes | None = None,
) -> ExecResult:
    """Run one command in a fresh sandbox (default limits otherwise), then close it.

    The wall ceiling is set to `timeout_s`. Raises KeyError for an unknown backend,
    SandboxUnavailable if it cannot run here, ValueError for bad arguments.
    """
    backend = get_backend(backend_name)
    limits = Limits(memory_mb=memory_mb, wall_timeout_s=timeout_s)
    sandbox = await backend.start(limits)
    async with sandbox:
        return await sandbox.exec(argv, timeout_s=timeout_s, stdin=stdin)
