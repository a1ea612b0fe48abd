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
  StoreProcessLost; whether that batch committed is unknown (`AsyncStore` makes
  `finish`, idempotent, and `start`, at worst an attempt more, once again itself).
  The next batch starts a new process on the same file, which keeps everything
  committed. A batch whose await is cancelled midway
  leaves the socket out of step: the child is stopped, and the next batch starts
  another; so does a batch whose loop was closed before it was answered.
- The child never outlives this process: it exits when its socket closes. It runs in
  a session of its own, so a terminal's Ctrl-C reaches only this process, which
  closes it in order.
- One batch at a time (`AsyncStore` sends one at a time); a second is a RuntimeError.
  A call that cannot be sent (a `local` one, arguments that do not pickle) fails
  alone, as a call that raises does.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Literal

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
        self._idle = threading.Event()  # no batch under way
        self._idle.set()
        self._under_way: asyncio.AbstractEventLoop | None = None  # the loop awaiting one
        self._closed = False  # no batch more
        self._proc, self._sock = self._start()

    @property
    def pid(self) -> int:
        """The child's process id (its CPU is counted apart: `bench service`)."""
        return self._proc.pid

    async def run(self, calls: Sequence[StoreCall], grouped: bool) -> list[Outcome]:
        """`run_batch` in the child (module docstring); StoreProcessLost if it
        exits meanwhile. A call that cannot be sent fails alone, the rest run: a
        `local` call (TypeError), one whose arguments do not pickle (pickle's error)."""
        if self._closed:
            raise StoreError("the store is closed")
        self._abandoned()
        if not self._idle.is_set():
            raise RuntimeError("a StoreProcess runs one batch at a time")
        self._idle.clear()
        self._under_way = asyncio.get_running_loop()
        try:
            if self._proc.poll() is not None:
                log.warning("the store's process exited (code %s): starting another",
                            self._proc.returncode)
                self._sock.close()
                self._proc, self._sock = await asyncio.to_thread(self._start)
            outcomes, sent, data = _framed(calls, grouped)
            for i, outcome in zip(sent, await self._exchange(data, len(sent)), strict=True):
                outcomes[i] = outcome
        finally:
            self._under_way = None
            self._idle.set()
        return [o if o is not None else (False, StoreError("no answer")) for o in outcomes]

    async def _exchange(self, data: bytes, expected: int) -> list[Outcome]:
        """Send a framed batch and read its `expected` outcomes."""
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(self._sock, data)
            size = int.from_bytes(await _exactly(loop, self._sock, HEADER), "little")
            answered = pickle.loads(await _exactly(loop, self._sock, size))
        except (OSError, EOFError) as e:
            code = await asyncio.to_thread(self._reap)  # gone: its socket closed
            raise StoreProcessLost(f"the store's process exited (code {code}) during a "
                                   f"batch: {type(e).__name__}") from e
        except BaseException:  # cancelled midway: the stream is out of step
            self._proc.kill()
            self._proc.wait()  # so that the next batch finds it gone (SIGKILL: at once)
            raise
        if not isinstance(answered, list) or len(answered) != expected:
            self._proc.kill()
            code = await asyncio.to_thread(self._reap)
            raise StoreProcessLost(f"the store's process answered out of step (stopped, "
                                   f"code {code})")
        return answered

    async def aclose(self) -> None:
        """Close the file and wait for the child to exit (idempotent), after the batch
        under way."""
        self._closed = True  # no batch more
        self._abandoned()
        await asyncio.to_thread(self._idle.wait)
        await asyncio.to_thread(self._close)

    def _abandoned(self) -> None:
        """A batch left under way by a loop closed before it was answered (its task
        never to run again) leaves the socket out of step: the child is stopped, and
        the next batch starts another."""
        loop = self._under_way
        if loop is not None and loop.is_closed():
            self._proc.kill()
            self._proc.wait()
            self._under_way = None
            self._idle.set()

    def _reap(self) -> int:
        """The child's exit status, once it has exited (killed if it does not)."""
        try:
            return self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()

    def close(self) -> None:
        """`aclose` for a caller without a loop (none of `run` may be under way)."""
        self._closed = True
        self._close()

    def _close(self) -> None:
        if self._sock.fileno() == -1:
            return  # closed already
        try:
            self._sock.setblocking(True)
            self._sock.sendall(frame(CLOSE))
            receive(self._sock)
        except (OSError, EOFError):
            pass  # gone already: nothing of it to close
        finally:
            self._sock.close()
        self._reap()

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


def _framed(calls: Sequence[StoreCall], grouped: bool
            ) -> tuple[list[Outcome | None], list[int], bytes]:
    """The outcomes known before sending (the calls that cannot be sent), the indices
    of those sent, and their frame."""
    outcomes: list[Outcome | None] = [
        None if c.local is None else
        (False, TypeError("a store in its own process runs only its own methods"))
        for c in calls]
    sent = [i for i, o in enumerate(outcomes) if o is None]
    try:
        return outcomes, sent, frame(([calls[i] for i in sent], grouped and len(sent) > 1))
    except Exception:  # some call's arguments do not pickle: each one that does goes
        for i in sent:
            try:
                pickle.dumps(calls[i], protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                outcomes[i] = (False, e)
        sent = [i for i, o in enumerate(outcomes) if o is None]
        return outcomes, sent, frame(([calls[i] for i in sent], grouped and len(sent) > 1))


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
