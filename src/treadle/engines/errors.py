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
"""

from __future__ import annotations

from treadle.errors import TreadleError


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
