"""Backends by name, and `exec_once` for one-off commands (the CLI uses it)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from treadle.errors import SandboxUnavailable
from treadle.sandbox.base import ExecResult, Limits, SandboxBackend
from treadle.sandbox.bwrap import BwrapBackend
from treadle.sandbox.local import LocalBackend

BACKENDS: dict[str, type[SandboxBackend]] = {
    "bwrap": BwrapBackend,
    "local": LocalBackend,
}
# Backends that need an optional extra, imported on first use so that the sandbox
# layer itself stays dependency-free: name -> (module, class, pip extra).
OPTIONAL_BACKENDS: dict[str, tuple[str, str, str]] = {
    "remote": ("treadle.sandbox.remote", "RemoteBackend", "server"),
}


def usable_backend_name() -> str:
    """"bwrap" where a bwrap sandbox really starts and runs python3 here (installed
    is not enough: user namespaces may be off), else "local"."""
    import asyncio

    from treadle.errors import SandboxError

    async def probe() -> bool:
        try:
            async with await BwrapBackend().start(Limits(wall_timeout_s=20)) as box:
                return (await box.exec(["python3", "-c", "print(1)"], timeout_s=20)).ok
        except SandboxError:
            return False

    return "bwrap" if asyncio.run(probe()) else "local"


def backend_names() -> list[str]:
    """Every backend name `get_backend` accepts."""
    return sorted([*BACKENDS, *OPTIONAL_BACKENDS])


def get_backend(name: str, **options: Any) -> SandboxBackend:
    """A backend built with `options` (none: its defaults; `remote` needs servers and token).

    KeyError naming the valid choices; SandboxUnavailable when an optional backend's
    extra is not installed.
    """
    cls = BACKENDS.get(name)
    if cls is None and name in OPTIONAL_BACKENDS:
        module, attr, extra = OPTIONAL_BACKENDS[name]
        try:
            cls = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise SandboxUnavailable(f"the {name!r} sandbox backend needs the '{extra}' extra: "
                                     f"pip install 'treadle[{extra}]' ({e})") from None
    if cls is None:
        raise KeyError(f"unknown sandbox backend {name!r}; choose one of "
                       f"{', '.join(backend_names())}")
    backend: SandboxBackend = cls(**options)
    return backend


async def exec_once(
    backend_name: str,
    argv: Sequence[str],
    timeout_s: float,
    memory_mb: int,
    *,
    stdin: bytes | None = None,
    backend_options: Mapping[str, Any] | None = None,
    image: str | None = None,
) -> ExecResult:
    """Run one command in a fresh sandbox (default limits otherwise), then close it.

    The wall ceiling is set to `timeout_s`; `backend_options` go to the backend's
    constructor; `image`: the environment image it runs on (`SandboxBackend.with_image`).
    Raises KeyError for an unknown backend, SandboxUnavailable if it cannot run here
    (SandboxImageError: not on that image), SandboxUnsupported where the backend runs
    no images, ValueError for bad arguments.
    """
    backend = get_backend(backend_name, **(backend_options or {})).with_image(image)
    limits = Limits(memory_mb=memory_mb, wall_timeout_s=timeout_s)
    sandbox = await backend.start(limits)
    async with sandbox:
        return await sandbox.exec(argv, timeout_s=timeout_s, stdin=stdin)
