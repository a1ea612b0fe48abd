"""A real service on loopback in a thread of this process, for the service tests (as
its own `treadle serve` process: `treadle.bench.faults.ServiceProcess`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
