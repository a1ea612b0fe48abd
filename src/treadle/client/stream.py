"""Resuming: retry policy, consecutive failures, and the NDJSON stream's cursor.

`StreamCursor` turns a job's stream bytes into deliveries and holds the resume
cursor: only complete lines are read (a line cut by a dropped connection goes with
it), a sequence number at or below the cursor is skipped and one past cursor + 1
is a gap (`ServiceProtocolError`), so across reconnections nothing is delivered
twice and nothing is skipped. `Retries` counts consecutive failures against a
`RetryPolicy`, logs each retry (a warning on ``treadle.client.stream``) and raises
`ServiceUnavailable` when they run out. No I/O here: the sync and async clients
share it.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import httpx

from treadle.client.errors import ServiceError, ServiceProtocolError, ServiceUnavailable
from treadle.client.wire import Call, Delivered, JobState, decode_trajectory, service_error

log = logging.getLogger(__name__)

# Answers worth another try: the service's own "busy" (503, sent before it reads the
# request, so safe for every method) and a proxy's 502/504 (safe for GET only).
BUSY = 503
GATEWAY = frozenset({502, 504})


_MAX_PATIENCE_S = 3600.0  # whatever a service announces, a client gives up after this


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently a call or a stream is tried again.

    Patience is time, not a count: the client gives up with ServiceUnavailable only
    once `attempts` tries in a row have failed (the first included) *and* its waits
    since the last progress add up to `patience_s` — or to the restart time the
    service announced (the `x-treadle-restart-s` header of its answers,
    `RestartWatch`), whichever is longer. The default rides out five minutes of a
    service being down (a restart of a service that starts its own engines, a
    proxy resetting connections meanwhile). The wait after failure n is
    ``backoff_s * 2**(n-1)``, at most `max_backoff_s` (a 503's Retry-After, if
    longer, within that bound). A policy that does not wait (`backoff_s` 0) gives up
    after `attempts`. No jitter: the same failures give the same waits.
    """

    attempts: int = 10
    backoff_s: float = 0.25
    max_backoff_s: float = 5.0
    # prime-rl waits 300 s on its admin calls: a trainer must not die of a restart.
    patience_s: float = 300.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s \
                or not 0 <= self.patience_s <= _MAX_PATIENCE_S:
            raise ValueError("RetryPolicy needs attempts >= 1, 0 <= backoff_s <= "
                             f"max_backoff_s and 0 <= patience_s <= {_MAX_PATIENCE_S:.0f}")

    def delay(self, failures: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait after `failures` consecutive failures (>= 1)."""
        # The exponent is capped: past it the wait is max_backoff_s anyway, and 2**1024
        # would overflow.
        wait = min(self.max_backoff_s, self.backoff_s * 2.0 ** min(failures - 1, 60))
        if retry_after_s is not None and math.isfinite(retry_after_s):
            wait = max(wait, min(self.max_backoff_s, retry_after_s))
        return wait


RESTART_HEADER = "x-treadle-restart-s"


class RestartWatch:
    """The restart time the service announced in its latest answer (seconds; 0 until
    it has answered once). `note` is an httpx response hook."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def note(self, response: httpx.Response) -> None:
        try:
            value = float(response.headers.get(RESTART_HEADER, ""))
        except ValueError:
            return
        if math.isfinite(value) and value >= 0:
            self.seconds = min(value, _MAX_PATIENCE_S)


class Retries:
    """Consecutive failures of one call or stream; `progress` starts the count again.
    It gives up once `policy.attempts` tries in a row failed and their waits add up
    to the policy's patience or the restart time the service announced (`watch`,
    read at every failure: a stream opened before the first answer learns it from
    that answer), whichever is longer; at once after `attempts` when the policy
    does not wait at all."""

    def __init__(self, policy: RetryPolicy, what: str, watch: RestartWatch | None = None
                 ) -> None:
        self.policy = policy
        self.what = what  # named in the error
        self.watch = watch  # the service's announced restart time; None: not waited for
        self.failures = 0
        self.waited = 0.0  # seconds waited since the last progress

    def progress(self) -> None:
        self.failures = 0
        self.waited = 0.0

    def failed(self, cause: BaseException | ServiceError,
               retry_after_s: float | None = None) -> float:
        """Count a failure; the seconds to wait before the next try, or raise
        ServiceUnavailable (from `cause`) if no try is left."""
        self.failures += 1
        patience = max(self.policy.patience_s,
                       self.watch.seconds if self.watch is not None else 0.0)
        if self.failures >= self.policy.attempts and (
                self.waited >= patience or self.policy.backoff_s <= 0):
            raise ServiceUnavailable(
                f"{self.what}: gave up after {self.failures} attempt"
                f"{'s' * (self.failures != 1)}: {describe(cause)}",
                attempts=self.failures, cause=cause) from cause
        wait = self.policy.delay(self.failures, retry_after_s)
        self.waited += wait
        log.warning("%s: %s; retrying in %.2f s (attempt %d of %d)", self.what,
                    describe(cause), wait, self.failures + 1,
                    max(self.policy.attempts, self.failures + 1))
        return wait


def describe(cause: BaseException) -> str:
    text = str(cause)
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "")
    try:
        return float(value)
    except ValueError:
        return None


def retriable(error: httpx.TransportError, method: str) -> bool:
    """A transport failure worth another try: nothing was sent (connecting failed), or
    the call is a GET, which may be sent twice."""
    return method == "GET" or isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)


def retriable_status(status: int, method: str) -> bool:
    return status == BUSY or (status in GATEWAY and method == "GET")


def sent_and_lost(call: Call[Any], error: httpx.TransportError) -> ServiceUnavailable:
    """A POST whose connection failed after it was sent: not repeated."""
    return ServiceUnavailable(
        f"{call.what}: the connection failed after the request was sent, so it may have "
        f"been carried out; not repeated ({describe(error)})", attempts=1, cause=error)


def refused(response: httpx.Response, path: str) -> ServiceError:
    """A stream's error answer, to try again; raised at once unless it is worth it."""
    error = service_error(response, "GET", path)
    if not retriable_status(response.status_code, "GET"):
        raise error
    return error


def cut_line(cursor: StreamCursor) -> ServiceProtocolError:
    return ServiceProtocolError(f"the stream of job {cursor.job_id!r} ended inside a line "
                                f"after seq {cursor.after}")


def ended_early(cursor: StreamCursor, job: JobState) -> ServiceProtocolError | None:
    """None if a followed stream that ended cleanly is over (the job has ended and
    everything was handed out); else why it is not, a failure to resume from."""
    if job.terminal and job.delivered <= cursor.after:
        return None
    return ServiceProtocolError(f"the stream ended at seq {cursor.after} while job "
                                f"{job.job_id!r} is {job.status} with {job.delivered} "
                                f"delivered")


def stream_params(cursor: StreamCursor, follow: bool) -> dict[str, str | int]:
    return {"after": cursor.after, "follow": "true" if follow else "false"}


class StreamCursor:
    """Deliveries of one job's stream, each once, in order; see the module docstring."""

    def __init__(self, job_id: str, after: int = 0) -> None:
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        self.job_id = job_id
        self.after = after  # the last sequence number handed out: the resume cursor
        self._partial = b""

    def reconnect(self) -> None:
        """A new connection: a line cut by the old one is gone with it."""
        self._partial = b""

    @property
    def cut(self) -> bool:
        """The stream ended inside a line (a dropped connection, not a clean end)."""
        return bool(self._partial.strip())

    def feed(self, chunk: bytes) -> list[Delivered]:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            if line.strip():
                delivered = self._line(line)
                if delivered is not None:
                    out.append(delivered)
        return out

    def _line(self, line: bytes) -> Delivered | None:
        where = f"job {self.job_id!r} stream after seq {self.after}"
        try:
            value = json.loads(line)
        except ValueError:
            raise ServiceProtocolError(f"{where}: a line is not JSON: {line[:200]!r}") from None
        if not isinstance(value, dict) or type(value.get("seq")) is not int \
                or "trajectory" not in value:
            raise ServiceProtocolError(f"{where}: a line is not {{seq, trajectory}}: "
                                       f"{line[:200]!r}")
        seq = value["seq"]
        if seq <= self.after:
            return None  # already handed out (a stream resumed from an older cursor)
        if seq != self.after + 1:
            raise ServiceProtocolError(f"{where}: the next line is seq {seq}; "
                                       f"{self.after + 1}..{seq - 1} are missing")
        trajectory = decode_trajectory(value["trajectory"], f"{where}, seq {seq}")
        self.after = seq
        return Delivered(seq, trajectory)


__all__ = ["Retries", "RetryPolicy", "StreamCursor"]
