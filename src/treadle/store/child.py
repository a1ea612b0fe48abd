"""The store's own process (`treadle.store.process.StoreProcess` starts it):

    python -m treadle.store.child FD PATH SYNCHRONOUS

FD is its end of a socket to the parent. Every message either way is one frame: an
8-byte little-endian length, then that many bytes of pickle. The child opens the
`Store` at PATH and answers ("ready", None), or ("error", exception) and exits; then
runs each batch received, ``(calls, grouped)``, answering its outcomes
(`treadle.store.calls.run_batch`), until the parent sends CLOSE (it closes the
store and answers "closed") or is gone (its socket closed).
"""

from __future__ import annotations

import pickle
import socket
import sys
from typing import Any

from treadle.store.calls import run_batch
from treadle.store.db import Store
from treadle.store.errors import StoreError

CLOSE = "close"  # the parent's last message
HEADER = 8  # bytes of a frame's length


def frame(message: Any) -> bytes:
    """`message` as one frame (module docstring)."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(body).to_bytes(HEADER, "little") + body


def portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a StoreError that names it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return StoreError(f"{type(e).__name__}: {e}")


def receive(sock: socket.socket) -> Any:
    """The next frame's message (a blocking socket); EOFError once it is closed."""
    size = int.from_bytes(_exactly(sock, HEADER), "little")
    return pickle.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the socket closed")
        got += k
    return buf


def serve(sock: socket.socket, path: str, synchronous: Any) -> int:
    """Open the store and run batches (module docstring); the exit status."""
    try:
        store = Store(path, synchronous=synchronous)
    except BaseException as e:
        sock.sendall(frame(("error", portable(e))))
        return 1
    sock.sendall(frame(("ready", None)))
    closing = False
    try:
        while not closing:
            try:
                message = receive(sock)
            except (EOFError, OSError):
                return 0  # the parent is gone
            if message == CLOSE:
                closing = True
                continue
            calls, grouped = message
            answer = [(ok, value if ok else portable(value))
                      for ok, value in run_batch(store, calls, grouped)]
            try:
                reply = frame(answer)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                reply = frame([(False, StoreError(f"a result could not be sent back: {e}"))]
                              * len(answer))
            try:
                sock.sendall(reply)
            except OSError:
                return 0  # the parent is gone
    finally:
        store.close()
    sock.sendall(frame("closed"))
    return 0


def main() -> int:
    fd, path, synchronous = sys.argv[1:4]
    return serve(socket.socket(fileno=int(fd)), path, synchronous)


if __name__ == "__main__":
    sys.exit(main())
