"""The sandbox server's wire format: the JSON models a server reads and answers with.

Requests are strict (nothing unknown accepted: a typo is refused, not ignored);
replies ignore unknown fields, so a newer server's answers still parse. An error
answer is an `ErrorReply` naming one of `WIRE_ERRORS`, which the client
(`treadle.sandbox.remote`) raises again as that exception; the server
(`treadle.sandbox.server`) maps an exception to its name and status with
`wire_error`. Endpoints: docs/sandbox.md.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from treadle.errors import (
    SandboxClosed,
    SandboxError,
    SandboxFileError,
    SandboxFileTooLarge,
    SandboxImageError,
    SandboxPathError,
    SandboxStartError,
    SandboxSupervisorError,
    SandboxUnavailable,
)
from treadle.sandbox.base import ExecResult, Limits

ID_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"  # sandbox and exec ids: url-safe, unguessable


class _Request(BaseModel):  # what a server reads: strict, nothing unknown accepted
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Reply(BaseModel):  # what a client reads: strict, unknown fields (newer servers) ignored
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class LimitsModel(_Request):
    """`Limits` on the wire; `to_limits` applies its checks (ValueError)."""

    cpu_s: int
    memory_mb: int
    address_space_mb: int | None
    max_processes: int
    max_file_mb: int
    workdir_mb: int = Limits().workdir_mb  # defaults: clients from before these fields
    workdir_files: int = Limits().workdir_files
    max_open_files: int
    max_output_bytes: int
    wall_timeout_s: float

    @classmethod
    def from_limits(cls, limits: Limits) -> LimitsModel:
        return cls(**{name: getattr(limits, name) for name in Limits.__slots__})

    def to_limits(self) -> Limits:
        return Limits(**self.model_dump())


class CreateRequest(_Request):
    id: str = Field(pattern=ID_PATTERN)  # chosen by the client, so that it can undo a start
    limits: LimitsModel
    # An environment image as the server's host names it (its --images root); None:
    # the server backend's own view of the host.
    image: str | None = Field(default=None, min_length=1, max_length=4096)


class Created(_Reply):
    id: str
    workdir: str
    idle_ttl_s: float  # the server reaps the sandbox after this long without a request
    max_body_bytes: int  # the server's request size limit


class ExecRequest(_Request):
    exec_id: str = Field(pattern=ID_PATTERN)  # names the exec for an interrupt
    argv: list[str] = Field(min_length=1, max_length=4096)  # ARG_MAX bounds the rest
    timeout_s: float = Field(gt=0)
    stdin_b64: str | None = None
    env: dict[str, str] = Field(default_factory=dict)


class ExecReply(_Reply):
    """`ExecResult` on the wire."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed: str | None
    duration_s: float
    truncated: bool

    @classmethod
    def from_result(cls, result: ExecResult) -> ExecReply:
        return cls(**{name: getattr(result, name) for name in ExecResult.__slots__})

    def to_result(self) -> ExecResult:
        return ExecResult(**self.model_dump())


class Health(_Reply):
    status: str  # "ok" while the server accepts sandboxes; "draining", "closing"
    backend: str
    live: int
    max_live: int


class SandboxList(_Reply):
    ids: list[str]


class ErrorBody(_Reply):
    type: str  # an exception name; see WIRE_ERRORS
    message: str


class ErrorReply(_Reply):
    error: ErrorBody


# Exceptions a server may name, with their HTTP status, and a client re-raises;
# most specific first (SandboxPathError is also a ValueError).
WIRE_ERRORS: tuple[tuple[type[Exception], int], ...] = (
    (SandboxImageError, 503), (SandboxUnavailable, 503), (SandboxStartError, 503),
    (SandboxClosed, 409),
    (SandboxPathError, 400), (SandboxFileTooLarge, 413), (SandboxFileError, 422),
    (SandboxSupervisorError, 502), (SandboxError, 500), (ValueError, 400),
)
def wire_error(exc: BaseException) -> tuple[str, int]:
    """The name and HTTP status a server sends for `exc` (its nearest WIRE_ERRORS class)."""
    return next(((cls.__name__, status) for cls, status in WIRE_ERRORS if isinstance(exc, cls)),
                ("InternalError", 500))
