"""The service's own errors (the rest of the tree is in `treadle.errors`)."""

from __future__ import annotations

from treadle.errors import InputError, ServiceBusy


class RequestRefused(InputError):
    """A job the service cannot run (unknown suite, bad task record, no tokenizer, a
    file outside the allowed roots): the message starts with the field's dotted path,
    then ": " and why; the API answers 422 naming that field."""


__all__ = ["RequestRefused", "ServiceBusy"]
