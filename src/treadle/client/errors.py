"""The client branch of treadle's exception tree (see `treadle.errors`).

    TreadleError
    └── ClientError                  anything treadle.client raises on purpose
        ├── ConversionError          the trajectories cannot be expressed in the
        │                            trainer's format (also a ValueError): one not
        │                            terminal or not scored, one without tokens,
        │                            several segments where the format has one row
        │                            per sample, a row the format cannot drop
        ├── GroupError               delivered trajectories do not fit the groups the
        │                            caller declared (more members than its size;
        │                            also a ValueError)
        ├── ServiceError             the service answered with an error status:
        │                            `status` (401 bad key, 403 a key's scope does
        │                            not cover the route, 404 unknown job or engine
        │                            — or another trainer run's —, 409 job id taken,
        │                            413 body too large, 422 bad request, 503 busy)
        │                            and its `detail`
        ├── ServiceUnavailable       the service could not be reached, or a stream
        │                            could not be resumed, within the retries;
        │                            `attempts` and the last `cause`
        └── ServiceProtocolError     a reply that breaks the API's contract: not
                                     JSON, a malformed trajectory record (chained to
                                     the RecordError), a gap in sequence numbers

An infrastructure failure among the trajectories is not an error: converters drop
or mask it (see treadle.client.samples), never turn it into a reward of 0, and the
group iterator flags it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from treadle.errors import TreadleError


class ClientError(TreadleError):
    """Root of the client package's exceptions."""


class ConversionError(ClientError, ValueError):
    """The trajectories do not fit the trainer's format; the message says which and why."""


class GroupError(ClientError, ValueError):
    """Delivered trajectories do not form the groups the caller declared."""


class ServiceError(ClientError):
    """An error answer from the service: `status` and the answer's `detail`.

    The message is one line: ``POST /v1/jobs: 422: body.tasks.count: Input should be
    greater than 0``. For a 422, `fields` lists ``(location, message)`` per bad field.
    """

    def __init__(self, method: str, path: str, status: int, detail: Any) -> None:
        self.method = method  # the request's method
        self.path = path  # the request's path, without the query
        self.status = status  # the HTTP status of the answer
        self.detail = detail  # the answer's "detail": a string, or a list of field errors
        super().__init__(f"{method} {path}: {status}: {describe_detail(detail)}")

    @property
    def fields(self) -> list[tuple[str, str]]:
        """(dotted location, message) per bad field of a 422; [] otherwise."""
        if not isinstance(self.detail, list):
            return []
        return [(_dotted(d), str(d.get("msg", ""))) for d in self.detail if isinstance(d, dict)]


class ServiceUnavailable(ClientError):
    """The service did not answer (connection refused or dropped, 5xx, 503 busy)
    within `attempts` tries; `cause` is the last failure."""

    def __init__(self, message: str, *, attempts: int, cause: BaseException | ServiceError
                 | None) -> None:
        self.attempts = attempts  # tries made, the first included
        self.cause = cause  # the last failure (a transport error or a ServiceError)
        super().__init__(message)


class ServiceProtocolError(ClientError):
    """A reply the API does not allow; the message says what and where."""


def _dotted(error: Mapping[str, Any]) -> str:
    """A 422 error's ``loc`` as a dotted path (``body.tasks.0.id``)."""
    return ".".join(str(p) for p in error.get("loc", []))


def describe_detail(detail: Any) -> str:
    """A 422's field list as ``loc: msg; loc: msg``, anything else as its text."""
    if isinstance(detail, list):
        parts = []
        for d in detail:
            if isinstance(d, dict):
                loc = _dotted(d)
                parts.append(f"{loc}: {d.get('msg', '')}" if loc else str(d.get("msg", "")))
            else:
                parts.append(str(d))
        return "; ".join(parts) or "(no detail)"
    return str(detail) if detail not in (None, "") else "(no detail)"
