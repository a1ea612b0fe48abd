"""Builders for store tests: seeded random trajectories, plans, a settable clock."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from treadle.store import PlannedTrajectory
from treadle.store.schema import SCHEMA_VERSION
from treadle.types import (
    FailureStage,
    GroupKey,
    Timings,
    TokenSegment,
    ToolCall,
    Trajectory,
    TrajectoryStatus,
    Turn,
)


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def newer_schema_file(path: Path) -> Path:
    """An SQLite file at `path` whose schema version is newer than this treadle's."""
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    return path


def plan(n_groups: int, n: int, job: str = "j") -> list[PlannedTrajectory]:
    """`n_groups` groups of `n`, ids `{job}-g{g}-r{r}`."""
    return [PlannedTrajectory(f"{job}-g{g}-r{r}", f"{job}-g{g}", f"task-{g}", r)
            for g in range(n_groups) for r in range(n)]


def random_segment(rng: random.Random, length: int) -> TokenSegment:
    mask = [rng.randint(0, 1) for _ in range(length)]
    return TokenSegment(
        prompt_ids=[rng.randrange(200_000) for _ in range(rng.randint(1, 40))],
        response_ids=[rng.randrange(200_000) for _ in range(length)],
        loss_mask=mask,
        # Awkward floats (not short decimals) so that an inexact round trip shows.
        logprobs=[-rng.random() * 20 / 3 if m else 0.0 for m in mask],
        policy_versions=[rng.randint(0, 5) for _ in range(length)],
    )


def random_trajectory(rng: random.Random, p: PlannedTrajectory,
                      status: TrajectoryStatus | None = None) -> Trajectory:
    """A terminal trajectory for plan entry `p` with every field filled."""
    status = status or rng.choice([s for s in TrajectoryStatus if s.terminal])
    n_turns = rng.randint(1, 4)
    turns = []
    for i in range(n_turns):
        call = None
        if i < n_turns - 1:
            call = ToolCall(name=rng.choice(["python", "bash"]),
                            arguments={"code": f"print({rng.random()})", "n": i,
                                       "nested": {"ok": True, "xs": [1, 2.5, None]}},
                            latency_s=rng.random(), output_tokens=rng.randint(0, 50),
                            error=rng.choice([None, "exit code 1 — ünïcode"]))
        turns.append(Turn(index=i, output_tokens=rng.randint(1, 100),
                          engine_id=rng.choice([None, "e0", "e1"]), tool_call=call,
                          queued_s=rng.random(), generating_s=rng.random() * 3,
                          policy_version=rng.randint(0, 3)))
    error = status is TrajectoryStatus.ERROR
    return Trajectory(
        trajectory_id=p.trajectory_id,
        key=GroupKey(p.group_id, p.repetition),
        prompt_tokens=rng.randint(1, 500),
        turns=turns,
        segments=[random_segment(rng, rng.randint(0, 60)) for _ in range(rng.randint(0, 3))],
        status=status,
        reason=None if status is TrajectoryStatus.COMPLETED else f"{status.value} reason",
        failure_stage=rng.choice(list(FailureStage)) if error else None,
        reward=None if error else rng.choice([None, 0.0, 1.0, rng.random() / 7]),
        metrics={} if error else {"exact_match": rng.choice([0.0, 1.0]), "len": 1 / 3},
        attempt=rng.randint(0, 2),
        timings=Timings(llm_s=rng.random(), tool_s=rng.random(), queue_s=rng.random(),
                        started_at=rng.choice([None, 1e9 + rng.random()]),
                        finished_at=rng.choice([None, 2e9 + rng.random()])),
        task_id=p.task_id,
    )
