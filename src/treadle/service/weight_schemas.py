"""The `/v1/weights` routes' bodies: pause, resume, the weight update, the view."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from treadle.service.schemas import MAX_INT64, TRAINER_RUN


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _drain_for_wait(mode: Any) -> Any:
    """"wait", the older name of "drain", read as it."""
    return "drain" if mode == "wait" else mode


class PauseRequest(_Strict):
    """`POST /v1/weights/pause`: hold new engine calls; "drain" the calls in flight
    (wait for them) or "abort" them ("wait": the older name of "drain")."""

    mode: Annotated[Literal["drain", "abort"], BeforeValidator(_drain_for_wait)] = "drain"


class ResumeRequest(_Strict):
    """`POST /v1/weights/resume`: the engines now serve `policy_version`."""

    policy_version: int = Field(ge=0, le=MAX_INT64)
    trainer_run: str | None = Field(default=None, min_length=1, max_length=128,
                                    pattern=TRAINER_RUN,
                                    description="the trainer run whose weights these are")


class WeightUpdateRequest(_Strict):
    """`POST /v1/weights/update`: the whole barrier in one call — pause, every engine
    loads `weights_path` (a directory of safetensors it can read), resume. `mode`:
    what happens to the engine calls in flight (`Runtime.update_weights`): "abort",
    "drain" (the default; "wait" is its older name) or "keep". Past `timeout_s` the
    update fails (504) and the old weights serve."""

    policy_version: int = Field(ge=0, le=MAX_INT64)
    weights_path: str = Field(min_length=1, max_length=4096)
    mode: Annotated[Literal["abort", "drain", "keep"],
                    BeforeValidator(_drain_for_wait)] = "drain"
    timeout_s: float = Field(default=600.0, gt=0, le=86_400,
                             description="seconds the whole update may take")
    trainer_run: str | None = Field(default=None, min_length=1, max_length=128,
                                    pattern=TRAINER_RUN,
                                    description="the trainer run whose weights these are "
                                                "(jobs naming another run are refused)")


class WeightsView(BaseModel):
    policy_version: int  # what the policy's engines serve, stamped on their tokens
    trainer_run: str | None = None  # whose weights those are (None: unnamed, or initial)
    paused: bool
    frozen_policy_version: int | None = None  # the frozen pool's pinned version, if any
