"""How the store's calls share its one SQLite connection: `Transactions`.

    tx = Transactions(conn)
    with tx.write():      # one call that writes: BEGIN IMMEDIATE ... COMMIT
        ...
    with tx.batch():      # several calls, one commit
        with tx.write():  # each a savepoint: undone alone if it raises
            ...

Contracts:

- Every call is atomic. On its own, a call is one transaction (`write`: ``BEGIN
  IMMEDIATE``, rolled back if it raises; `read`: ``BEGIN``, one snapshot for its
  statements). Inside a `batch` it is a savepoint of the batch's transaction: a call
  that raises undoes its own writes and no other call's, and a later call in the
  batch sees the earlier ones' writes, as it would one transaction after another.
- A batch commits once, at its end: its calls' changes become durable (and visible
  to other connections) together, or, if the commit fails or the connection's
  transaction was lost on the way (SQLite rolls a whole transaction back on some
  errors, a full disk among them), none of them. `batch` raises then, and its
  caller must treat every call of the batch as failed.
- Cost: a commit writes every page its transaction touched to the WAL once, so
  calls batched together share the pages they touch (a job's row, index pages)
  and one commit, instead of one each.
- Threads: a re-entrant lock serialises the connection; a batch holds it from
  start to commit, so another thread's call waits for the whole batch.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator

from treadle.store.errors import StoreError


class Transactions:
    """The store connection's transactions and savepoints (module docstring)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.lock = threading.RLock()
        self._open = 0  # the transaction and savepoints open, on the lock's holder only

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """One transaction around the calls made inside it (each a savepoint), committed
        at its end; a batch inside a batch is part of it."""
        with self.lock:
            if self._open:
                yield
                return
            with self._transaction():
                yield

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """One call's writes: a transaction, or in a batch a savepoint of it."""
        with self.lock:
            if not self._open:
                with self._transaction():
                    yield
                return
            if not self.conn.in_transaction:
                # Outside a transaction a savepoint would start (and commit) one of its
                # own, apart from the batch's.
                raise StoreError("an earlier call's error rolled this batch back")
            self.conn.execute("SAVEPOINT call")
            self._open += 1
            try:
                yield
            except BaseException:
                # Undo this call alone. Where SQLite has already rolled the whole
                # transaction back there is nothing to return to: the batch's commit
                # fails, and takes every call with it (module docstring).
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK TO call")
                    self.conn.execute("RELEASE call")
                raise
            finally:
                self._open -= 1
            self.conn.execute("RELEASE call")

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        """One call's reads: one snapshot, even while another process writes (in a
        batch: the batch's, with its writes so far)."""
        with self.lock:
            if self._open:
                yield
                return
            self.conn.execute("BEGIN")
            try:
                yield
            finally:
                self.conn.execute("COMMIT")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self.conn.execute("BEGIN IMMEDIATE")
        self._open = 1
        try:
            yield
            if not self.conn.in_transaction:
                raise StoreError("an error rolled this transaction back")
            self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:  # a failed COMMIT leaves it open
                self.conn.execute("ROLLBACK")
            raise
        finally:
            self._open = 0


__all__ = ["Transactions"]
