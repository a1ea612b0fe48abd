"""A rubric's reward vector through the converters: verl's reward_extra_info, SkyRL's
env_metrics and TRL's treadle_rewards carry each dimension; a trajectory flagged for
a required dimension without a verdict is excluded (never a reward of 0), one whose
optional dimension failed trains on the rest."""

from __future__ import annotations

import math

from client_helpers import traj

from treadle.client.samples import training_sequences
from treadle.client.skyrl import to_skyrl
from treadle.client.trl import to_trl
from treadle.client.verl import to_verl
from treadle.types import Judgement, JudgementStatus, RewardSource, Trajectory

WHY = "judge failed: attempt 1: JudgeCallError: connection refused"


def rubric_scored(tid: str, rep: int, clarity: float | None, *,
                  optional: bool = False) -> Trajectory:
    t = traj(tid, "g", rep, 1.0)
    status = JudgementStatus.JUDGED if clarity is not None else JudgementStatus.FAILED
    t.judgements = [Judgement("clarity", status, clarity,
                              None if clarity is None else 1 + 4 * clarity,
                              "ok" if clarity is not None else WHY, optional, "judge",
                              1, False, "prompt", "reply")]
    t.rewards = {"correct": 1.0, "clarity": clarity}
    t.reward = None if t.flagged else 0.5 + 0.5 * (1.0 if clarity is None else clarity)
    t.reward_source = None if t.reward is None else RewardSource.RUBRIC
    return t


def batch() -> list[Trajectory]:
    return [rubric_scored("a", 0, 0.5), rubric_scored("b", 1, None),
            rubric_scored("c", 2, None, optional=True)]


def test_a_flagged_trajectory_is_excluded_with_its_reason_never_scored_zero() -> None:
    out = training_sequences(batch())
    assert [e.trajectory_id for e in out.exclusions] == ["b"]
    assert out.exclusions[0].reason == f"unjudged: clarity: {WHY}"
    assert [s.trajectory_id for s in out.sequences] == ["a", "c"]
    assert [s.reward for s in out.sequences] == [0.75, 1.0]
    kept = training_sequences(batch(), drop_failed=False)
    assert [s.reward for s in kept.sequences] == [0.75, None, 1.0]


def test_verl_carries_the_vector_in_reward_extra_info() -> None:
    records = to_verl(batch()).data
    extra = [r["extra_fields"]["reward_extra_info"] for r in records]
    assert extra[0] == {"clarity": 0.5, "correct": 1.0, "exact_match": 1.0}
    assert math.isnan(extra[1]["clarity"]) and extra[1]["correct"] == 1.0  # optional, failed
    assert [r["extra_fields"]["treadle_trajectory_id"] for r in records] == ["a", "c"]


def test_skyrl_and_trl_carry_the_vector() -> None:
    env = to_skyrl(batch(), step_wise=True).data["env_metrics"]
    assert env == [{"exact_match": 1.0, "correct": 1.0, "clarity": 0.5},
                   {"exact_match": 1.0, "correct": 1.0}]
    data = to_trl(batch(), pad_token_id=0).data
    assert data["treadle_rewards"] == [{"correct": 1.0, "clarity": 0.5}, {},
                                       {"correct": 1.0, "clarity": None}]
    assert data["treadle_reward"] == [0.75, None, 1.0]
