"""`StoreProcess`: a `Store` in a process of its own, run by batches of calls.

    astore = AsyncStore(StoreProcess("treadle.db"))  # starts python -m treadle.store.child
    ...
    await astore.aclose()                            # the child closes the file, exits

A busy service spends much of its process's CPU in SQLite and in encoding records
(`benchmarks/README.md`, "Runners on Ray"); that work does not need the scheduler's
interpreter. Here it runs in a child process. `run` pickles a batch of calls
(`treadle.store.calls`) onto a socket and awaits the outcomes on the event loop that
asks (`loop.sock_sendall`, `loop.sock_recv_into`): no thread stands between, so a
batch costs this process its pickling and a few system calls, and no thread hand-off.

Contracts:

- The same calls, results and errors as a `Store` (`run_batch`'s contract): what a
  call raises there is raised here (an exception that cannot be pickled arrives as a
  StoreError naming it). Opening the file fails here as it would there (a newer
  schema: SchemaError), from the constructor.
- A file only: ":memory:" is a ValueError (a child's memory is no one's store).
- Losing the process (killed, crashed) fails the batch under way with
  StoreProcessLost; whether that batch committed is unknown (each call of it may be
  repeated: `finish` is idempotent). The next batch starts a new process on the same
  file, which keeps everything committed. A batch whose await is cancelled midway
  leaves the socket out of step: the child is stopped, and the next batch starts
  another.
- The child never outlives this process: it exits when its socket closes. It runs in
  a session of its own, so a terminal's Ctrl-C reaches only this process, which
  closes it in order.
- One batch at a time (`AsyncStore` sends one at a time); a second is a RuntimeError.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, Literal

from treadle.store.calls import Outcome, StoreCall
from treadle.store.child import CLOSE, HEADER, frame, receive
from treadle.store.errors import StoreError, StoreProcessLost

log = logging.getLogger(__name__)


class StoreProcess:
    """A `Store` in a child process (module docstring); a `StoreSide`."""

    def __init__(self, path: str, *, synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
                 start_timeout_s: float = 120.0) -> None:
        if str(path) == ":memory:":
            raise ValueError("a store in its own process needs a file, not ':memory:'")
        self.path = str(path)
        self.synchronous = synchronous
        self.start_timeout_s = start_timeout_s  # for the child to import and open the file
        self._busy = False  # a batch is under way
        self._closed = False
        self._proc, self._sock = self._start()

    @property
    def pid(self) -> int:
        """The child's process id (its CPU is counted apart: `bench service`)."""
        return self._proc.pid

    async def run(self, calls: Sequence[StoreCall], grouped: bool) -> list[Outcome]:
        """`Store.run_batch` in the child (module docstring); StoreProcessLost if it
        exits meanwhile. A `local` call is refused (TypeError), the rest run."""
        if self._closed:
            raise StoreError("the store is closed")
        if self._busy:
            raise RuntimeError("a StoreProcess runs one batch at a time")
        self._busy = True
        try:
            if self._proc.poll() is not None:
                log.warning("the store's process exited (code %s): starting another",
                            self._proc.returncode)
                self._sock.close()
                self._proc, self._sock = await asyncio.to_thread(self._start)
            sent = [c for c in calls if c.local is None]
            answered = await self._exchange((sent, grouped and len(sent) > 1))
        finally:
            self._busy = False
        refused = TypeError("a store in its own process runs only its own methods")
        outcomes = iter(answered)
        return [next(outcomes) if c.local is None else (False, refused) for c in calls]

    async def _exchange(self, message: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(self._sock, frame(message))
            size = int.from_bytes(await _exactly(loop, self._sock, HEADER), "little")
            return pickle.loads(await _exactly(loop, self._sock, size))
        except (OSError, EOFError) as e:
            code = await asyncio.to_thread(self._proc.wait)  # gone: its socket closed
            raise StoreProcessLost(f"the store's process exited (code {code}) during a "
                                   f"batch: {type(e).__name__}") from e
        except BaseException:  # cancelled midway: the stream is out of step
            self._proc.kill()
            self._proc.wait()  # so that the next batch finds it gone (SIGKILL: at once)
            raise

    async def aclose(self) -> None:
        """Close the file and wait for the child to exit (idempotent)."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """`aclose` for a caller without a loop (none of `run` may be under way)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.setblocking(True)
            self._sock.sendall(frame(CLOSE))
            receive(self._sock)
        except (OSError, EOFError):
            pass  # gone already: nothing of it to close
        finally:
            self._sock.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _start(self) -> tuple[subprocess.Popen[bytes], socket.socket]:
        ours, theirs = socket.socketpair()
        with theirs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "treadle.store.child", str(theirs.fileno()),
                 self.path, self.synchronous],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                start_new_session=True)
        try:
            ours.settimeout(self.start_timeout_s)
            kind, value = receive(ours)
        except BaseException as e:
            ours.close()
            proc.kill()
            proc.wait()
            if isinstance(e, TimeoutError):
                raise StoreError(f"the store's process did not open {self.path} within "
                                 f"{self.start_timeout_s:g} s") from None
            if isinstance(e, EOFError):
                raise StoreError(f"the store's process exited opening {self.path} (code "
                                 f"{proc.returncode})") from None
            raise
        if kind != "ready":
            ours.close()
            proc.wait()
            raise value
        ours.setblocking(False)  # from now on read and written by the event loop
        return proc, ours


async def _exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise EOFError("the store's socket closed")
        got += k
    return buf


__all__ = ["StoreProcess"]
