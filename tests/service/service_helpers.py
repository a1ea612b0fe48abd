"""A real service on loopback, in a thread of this process or as a `treadle serve`
process, for the service tests."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn

from treadle.served import loopback_socket, serving_in_thread
from treadle.service.app import create_app
from treadle.service.state import ServiceConfig, build_service


@contextlib.contextmanager
def running_service(config: ServiceConfig) -> Iterator[str]:
    """The service's base URL while the block runs."""
    sock = loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(build_service(config)), log_level="warning",
                                           lifespan="on", access_log=False))
    with serving_in_thread(server, sock, name=f"treadle-service-{port}",
                           startup_timeout_s=60):
        yield f"http://127.0.0.1:{port}"


def serve_process(db: Path, port: int, log: Path, *, token: str,
                  time_scale: float = 0.05) -> subprocess.Popen[bytes]:
    """`treadle serve` on `port` (two emulated engines, policy verl) in its own
    session (kill it with os.killpg), once /healthz reports both engines; its output
    goes to `log`."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "treadle", "serve", "--port", str(port), "--db", str(db),
             "--token", token, "--emulate", "2", "--time-scale", str(time_scale),
             "--policy", "verl", "--log-level", "warning"], stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).json()["engines"] == 2:
                return proc
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"service not up; log:\n{log.read_text()[-2000:]}")


class CuttingProxy:
    """A TCP relay on loopback to `upstream` (host, port) that cuts every connection
    once it has relayed `cut_after` bytes of the answer, wherever that falls (inside
    an HTTP chunk, inside an NDJSON line): a network that keeps dropping streams.
    Cuts alternate between a clean close (FIN) and a reset (RST). `cuts` counts them.
    Use as a context manager; `url` is the proxy's base URL."""

    def __init__(self, upstream: tuple[str, int], cut_after: int) -> None:
        self.upstream = upstream
        self.cut_after = cut_after  # answer bytes relayed per connection before the cut
        self.cuts = 0
        self._listener = loopback_socket()
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        self._lock = threading.Lock()

    def __enter__(self) -> CuttingProxy:
        self._listener.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        """Both directions in one thread (select), so that a cut closes sockets no
        other thread is blocked on, and a reset really goes out as RST."""
        sent = 0  # answer bytes relayed to the client
        peer = {client: upstream, upstream: client}
        try:
            while True:
                readable, _, _ = select.select([client, upstream], [], [])
                for src in readable:
                    data = src.recv(65536)
                    if not data:
                        return
                    if src is upstream and sent + len(data) > self.cut_after:
                        client.sendall(data[:self.cut_after - sent])
                        self._cut(upstream, client)
                        return
                    peer[src].sendall(data)
                    sent += len(data) if src is upstream else 0
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.close()

    def _cut(self, upstream: socket.socket, client: socket.socket) -> None:
        with self._lock:
            self.cuts += 1
            reset = self.cuts % 2 == 0
        if reset:  # SO_LINGER 0: close sends RST instead of FIN
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        upstream.close()
