"""Faults to inject into a running service: a misbehaving network and process signals.

`FaultyProxy` relays TCP connections on loopback to a service and spoils a seeded
share of them the ways networks do: a reset (RST) or a clean close (FIN) after a
random number of answer bytes, wherever that falls (inside an HTTP chunk, inside an
NDJSON line), a stall of the answer for a while, or a half-open connection that
stops forwarding and never closes. `ServiceProcess` is a `treadle serve` process
with its emulated engines, which can be killed (-9), stopped and continued,
restarted on the same database and port, and whose engines can be killed or
stopped one at a time.

Linux only (/proc, process groups). Every wait here has a deadline.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from treadle.runtime.launcher import free_port, stop_process_group
from treadle.sandbox.inside.reaper import descendants

PROXY_FAULTS = ("reset", "cut", "stall", "half_open")
_START_TIMEOUT_S = 120.0


class FaultyProxy:
    """A TCP relay to `127.0.0.1:upstream_port`; see the module docstring.

    A share `fault_share` of new connections gets one fault of `kinds`, chosen with
    `rng` (seeded by the caller), after a random number of answer bytes, or after
    `fault_after` bytes when that is given; `faults` counts them by kind,
    `connections` all. A stall lasts up to `max_stall_s`. `close` ends every relay,
    half-open ones too.
    """

    def __init__(self, upstream_port: int, rng: random.Random, *, fault_share: float = 0.3,
                 kinds: tuple[str, ...] = PROXY_FAULTS, fault_after: int | None = None,
                 max_stall_s: float = 2.0) -> None:
        if not kinds or set(kinds) - set(PROXY_FAULTS):
            raise ValueError(f"kinds must be some of {PROXY_FAULTS}, got {kinds}")
        self.upstream_port = upstream_port
        self.fault_share = fault_share
        self.kinds = kinds
        self.fault_after = fault_after
        self.max_stall_s = max_stall_s
        self.faults: collections.Counter[str] = collections.Counter()
        self.connections = 0
        self._rng = rng
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._open: set[socket.socket] = set()

    def __enter__(self) -> FaultyProxy:
        threading.Thread(target=self._accept, name="faulty-proxy", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in list(self._open):
                with contextlib.suppress(OSError):
                    sock.close()

    def _draw(self) -> tuple[str | None, int, float]:
        with self._lock:
            self.connections += 1
            if self._rng.random() >= self.fault_share:
                return None, 0, 0.0
            kind = self._rng.choice(self.kinds)
            self.faults[kind] += 1
            after = self.fault_after or self._rng.randrange(1, 4096)
            return kind, after, self._rng.uniform(0.1, self.max_stall_s)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client, *self._draw()),
                             daemon=True).start()

    def _relay(self, client: socket.socket, fault: str | None, after: int,
               stall_s: float) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        except OSError:  # the service is down: the client sees its connection closed
            client.close()
            return
        with self._lock:
            self._open |= {client, upstream}
        sent = 0  # answer bytes relayed to the client
        peer = {client: upstream, upstream: client}
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select([client, upstream], [], [], 1.0)
                for src in readable:
                    data = src.recv(65536)
                    if not data:
                        return
                    if src is upstream and fault is not None and sent + len(data) > after:
                        head, data = data[:after - sent], data[after - sent:]
                        client.sendall(head)
                        sent += len(head)
                        if fault in ("reset", "cut"):
                            _close(client, reset=fault == "reset")
                            return
                        if fault == "half_open":  # forward nothing more, close nothing
                            self._closed.wait()
                            return
                        self._closed.wait(stall_s)  # a stall, then on as if nothing
                        fault = None
                    peer[src].sendall(data)
                    if src is upstream:
                        sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.close()
            with self._lock:
                self._open -= {client, upstream}


def _close(sock: socket.socket, *, reset: bool) -> None:
    if reset:  # SO_LINGER 0: close sends RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class ServiceProcess:
    """`treadle serve` on a fixed port and database, restartable; see the module
    docstring. `args` are its extra options (engines, time scale, policy)."""

    def __init__(self, db: Path, log: Path, token: str, args: list[str]) -> None:
        self.db = db
        self.log = log
        self.token = token
        self.args = args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Start it and wait until it answers with an engine in its pool."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "treadle", "serve", "--port", str(self.port),
                 "--db", str(self.db), "--token", self.token, "--sandbox", "none",
                 "--log-level", "warning", *self.args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the service did not start: {self.log.read_text()[-800:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if httpx.get(f"{self.url}/healthz", timeout=2).json()["engines"] > 0:
                    return
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the service and its engines (its process group); no cleanup runs."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """Stop it as a shutdown would (SIGTERM, then SIGKILL after a grace)."""
        if self.proc is not None:
            stop_process_group(self.proc)

    def pause(self, seconds: float) -> None:
        """SIGSTOP the service process alone for `seconds`, then SIGCONT."""
        self._signal_for(self._pid(), seconds)

    def engines(self) -> list[int]:
        """Pids of its emulated engine processes."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        out = []
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"engine" in argv and b"emulate" in argv:
                    out.append(pid)
        return sorted(out)

    def kill_engine(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def pause_engine(self, pid: int, seconds: float) -> None:
        self._signal_for(pid, seconds)

    def _pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @staticmethod
    def _signal_for(pid: int, seconds: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(seconds)  # the fault's duration itself
            finally:
                os.kill(pid, signal.SIGCONT)


__all__ = ["PROXY_FAULTS", "FaultyProxy", "ServiceProcess"]
