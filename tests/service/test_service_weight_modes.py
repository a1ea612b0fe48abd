"""`POST /v1/weights/update` and `/pause` read their modes: "wait" is the older name
of "drain"; an update without a timeout gets the service's bound."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from treadle.service.schemas import PauseRequest, WeightUpdateRequest


def test_wait_is_read_as_drain_and_keep_is_a_mode() -> None:
    assert PauseRequest(mode="wait").mode == "drain"  # type: ignore[arg-type]
    update = WeightUpdateRequest(policy_version=1, weights_path="/w", mode="wait")  # type: ignore[arg-type]
    assert update.mode == "drain" and update.timeout_s == 600.0
    assert WeightUpdateRequest(policy_version=1, weights_path="/w", mode="keep").mode == "keep"
    with pytest.raises(ValidationError):
        PauseRequest(mode="keep")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        WeightUpdateRequest(policy_version=1, weights_path="/w", timeout_s=0)
