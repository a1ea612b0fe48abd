"""`POST /v1/weights/update` and `/pause` read their modes: "wait" is the older name
of "drain"; an update without a timeout gets the service's bound. A job's
`kv_across_updates` reaches its trajectories' records, a "keep" update runs on the
emulated engines, and one past its timeout is a 504."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from service_helpers import running_service

from treadle.client import RolloutClient, ServiceError, replay_tasks
from treadle.core.cost_model import CostModel
from treadle.engines.emulated import EmulatedEngine
from treadle.engines.emulated_server import serve_in_thread
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.service.weight_schemas import PauseRequest, WeightUpdateRequest
from treadle.types import KVAcrossUpdates


def test_wait_is_read_as_drain_and_keep_is_a_mode() -> None:
    assert PauseRequest(mode="wait").mode == "drain"  # type: ignore[arg-type]
    update = WeightUpdateRequest(policy_version=1, weights_path="/w", mode="wait")  # type: ignore[arg-type]
    assert update.mode == "drain" and update.timeout_s == 600.0
    assert WeightUpdateRequest(policy_version=1, weights_path="/w", mode="keep").mode == "keep"
    with pytest.raises(ValidationError):
        PauseRequest(mode="keep")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        WeightUpdateRequest(policy_version=1, weights_path="/w", timeout_s=0)


@pytest.mark.integration
def test_a_jobs_kv_choice_is_recorded_and_a_keep_update_serves(tmp_path: Path) -> None:
    config = ServiceConfig(db=str(tmp_path / "w.db"), token="t", emulate=1,
                           time_scale=0.005, policy="verl")
    tasks = replay_tasks("math", trajectories=2, seed=1, group_size=2)
    with running_service(config) as url, RolloutClient(url, token="t") as client:
        kept = client.submit({"kv_across_updates": "keep"}, tasks=tasks)
        state = client.update_weights(str(tmp_path), 1, mode="keep", timeout_s=60)
        assert state.policy_version == 1 and not state.paused
        metrics = client.metrics()
        assert 'treadle_weight_update_seconds_count{mode="keep"} 1' in metrics
        assert "treadle_weight_update_timeouts_total 0" in metrics
        plain = client.submit(tasks=tasks)
        records = {job.job_id: [d.trajectory for d in client.trajectories(job.job_id)]
                   for job in (kept, plain)}
    assert {t.kv_across_updates for t in records[kept.job_id]} == {KVAcrossUpdates.KEEP}
    assert {t.kv_across_updates for t in records[plain.job_id]} == {
        KVAcrossUpdates.RECOMPUTE}
    assert {t.policy_span for t in records[plain.job_id]} == {(1, 1)}


@pytest.mark.integration
def test_an_update_past_its_timeout_is_a_504_and_the_old_weights_serve(
        tmp_path: Path) -> None:
    """An engine whose reload takes 30 s and an update bounded at 0.5 s: the service
    answers 504 (saying so) and still serves version 1, paused no longer."""
    model = EmulatedEngine(CostModel.named("qwen3-8b", "h100"), time_scale=1.0, load_s=30.0)
    with serve_in_thread(model, "m-emulated") as engine:
        config = ServiceConfig(db=str(tmp_path / "t.db"), token="t", policy="verl",
                               engines=[EngineRequest(url=engine.url, kind="emulated",
                                                      model=engine.model)])
        with running_service(config) as url, RolloutClient(url, token="t") as client:
            client.pause()
            client.resume(1)
            with pytest.raises(ServiceError) as failed:
                client.update_weights(str(tmp_path), 2, timeout_s=0.5)
            state = client.weights()
            timeouts = client.metrics()
    assert "treadle_weight_update_timeouts_total 1" in timeouts
    assert failed.value.status == 504
    assert "did not finish within 0.5 s" in str(failed.value)
    assert (state.policy_version, state.paused) == (1, False)
