"""A real service on loopback in a thread of this process, for the service tests (as
its own `treadle serve` process: `treadle.bench.faults.ServiceProcess`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

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


def until(condition: Callable[[], bool], hopeless: Callable[[], str | None]) -> None:
    """Wait until `condition` holds, a state another process brings about (rows in its
    store: no event crosses the process boundary, so it is looked at again and again).
    No deadline decides: `hopeless` names what would keep it from ever holding (the
    job ended, the process died), checked at every look, and fails the test at once; a
    hang is pytest-timeout's."""
    while not condition():
        why = hopeless()
        assert why is None, why
        time.sleep(0.02)  # between two looks, not a wait for the state

