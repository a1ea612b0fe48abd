"""The store's own process (`treadle.store.process.StoreProcess` starts it):

    python -m treadle.store.child FD PATH SYNCHRONOUS

FD is its end of a socket to the parent. It opens the `Store` at PATH and answers
("ready", None), or ("error", exception) and exits; then runs each batch received,
``(calls, grouped)``, answering its outcomes (`Store.run_batch`), until the parent
sends CLOSE (it closes the store and answers "closed") or is gone (its socket
closed).
"""

from __future__ import annotations

import pickle
import sys
from multiprocessing.connection import Connection
from typing import Any

from treadle.store.db import Store
from treadle.store.errors import StoreError

CLOSE = "close"  # the parent's last message


def portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a StoreError that names it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return StoreError(f"{type(e).__name__}: {e}")


def serve(conn: Connection, path: str, synchronous: Any) -> int:
    """Open the store and run batches (module docstring); the exit status."""
    try:
        store = Store(path, synchronous=synchronous)
    except BaseException as e:
        conn.send(("error", portable(e)))
        return 1
    conn.send(("ready", None))
    closing = False
    try:
        while not closing:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return 0  # the parent is gone
            if message == CLOSE:
                closing = True
                continue
            calls, grouped = message
            answer = [(ok, value if ok else portable(value))
                      for ok, value in store.run_batch(calls, grouped)]
            try:
                conn.send(answer)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                conn.send([(False, StoreError(f"a result could not be sent back: {e}"))]
                          * len(answer))
            except OSError:
                return 0  # the parent is gone
    finally:
        store.close()
    conn.send("closed")
    return 0


def main() -> int:
    fd, path, synchronous = sys.argv[1:4]
    return serve(Connection(int(fd)), path, synchronous)


if __name__ == "__main__":
    sys.exit(main())
