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


def varied_segment(rng: random.Random, start_turn: int = 0, start_reason: str = "start", *,
                   frozen: bool = False) -> TokenSegment:
    """A segment whose every value tells tokens apart: distinct ids, model runs (mask 1)
    and observation runs (mask 0) of uneven lengths, awkward logprobs (no short
    decimals) and a policy version that changes inside the response."""
    prompt = rng.sample(range(1000, 60_000), rng.randint(3, 9))
    response = rng.sample(range(60_000, 150_000), rng.randint(7, 19))
    mask = [0 if frozen else 1] * 2 + [0] * 3 + [0 if frozen else rng.randint(0, 1)
                                                 for _ in range(len(response) - 5)]
    switch = rng.randrange(1, len(response))
    return TokenSegment(
        prompt_ids=prompt, response_ids=response, loss_mask=mask,
        logprobs=[-rng.random() * 20 / 3 if m else 0.0 for m in mask],
        policy_versions=[5] * switch + [6] * (len(response) - switch),
        start_turn=start_turn, start_reason=start_reason)


def varied(tid: str, group: str, rep: int, reward: float | None, *, segments: int = 1,
           status: TrajectoryStatus = TrajectoryStatus.COMPLETED, parent: str | None = None,
           trainable: bool = True) -> Trajectory:
    """A finished trajectory of `varied_segment`s (seeded by its id); a frozen one has
    mask 0 throughout, an ERROR one a failure stage and no reward."""
    rng = random.Random(tid)
    reasons = ["start", "messages_edited", "system_changed", "reply_edited"]
    error = status is TrajectoryStatus.ERROR
    return Trajectory(
        trajectory_id=tid, key=GroupKey(group, rep), prompt_tokens=4,
        turns=[Turn(i, 2, policy_version=5) for i in range(segments)],
        segments=[varied_segment(rng, i, reasons[i], frozen=not trainable)
                  for i in range(segments)],
        status=status, reason=None if status is TrajectoryStatus.COMPLETED else status.value,
        failure_stage=FailureStage.ENGINE if error else None,
        reward=None if error else reward, metrics={} if error else {"exact_match": 1.0},
        timings=Timings(llm_s=1.0, tool_s=0.5, started_at=1.0, finished_at=3.0),
        task_id=f"task-{group}", parent_id=parent, trainable=trainable)


def varied_batch() -> list[Trajectory]:
    """Two groups: multi-segment members, an infrastructure failure, an abort, and a
    trainable and a frozen sub-agent (mask 0 throughout) each in a group of its own."""
    return [
        varied("j/a/0", "j/a", 0, 0.75, segments=3),
        varied("j/a/1", "j/a", 1, 0.125),
        varied("j/a/2", "j/a", 2, None, segments=2, status=TrajectoryStatus.ERROR),
        varied("j/a/3", "j/a", 3, 1.0, segments=2, status=TrajectoryStatus.TRUNCATED),
        varied("j/a/0/sub/0", "j/a/0/sub", 0, 0.5, parent="j/a/0"),
        varied("j/a/0/sub/1", "j/a/0/sub", 1, 0.25, segments=2, parent="j/a/0"),
        varied("j/a/1/sub/0", "j/a/1/sub", 0, None, segments=2, parent="j/a/1",
               trainable=False),
        varied("j/b/0", "j/b", 0, 0.0, status=TrajectoryStatus.MAX_TURNS),
        varied("j/b/1", "j/b", 1, None, status=TrajectoryStatus.ABORTED),
        varied("j/b/2", "j/b", 2, 0.875, segments=2),
    ]


def trains(t: Trajectory) -> bool:
    """Whether `t` is training data, as docs/client.md states the rule: not a frozen
    sub-agent, not an infrastructure failure, not aborted."""
    return t.trainable and t.status not in (TrajectoryStatus.ERROR, TrajectoryStatus.ABORTED)
