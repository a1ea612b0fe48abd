"""A real service on loopback in a thread of this process, for the service tests (as
its own `treadle serve` process: `treadle.bench.faults.ServiceProcess`)."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import inotify_simple
import uvicorn

from treadle.served import loopback_socket, serving_in_thread
from treadle.service.app import create_app
from treadle.service.state import Service, ServiceConfig, build_service


@contextlib.contextmanager
def running_service(config: ServiceConfig) -> Iterator[str]:
    """The service's base URL while the block runs."""
    with running(config) as (url, _):
        yield url


@contextlib.contextmanager
def running(config: ServiceConfig, *,
            startup_timeout_s: float = 60.0) -> Iterator[tuple[str, Service]]:
    """The service's base URL and its parts while the block runs (the parts belong to
    the service's thread: read them, do not drive them)."""
    sock = loopback_socket()
    port = sock.getsockname()[1]
    service = build_service(config)
    if service.gateway.url is None:  # where harnesses reach it
        service.gateway.url = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning",
                                           lifespan="on", access_log=False))
    with serving_in_thread(server, sock, name=f"treadle-service-{port}",
                           startup_timeout_s=startup_timeout_s):
        yield f"http://127.0.0.1:{port}", service


def service_schema(config: ServiceConfig) -> dict[str, Any]:
    """The OpenAPI schema of a service configured so (nothing started)."""
    service = build_service(config)
    try:
        schema: dict[str, Any] = create_app(service).openapi()
    finally:
        service.store.store.close()
    return schema


def until(condition: Callable[[], bool], hopeless: Callable[[], str | None], store: Path,
          service: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until `condition` holds, a state a service brings about by writing its
    SQLite store `store`. It is looked at once now and again after each write (an
    inotify event on the store's folder: the file, its WAL, its journal) and when the
    `service` process ends (its pidfd), never on a timer. No deadline decides:
    `hopeless` names what would keep it from ever holding (the job ended), checked at
    every look, and fails the test at once, as does the service's end; a hang is
    pytest-timeout's. Writes of other files in the folder only cost a look."""
    with inotify_simple.INotify() as writes, contextlib.ExitStack() as stack:
        # Watched before the first look, so no write after it goes unseen.
        writes.add_watch(store.parent, inotify_simple.flags.MODIFY
                         | inotify_simple.flags.CREATE | inotify_simple.flags.MOVED_TO)
        ready: list[int] = [writes.fileno()]
        if service is not None:
            pidfd = os.pidfd_open(service.pid)
            stack.callback(os.close, pidfd)
            ready.append(pidfd)
        while not condition():
            why = hopeless()
            assert why is None, why
            assert service is None or service.poll() is None, \
                f"the service ended ({service.returncode})"
            select.select(ready, [], [])
            writes.read(timeout=0)  # these writes are looked at next: drop their events
