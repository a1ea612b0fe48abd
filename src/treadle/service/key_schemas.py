"""The wire schemas of trainer keys (`POST /v1/keys`, `GET /v1/keys`): pydantic, strict
as every request of `service.schemas`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from treadle.service.schemas import TRAINER_RUN


class KeyRequest(BaseModel):
    """`POST /v1/keys`: a trainer key for one trainer run."""

    model_config = ConfigDict(extra="forbid", strict=True)

    trainer_run: str = Field(min_length=1, max_length=128, pattern=TRAINER_RUN,
                             description="the run the key speaks for: it sees and changes "
                                         "that run's jobs, sessions and weights only")


class KeyView(BaseModel):
    """A trainer key, listed: never the key itself."""

    key_id: str  # its public name (DELETE /v1/keys/{key_id})
    trainer_run: str
    source: str  # api (POST /v1/keys, kept in the store) | file (treadle serve --keys)
    created_at: float | None  # None for a keys file's


class KeyCreated(KeyView):
    """`POST /v1/keys`'s answer: the only time the key is shown."""

    key: str
