"""Builders for record version 2 tests: a parent with edited segments and children,
and its frozen sub-agents."""

from __future__ import annotations

import copy
from typing import Any

from treadle.types import (
    GroupKey,
    Timings,
    TokenSegment,
    ToolCall,
    Trajectory,
    TrajectoryStatus,
    Turn,
)

METADATA: dict[str, Any] = {
    "harness": "claude-code", "depth": 2, "ratio": 1 / 3, "big": 2**70, "neg": -5,
    "ok": True, "none": None, "ünï": "cödé", "nested": {"xs": [1, 2.5, None, {"y": []}]}}


def parent() -> Trajectory:
    """A trainable parent with three segments (an edited context) and two children."""
    segs = [TokenSegment([1, 2], [3, 4, 5], [1, 0, 1], [-0.5, 0.0, -0.25], [2, 2, 3]),
            TokenSegment([1, 9], [6, 7], [1, 1], [-1 / 3, -2 / 7], [3, 3],
                         start_turn=1, start_reason="messages_edited"),
            TokenSegment([8], [10], [0], [0.0], [3], start_turn=2,
                         start_reason="system_changed")]
    return Trajectory(
        "job/g0/r0", GroupKey("job/g0", 0), prompt_tokens=2,
        turns=[Turn(0, 2, "e0", ToolCall("task", {"prompt": "look"}, 0.5, 1), 0.1, 0.2, 3),
               Turn(1, 2, "e0"), Turn(2, 1, "e1")],
        segments=segs, status=TrajectoryStatus.COMPLETED, reward=1.0,
        metrics={"exact_match": 1.0}, timings=Timings(1.0, 0.5, 0.1, 10.0, 12.0),
        task_id="t0", children=["job/g0/r0/sub0", "job/g0/r0/sub1"],
        metadata=copy.deepcopy(METADATA))


def frozen_child(i: int = 0) -> Trajectory:
    """A frozen sub-agent of `parent()`: every token at mask 0, unscored."""
    return Trajectory(
        f"job/g0/r0/sub{i}", GroupKey("job/g0/r0/sub", i), prompt_tokens=1,
        turns=[Turn(0, 3), Turn(1, 1)],
        segments=[TokenSegment([1], [5, 6, 7], [0, 0, 0], [0.0, 0.0, 0.0], [3, 3, 3]),
                  TokenSegment([2], [8], [0], [0.0], [3], start_turn=1,
                               start_reason="messages_removed")],
        status=TrajectoryStatus.COMPLETED, task_id="t0", parent_id="job/g0/r0",
        trainable=False, metadata={"role": "explorer"})


def v1_record() -> dict[str, Any]:
    """A record as treadle wrote it before version 2, built by hand."""
    return {
        "version": 1, "trajectory_id": "old/g/r1", "group_id": "old/g", "repetition": 1,
        "task_id": "math-1", "status": "completed", "reason": None, "failure_stage": None,
        "infra_failure": False, "reward": 0.5, "metrics": {"exact_match": 0}, "attempt": 0,
        "prompt_tokens": 2, "output_tokens": 3,
        "turns": [{"index": 0, "output_tokens": 3, "engine_id": "e0", "queued_s": 0.0,
                   "generating_s": 0.25, "policy_version": 1, "tool_call": None}],
        "segments": [{"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "loss_mask": [1, 1, 0],
                      "logprobs": [-0.5, -1, 0.0], "policy_versions": [1, 1, 1]},
                     {"prompt_ids": [1], "response_ids": [6], "loss_mask": [1],
                      "logprobs": [-2.0], "policy_versions": [1]}],
        "timings": {"llm_s": 0.25, "tool_s": 0.0, "queue_s": 0.0, "started_at": None,
                    "finished_at": 5.0},
    }
