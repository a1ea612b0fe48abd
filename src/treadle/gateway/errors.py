"""The gateway's errors: each carries the HTTP status, OpenAI error type, code and
parameter it is answered with (``{"error": {"message", "type", "param", "code"}}``,
the shape OpenAI's SDKs parse)."""

from __future__ import annotations

from treadle.errors import InputError, TreadleError


class GatewayError(TreadleError):
    """A call the gateway answers with an OpenAI-shaped error."""

    status = 400
    kind = "invalid_request_error"  # OpenAI's error "type"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault, OpenAI-style ("messages[2].role")


class InvalidRequest(GatewayError, InputError):
    """A request the gateway cannot honour as written: a field it does not know or a
    value it would serve differently (n > 1, audio, top_logprobs); names the field."""

    code = "invalid_request"


class UnknownSession(GatewayError):
    """No session by that id (never created, or forgotten after its end)."""

    status = 404
    code = "session_not_found"


class SessionBusy(GatewayError):
    """A call came while another call of the same session is running."""

    status = 409
    code = "session_busy"


class UnknownTool(GatewayError):
    """The session's served episode has no tool by that name, or it is served none."""

    status = 404
    code = "tool_not_found"


class NoReplyYet(GatewayError):
    """A tool call before the session's first reply: a call belongs to a reply."""

    status = 409
    code = "no_reply_yet"


class SessionEnded(GatewayError):
    """The session has ended (by its owner, its idle timeout, or a failure)."""

    code = "session_ended"


class SessionLimit(GatewayError):
    """The session reached one of its limits (`param` names it)."""

    code = "session_limit"


class ContextTooLong(GatewayError):
    """The context and the reply do not fit the engine's window."""

    code = "context_length_exceeded"


class GatewayInternalError(GatewayError):
    """treadle failed the call (a bug, logged): the session ended with status error,
    stage runtime. The only 5xx of the gateway's own."""

    status = 500
    kind = "server_error"
    code = "internal_error"


class GatewayEngineError(GatewayError):
    """The engines failed the call; the session ended with status error (stage engine)."""

    status = 503
    kind = "server_error"
    code = "engine_error"


__all__ = ["ContextTooLong", "GatewayEngineError", "GatewayError", "GatewayInternalError",
           "InvalidRequest", "NoReplyYet",
           "SessionBusy", "SessionEnded", "SessionLimit", "UnknownSession", "UnknownTool"]
