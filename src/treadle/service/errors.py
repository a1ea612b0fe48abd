"""The service's own errors (the rest of the tree is in `treadle.errors`)."""

from __future__ import annotations

from treadle.errors import InputError, ServiceBusy, TreadleError


class RequestRefused(InputError):
    """A job the service cannot run (unknown suite, bad task record, no tokenizer, a
    file outside the allowed roots): the message starts with the field's dotted path,
    then ": " and why; the API answers 422 naming that field."""


class Forbidden(TreadleError):
    """A key whose scope does not cover the request (a trainer key on an admin's
    route, or naming another trainer run; a session key anywhere but its session's
    OpenAI routes): the API's 403. What a key may not even see (another run's job)
    is a 404 instead, so that ids cannot be probed."""


__all__ = ["Forbidden", "RequestRefused", "ServiceBusy"]
