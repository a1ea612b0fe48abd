"""`StoreProcess`: a `Store` in a process of its own, run by batches of calls.

    store = StoreProcess("treadle.db")       # starts `python -m treadle.store.child`
    astore = AsyncStore(store)               # the service's store, as with a Store
    ...
    store.close()                            # the process closes the file and exits

A busy service spends much of its process's CPU in SQLite and in encoding records
(`benchmarks/README.md`, "Runners on Ray"); that work does not need the scheduler's
interpreter. Here it runs in a child process: `AsyncStore`'s worker thread pickles
each batch of calls (`treadle.store.calls`) onto a socket and waits for the outcomes,
so this process pays the pickling and two system calls a batch, and the GIL is free
meanwhile.

Contracts:

- The same calls, results and errors as a `Store` (`run_batch`'s contract): what a
  call raises there is raised here (an exception that cannot be pickled arrives as a
  StoreError naming it). Opening the file fails here as it would there (a newer
  schema: SchemaError), from the constructor.
- A file only: ":memory:" is a ValueError (a child's memory is no one's store).
- Losing the process (killed, crashed) fails the batch under way with
  StoreProcessLost; whether that batch committed is unknown (each call of it may be
  repeated: `finish` is idempotent). The next batch starts a new process on the same
  file, which keeps everything committed.
- The child never outlives this process: it exits when its socket closes. It runs in
  a session of its own, so a terminal's Ctrl-C reaches only this process, which
  closes it in order.
- One batch at a time (`AsyncStore` has one worker); a lock keeps it so.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Literal

from treadle.store.calls import Outcome, StoreCall
from treadle.store.child import CLOSE
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
        self._lock = threading.Lock()
        self._closed = False
        self._proc, self._conn = self._start()

    @property
    def pid(self) -> int:
        """The child's process id (its CPU is counted apart: `bench service`)."""
        return self._proc.pid

    def run_batch(self, calls: Sequence[StoreCall], grouped: bool) -> list[Outcome]:
        """`Store.run_batch` in the child (module docstring); StoreProcessLost if it
        exits meanwhile. A `local` call is refused (TypeError), the rest run."""
        refused = TypeError("a store in its own process runs only its own methods")
        sent = [c for c in calls if c.local is None]
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed")
            if self._proc.poll() is not None:
                log.warning("the store's process exited (code %s): starting another",
                            self._proc.returncode)
                self._conn.close()
                self._proc, self._conn = self._start()
            try:
                self._conn.send((sent, grouped and len(sent) > 1))
                answered: list[Outcome] = self._conn.recv()
            except (OSError, EOFError) as e:
                self._proc.wait()  # gone: its socket closed
                raise StoreProcessLost(f"the store's process exited (code "
                                       f"{self._proc.returncode}) during a batch: "
                                       f"{type(e).__name__}") from e
        outcomes = iter(answered)
        return [next(outcomes) if c.local is None else (False, refused) for c in calls]

    def close(self) -> None:
        """Close the file and wait for the child to exit (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._conn.send(CLOSE)
                self._conn.recv()
            except (OSError, EOFError):
                pass  # gone already: nothing of it to close
            finally:
                self._conn.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def _start(self) -> tuple[subprocess.Popen[bytes], Connection]:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "treadle.store.child", str(theirs.fileno()),
                 self.path, self.synchronous],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                start_new_session=True)
            conn = Connection(ours.detach())
        try:
            if not conn.poll(self.start_timeout_s):
                raise StoreError(f"the store's process did not open {self.path} within "
                                 f"{self.start_timeout_s:g} s")
            kind, value = conn.recv()
        except BaseException as e:
            conn.close()
            proc.kill()
            proc.wait()
            if isinstance(e, EOFError):
                raise StoreError(f"the store's process exited opening {self.path} (code "
                                 f"{proc.returncode})") from None
            raise
        if kind != "ready":
            conn.close()
            proc.wait()
            raise value
        return proc, conn


__all__ = ["StoreProcess", "StoreProcessLost"]
