"""Pre-warming: the images of the trajectories that start next are opened while the
ones before them run (`SuitePools.prepare`, called by the job runner's dispatch for
the next `PREWARM_AHEAD`), each image once, a failure left to the trajectory."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.agent_helpers import build_tokenizer
from runtime.runtime_helpers import FakeEngine
from treadle.envs.base import RewardResult, Suite
from treadle.envs.registry import get_suite
from treadle.runtime.suite_pools import SuitePools
from treadle.sandbox import LocalBackend
from treadle.sandbox.pool import PoolSettings
from treadle.service.jobs import PREWARM_AHEAD
from treadle.service.schemas import JobRequest
from treadle.service.state import ServiceConfig, build_service
from treadle.types import Task


class ImageBackend(LocalBackend):
    """A test double of a backend that runs images: `prepare` of an image waits for
    `release` and counts; an image named "broken" fails to open."""

    def __init__(self, work_root: str) -> None:
        super().__init__(work_root=work_root)
        self.prepared: list[str] = []
        self.release = asyncio.Event()

    def with_image(self, image: str | None) -> ImageBackend:
        other = copy.copy(self)
        other.image = image
        return other

    async def prepare(self) -> None:
        assert self.image is not None
        self.prepared.append(self.image)
        await self.release.wait()
        if self.image == "broken":
            raise OSError("no such image")


class ImageSuite(Suite):
    """Tasks whose metadata may name an image (as swe-images' do)."""

    name = "images"

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        raise NotImplementedError

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        raise NotImplementedError

    def sandbox_backend(self, task: Task, backend: Any) -> Any:
        image = task.metadata.get("image")
        return backend if image is None else backend.with_image(image)

    def tools(self, task: Task) -> list[Any]:
        return []

    async def reward(self, ctx: Any, final_message: str | None) -> RewardResult:
        raise NotImplementedError


def _task(tid: str, image: str | None) -> Task:
    return Task(task_id=tid, suite="images", prompt="p",
                metadata={} if image is None else {"image": image})


def test_each_image_is_opened_once_in_the_background_and_a_failure_is_left(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        backend = ImageBackend(str(tmp_path))
        pools = SuitePools(backend, PoolSettings())
        suite = ImageSuite()
        for task in [_task("a", "img-1"), _task("b", "img-1"), _task("c", None),
                     _task("d", "img-2"), _task("e", "broken")]:
            pools.prepare(suite, task)  # returns at once: nothing released yet
        assert backend.prepared == []  # (a copy's list is the same list)
        await asyncio.sleep(0)  # the background tasks start
        assert backend.prepared == ["img-1", "img-2", "broken"]
        backend.release.set()
        await asyncio.gather(*pools._preparing)  # each one's end, the failure's logged
        await pools.close()
        # The pools prepare is for are the ones the trajectories take.
        pool = pools.pool(suite, _task("f", "img-2"))
        assert pool is not None and pool.backend.image == "img-2"

    with caplog.at_level("INFO", logger="treadle.runtime.suite_pools"):
        asyncio.run(asyncio.wait_for(main(), 60))
    assert "pre-warming the sandbox of images broken failed: no such image" in caplog.text


def test_the_job_runner_prepares_the_trajectories_queued_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(SuitePools, "prepare",
                        lambda self, suite, task: asked.append(task.task_id))
    build_tokenizer(tmp_path / "tok")
    tasks = get_suite("math").tasks(PREWARM_AHEAD + 3, seed=5)

    async def main() -> None:
        service = build_service(ServiceConfig(
            db=":memory:", policy="verl", max_live=1, tokenizer=str(tmp_path / "tok"),
            sandbox=LocalBackend(work_root=str(tmp_path))))
        await service.start()
        engine = FakeEngine("a")
        engine.stop()  # the first trajectory's call never ends: the rest stay queued
        service.runtime.register_engine(engine)
        await service.rollouts.submit(JobRequest.model_validate(
            {"tasks": {"suite": "math", "count": len(tasks), "seed": 5}}))
        await service.rollouts.close()
        await service.runtime.close()
        await service.store.aclose()

    asyncio.run(asyncio.wait_for(main(), 60))
    # One trajectory started; the next PREWARM_AHEAD in the queue, in their order.
    assert asked[:PREWARM_AHEAD] == [t.task_id for t in tasks[1:1 + PREWARM_AHEAD]]
