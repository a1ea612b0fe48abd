"""The client branch of treadle's exception tree (see `treadle.errors`).

    TreadleError
    └── ClientError                  anything treadle.client raises on purpose
        └── ConversionError          the trajectories cannot be expressed in the
                                     trainer's format (also a ValueError): one not
                                     terminal or not scored, one without tokens,
                                     several segments where the format has one row
                                     per sample, a row the format cannot drop

An infrastructure failure among the trajectories is not an error: converters drop
or mask it (see treadle.client.samples), never turn it into a reward of 0.
"""

from __future__ import annotations

from treadle.errors import TreadleError


class ClientError(TreadleError):
    """Root of the client package's exceptions."""


class ConversionError(ClientError, ValueError):
    """The trajectories do not fit the trainer's format; the message says which and why."""
