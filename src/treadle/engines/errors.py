"""The engines branch of treadle's exception tree (see `treadle.errors`).

    TreadleError
    └── EngineError                  anything treadle.engines raises on purpose
        ├── EngineUnavailable        the engine cannot be reached, refused the
        │                            connection or failed (5xx); another engine or a
        │                            later retry may succeed
        │   ├── EngineStartError     an engine process could not be started (the
        │   │                        message has the tail of its log)
        │   ├── NoEngineAvailable    the runtime has no engine left to run a turn on
        │   └── EngineModelMissing   the engine answers, but does not serve the model
        │                            its client names (404): it is of no use to any
        │                            turn and leaves the pool
        ├── EngineTimeout            the request ran past its `timeout_s`
        ├── EngineProtocolError      the engine answered something this client cannot
        │                            read; the message names the field
        └── EngineRequestError       the engine rejected the request as invalid (4xx):
                                     a caller bug, also a ValueError

An aborted request is not an error: `generate` returns `finish_reason="abort"` with
the tokens so far. Like the sandbox and envs trees, these mean the infrastructure
failed, which a trainer must tell apart from the model's output being bad.

Their messages name the engine by its address (for the logs). An engine's address
is internal to the service: `public_text` is what an answer to a client (a harness,
an API caller) may carry of such a message, every address of an engine this
process has made a client for (`remember_address`) replaced by ``<engine>``.
"""

from __future__ import annotations

import re
import threading
from urllib.parse import urlsplit

from treadle.errors import TreadleError

ENGINE_PLACEHOLDER = "<engine>"
# Every engine address this process has made a client for, each as its URL and as
# host:port (a failed connect says that): an error may name either. Bounded by the
# engines a service ever knew (a refused registration's included); never shrinks, as
# their errors may outlive them. A bare host is not kept: "http://0" must not hide
# every 0 of a message.
_ADDRESSES: dict[str, re.Pattern[str]] = {}
_LOCK = threading.Lock()  # clients are made in the service's and in tests' threads


def remember_address(base_url: str) -> None:
    """Note `base_url` as an engine's address, for `public_text` to hide."""
    try:
        parts = urlsplit(base_url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:  # not a URL a client could reach: nothing to hide
        return
    if not parts.hostname or port is None:
        return
    netloc = parts.netloc.rpartition("@")[2]
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    forms = {base_url.rstrip("/"), f"{parts.scheme}://{netloc}", f"{host}:{port}"}
    with _LOCK:
        for form in forms - _ADDRESSES.keys():
            # Whole: not inside a longer name, number or address (a port after it).
            _ADDRESSES[form] = re.compile(rf"(?<![\w.:@-]){re.escape(form)}(?![\w.-]|:\d)")


def public_text(text: str) -> str:
    """`text` with every engine address in it (`remember_address`) replaced by
    ``<engine>``: what an error body may say. The longest forms are replaced first,
    so a URL goes whole, not host:port inside it."""
    with _LOCK:
        patterns = [_ADDRESSES[f] for f in sorted(_ADDRESSES, key=len, reverse=True)]
    for pattern in patterns:
        text = pattern.sub(ENGINE_PLACEHOLDER, text)
    return text


class EngineError(TreadleError):
    """Root of the engines package's exceptions."""


class EngineUnavailable(EngineError):
    """The engine is unreachable or failed; retrying elsewhere or later may help."""


class EngineStartError(EngineUnavailable):
    """An engine process did not come up; the message carries the tail of its log."""


class NoEngineAvailable(EngineUnavailable):
    """No engine is live (all failed or removed, none starting) to run a turn on."""


class EngineModelMissing(EngineUnavailable):
    """The engine does not serve the model its client asks for (vLLM's 404)."""


class EngineTimeout(EngineError):
    """A request did not finish within its `timeout_s`."""


class EngineProtocolError(EngineError):
    """A reply is malformed or unexpected; the message names the field."""


class EngineRequestError(EngineError, ValueError):
    """The engine rejected the request (HTTP 4xx); the message carries the engine's reason."""
