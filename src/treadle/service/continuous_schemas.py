"""The wire schemas of continuous jobs (pydantic): `JobRequest.continuous` and the
take call (`POST /v1/jobs/{id}/take`). Strict like every request (`schemas`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_GROUPS_LIVE = 4096  # groups a continuous job keeps launched and not taken, at most
MAX_TAKE = 1024  # groups one take hands out


class ContinuousParams(BaseModel):
    """A job that runs until cancelled or its budget is spent: its tasks cycled in
    seeded epochs (each epoch the source's tasks in an order drawn from the seed
    and the epoch), GRPO groups launched as the trainer takes finished ones."""

    model_config = ConfigDict(extra="forbid", strict=True)

    in_flight: int = Field(ge=1, le=MAX_GROUPS_LIVE,
                           description="groups launched and not yet taken (running or "
                                       "finished): a step's groups")
    overprovision: float = Field(
        default=0.0, ge=0.0, le=8.0, allow_inf_nan=False,
        description="launch this share more: ceil(in_flight * (1 + overprovision)) groups "
                    "are kept launched and not taken; the trainer takes the first complete, "
                    "the rest carry on to its next take")
    budget: int | None = Field(default=None, ge=1, le=(1 << 63) - 1,
                               description="groups launched in all (a restart is not "
                                           "another); none: until cancelled")
    max_staleness: int | None = Field(
        default=None, ge=0, le=1 << 20,
        description="versions: a trajectory whose oldest sampled token is older than the "
                    "served policy version minus this is never handed out as fresh")
    on_stale: Literal["flag", "restart", "cut"] = Field(
        default="restart",
        description="what a trajectory out of max_staleness gets: handed out flagged stale, "
                    "run again from its prompt (its tokens discarded), or its tokens of "
                    "versions out of the bound made context (loss mask 0; a replay, which "
                    "has no tokens, is restarted)")

    @model_validator(mode="after")
    def _bound_named(self) -> ContinuousParams:
        if self.max_staleness is None and "on_stale" in self.model_fields_set \
                and self.on_stale != "restart":
            raise ValueError("on_stale needs max_staleness")
        return self

    @property
    def live_groups(self) -> int:
        """Groups kept launched and not taken."""
        return min(MAX_GROUPS_LIVE, -(-int(self.in_flight * (1 + self.overprovision)
                                           * 1000) // 1000))


def continuous_refusals(params: ContinuousParams | None, sessions: bool,
                        max_version: bool) -> list[str]:
    """What a `JobRequest` with `continuous` (`params`) may not also ask. A harness
    job may be continuous: treadle starts each run of the harness command, so it can
    stop one and start it again (a stale restart); a sessions job may not, its
    sessions being opened by a harness treadle does not run."""
    if params is None:
        return []
    out = []
    if sessions:
        out.append("a continuous job runs suite or replay tasks: sessions are a harness's")
    if max_version:
        out.append("a continuous job runs across weight updates: no max_policy_version "
                   "(bound it with continuous.max_staleness)")
    return out


class TakeRequest(BaseModel):
    """`POST /v1/jobs/{id}/take`: the next complete groups of a continuous job."""

    model_config = ConfigDict(extra="forbid", strict=True)

    take_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$",
                         description="the caller's id of this call, new for each: the same "
                                     "id again returns the same groups (a retry after a "
                                     "lost answer), another id other groups")
    n: int = Field(default=1, ge=1, le=MAX_TAKE, description="groups wanted")
    wait_s: float = Field(default=10.0, ge=0.0, le=60.0, allow_inf_nan=False,
                          description="wait this long for the first of them; fewer (or "
                                      "none) may come back: call again")


class TakenMember(BaseModel):
    seq: int  # its delivery number on the job's trajectory stream
    trajectory: dict[str, Any]  # its record


class TakenGroupView(BaseModel):
    taken: int  # take number, dense from 1 in the order groups were handed out
    group_id: str
    size: int
    stale: bool  # a member's oldest token was out of the bound (on_stale flag)
    members: list[TakenMember]


class TakeReply(BaseModel):
    groups: list[TakenGroupView]
    taken: int  # groups handed out so far
    ended: bool  # the job has ended and no group is left to take
