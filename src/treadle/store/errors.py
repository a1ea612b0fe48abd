"""The store branch of treadle's exception tree (see `treadle.errors`).

    TreadleError
    └── StoreError                   anything treadle.store raises on purpose
        ├── RecordError              a trajectory record is malformed (also a
        │                            ValueError); the message names the field, e.g.
        │                            ``segments[1].logprobs[7]``
        ├── NotFound                 the job or trajectory id is not in the store
        │                            (also a LookupError)
        ├── StoreConflict            the call contradicts what is stored: a job id
        │                            already taken, a result whose group, repetition
        │                            or task differs from the planned trajectory, a
        │                            non-terminal status passed as a result
        ├── SchemaError              the database file was written by a newer treadle
        │                            (its schema version is unknown here), or is not
        │                            a treadle store
        └── StoreProcessLost         the store's own process (`StoreProcess`) exited
                                     with a batch under way: whether it committed is
                                     unknown

A duplicate result for a trajectory already finished is not an error: finishing is
idempotent (`Store.finish` reports it as a duplicate), because after a crash the
same trajectory may legitimately be reported twice.
"""

from __future__ import annotations

from treadle.errors import TreadleError


class StoreError(TreadleError):
    """Root of the store package's exceptions."""


class RecordError(StoreError, ValueError):
    """A trajectory record is malformed; the message names the field and why."""


class NotFound(StoreError, LookupError):
    """No job (or trajectory of that job) with this id is stored."""


class StoreConflict(StoreError):
    """The request contradicts the stored state; the message says how."""


class SchemaError(StoreError):
    """The database's schema version is newer than this treadle, or it is no treadle store."""


class StoreProcessLost(StoreError):
    """The store's own process exited with a batch under way (`treadle.store.process`)."""
