"""What the rewards package raises (the `JudgeError` branch of `treadle.errors`)."""

from __future__ import annotations

from treadle.errors import TreadleError


class JudgeError(TreadleError):
    """A judgement that did not come out: the caller retries, then records why."""


class JudgeCallError(JudgeError):
    """A judge call failed: the judge unreachable, an error answer, a malformed reply."""


class VerdictError(JudgeError):
    """The judge's reply holds no verdict on the scale (the message says what)."""
