"""Hand-built trajectories for the converter tests."""

from __future__ import annotations

import random

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


def segment(seed: str, prompt: int = 4, response: int = 6) -> TokenSegment:
    """A valid segment: alternating model (mask 1) and observation (mask 0) runs."""
    rng = random.Random(seed)
    mask = [1 if (i // 2) % 2 == 0 else 0 for i in range(response)]
    return TokenSegment(
        prompt_ids=[rng.randrange(1, 1000) for _ in range(prompt)],
        response_ids=[rng.randrange(1, 1000) for _ in range(response)],
        loss_mask=mask,
        logprobs=[-rng.random() if m else 0.0 for m in mask],
        policy_versions=[3] * response)


def traj(tid: str, group: str, rep: int, reward: float | None = 1.0, *,
         status: TrajectoryStatus = TrajectoryStatus.COMPLETED, segments: int = 1,
         metrics: dict[str, float] | None = None) -> Trajectory:
    """A finished trajectory; ERROR ones get a failure stage and no reward."""
    error = status is TrajectoryStatus.ERROR
    return Trajectory(
        trajectory_id=tid, key=GroupKey(group, rep), prompt_tokens=4,
        turns=[Turn(0, 3, tool_call=ToolCall("python", {"code": "1+1"}, 0.2, 2)), Turn(1, 3)],
        segments=[segment(f"{tid}:{i}") for i in range(segments)],
        status=status, reason=None if status is TrajectoryStatus.COMPLETED else status.value,
        failure_stage=FailureStage.TOOL if error else None,
        reward=None if error else reward,
        metrics={} if error else dict(metrics or {"exact_match": reward or 0.0}),
        timings=Timings(llm_s=1.5, tool_s=0.25, queue_s=0.5, started_at=10.0, finished_at=12.5),
        task_id=f"task-{group}")


def error(tid: str, group: str, rep: int, *, with_tokens: bool = True) -> Trajectory:
    t = traj(tid, group, rep, status=TrajectoryStatus.ERROR)
    if not with_tokens:
        t.segments = []
    return t
