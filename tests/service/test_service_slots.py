"""A trajectory's slot is freed however its task ends, even when it is cancelled
before it has taken a single step (a cancel right after the dispatch that started
it): otherwise each such cancel lost one of `max_live` for good."""

from __future__ import annotations

import asyncio

from runtime.runtime_helpers import FakeEngine
from treadle.service.schemas import JobRequest
from treadle.service.state import ServiceConfig, build_service

LINE = {"id": "t", "group": "g", "prompt_tokens": 8,
        "turns": [{"output_tokens": 4, "tool_latency_s": 0.0, "tool_output_tokens": 0}]}


def test_tasks_cancelled_before_their_first_step_free_their_slots() -> None:
    async def main() -> None:
        service = build_service(ServiceConfig(db=":memory:", policy="verl", max_live=4))
        await service.start()
        service.runtime.register_engine(FakeEngine("a"))
        rollouts = service.rollouts
        trace = [{**LINE, "id": f"t{i}"} for i in range(6)]
        await rollouts.submit(JobRequest.model_validate({"tasks": {"trace": trace}}))
        assert rollouts.live == 4  # dispatched; not one has run a step yet
        await rollouts.close()  # cancels them all before their first step
        assert rollouts.live == 0
        await service.runtime.close()
        await service.store.aclose()

    asyncio.run(asyncio.wait_for(main(), 60))
