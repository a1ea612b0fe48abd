"""What every converter hands its trainer is the trajectory's tokens, value for value.

Each converter's output is compared, row by row and token by token, with the
trajectories' own segments: the ids, the loss masks, the logprobs (bit for bit, 0.0
where the mask is 0), the per-token policy versions (every format carries them,
for an asynchronous trainer's off-policy correction; verl also the trajectory's
span of versions and its KV choice), the rewards and the group ids. The expected
rows are built here from `Trajectory.segments` and the documented exclusion rule
(`client_helpers.trains`), not through `treadle.client.samples`, so a converter and
its reference cannot share a mistake. The batch mixes multi-segment trajectories, a
trainable and a frozen sub-agent (mask 0 throughout), an infrastructure failure, an
abort and a failure without tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from client_helpers import trains, varied, varied_batch

from treadle.client import SkyRLTrajectoryID, to_skyrl, to_trl, to_verl
from treadle.client.skyrl import stop_reason
from treadle.client.verl import step_records
from treadle.types import KVAcrossUpdates, TokenSegment, Trajectory, TrajectoryStatus


@dataclass(frozen=True)
class Row:
    """One expected training row: segment `index` of `t` (an empty one for an excluded
    trajectory without tokens), trained or masked."""

    t: Trajectory
    index: int
    segment: TokenSegment
    trained: bool

    @property
    def mask(self) -> list[int]:
        return list(self.segment.loss_mask) if self.trained else [0] * self.length

    @property
    def logprobs(self) -> list[float]:
        return list(self.segment.logprobs) if self.trained else [0.0] * self.length

    @property
    def length(self) -> int:
        return len(self.segment.response_ids)

    @property
    def last(self) -> bool:
        return self.index == max(len(self.t.segments), 1) - 1


def expected_rows(batch: Sequence[Trajectory], *, keep_excluded: bool) -> list[Row]:
    """Every trajectory's segments in input order, the excluded ones masked (or left
    out); an excluded trajectory without tokens is one empty row."""
    rows = []
    for t in batch:
        trained = trains(t)
        if not trained and not keep_excluded:
            continue
        segments = t.segments or [TokenSegment()]
        rows += [Row(t, i, s, trained) for i, s in enumerate(segments)]
    return rows


def bits(values: Sequence[float]) -> list[str]:
    """Floats as their exact bits (a rounded or re-typed logprob shows)."""
    assert all(type(v) is float for v in values), values
    return [v.hex() for v in values]


def with_a_tokenless_failure() -> list[Trajectory]:
    failed = varied("j/b/3", "j/b", 3, None, status=TrajectoryStatus.ERROR)
    failed.segments = []
    batch = [*varied_batch(), failed]
    batch[0].kv_across_updates = KVAcrossUpdates.KEEP
    return batch


def span(t: Trajectory) -> list[int] | None:
    """[oldest, newest] version among its turns and its tokens sampled at mask 1."""
    versions = {turn.policy_version for turn in t.turns if turn.output_tokens} | {
        v for s in t.segments for v, m in zip(s.policy_versions, s.loss_mask, strict=True)
        if m == 1}
    return [min(versions), max(versions)] if versions else None


def check_token_lists(row: Row, prompt: list[int], response: list[int], mask: list[int],
                      logprobs: list[float]) -> None:
    label = (row.t.trajectory_id, row.index)
    assert prompt == row.segment.prompt_ids, label
    assert response == row.segment.response_ids, label
    assert mask == row.mask, label
    assert bits(logprobs) == bits(row.logprobs), label
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0), label


# -- verl ----------------------------------------------------------------------------


@pytest.mark.parametrize("drop_failed", [True, False])
def test_verl_records_are_the_segments_token_by_token(drop_failed: bool) -> None:
    batch = with_a_tokenless_failure()
    records = to_verl(batch, drop_failed=drop_failed).data
    rows = expected_rows(batch, keep_excluded=not drop_failed)
    assert len(records) == len(rows)
    for record, row in zip(records, rows, strict=True):
        check_token_lists(row, record["prompt_ids"], record["response_ids"],
                          record["response_mask"], record["response_logprobs"])
        assert record["reward_score"] == (row.t.reward if row.trained else None)
        extra = record["extra_fields"]
        assert extra["treadle_policy_versions"] == row.segment.policy_versions
        assert extra["treadle_policy_span"] == span(row.t)
        assert extra["treadle_kv_across_updates"] == (
            "keep" if row.t is batch[0] else "recompute")
        assert (extra["treadle_trajectory_id"], extra["treadle_group_id"],
                extra["treadle_task_id"], extra["treadle_repetition"],
                extra["treadle_segment_index"], extra["treadle_num_segments"],
                extra["treadle_status"]) == (
            row.t.trajectory_id, row.t.key.group_id, row.t.task_id, row.t.key.repetition,
            row.index, max(len(row.t.segments), 1), row.t.status.value)
        assert (extra["treadle_excluded"] is None) == row.trained


@pytest.mark.parametrize("segments", ["all", "last"])
def test_verl_step_records_are_the_segments_and_the_groups_mean(segments: str) -> None:
    batch = with_a_tokenless_failure()
    step = step_records(batch, segments=segments)  # type: ignore[arg-type]
    rows = [r for r in expected_rows(batch, keep_excluded=True)
            if segments == "all" or r.last]
    trained_rewards: dict[str, list[float]] = {}
    for t in batch:
        if trains(t):
            trained_rewards.setdefault(t.key.group_id, []).append(t.reward or 0.0)
    assert step.rows == [batch.index(r.t) for r in rows]
    for record, row in zip(step.records, rows, strict=True):
        check_token_lists(row, record["prompt_ids"], record["response_ids"],
                          record["response_mask"], record["response_logprobs"])
        assert record["extra_fields"]["treadle_policy_versions"] == \
            row.segment.policy_versions
        assert record["extra_fields"]["treadle_group_id"] == row.t.key.group_id
        # An excluded row trains nothing and leaves its group's mean reward as it is.
        scores = trained_rewards.get(row.t.key.group_id, [])
        assert record["reward_score"] == (row.t.reward if row.trained else
                                          sum(scores) / len(scores) if scores else 0.0)


# -- SkyRL ---------------------------------------------------------------------------


def check_skyrl_rows(out: dict[str, Any], rows: list[Row]) -> None:
    """The GeneratorOutput's rows are `rows`: tokens, rewards and SkyRL ids (built from
    treadle's group id and repetition)."""
    assert len(out["response_ids"]) == len(rows)
    for i, row in enumerate(rows):
        check_token_lists(row, out["prompt_token_ids"][i], out["response_ids"][i],
                          out["loss_masks"][i], out["rollout_logprobs"][i])
        assert out["treadle_policy_versions"][i] == row.segment.policy_versions
        assert out["rewards"][i] == row.t.reward
        assert out["trajectory_ids"][i] == SkyRLTrajectoryID(row.t.key.group_id,
                                                             row.t.key.repetition)


def test_skyrl_step_wise_rows_are_the_trained_segments_token_by_token() -> None:
    batch = with_a_tokenless_failure()
    out = to_skyrl(batch, step_wise=True).data
    rows = expected_rows(batch, keep_excluded=False)
    check_skyrl_rows(out, rows)
    for i, row in enumerate(rows):
        assert out["is_last_step"][i] is row.last
        assert out["stop_reasons"][i] == stop_reason(row.t.status)
        assert out["env_metrics"][i] == row.t.metrics


def test_skyrl_rows_carry_the_ids_skyrl_sent_for_each_trajectory() -> None:
    batch = varied_batch()
    sent = {t.trajectory_id: SkyRLTrajectoryID(f"uid-{i}", 7 - i) for i, t in enumerate(batch)}
    out = to_skyrl(batch, step_wise=True, trajectory_ids=sent).data
    rows = expected_rows(batch, keep_excluded=False)
    assert out["trajectory_ids"] == [sent[r.t.trajectory_id] for r in rows]
    assert out["response_ids"] == [r.segment.response_ids for r in rows]


def test_skyrl_plain_rows_are_the_prompts_trajectories_token_by_token() -> None:
    batch = [varied("j/a/0", "j/a", 0, 0.75), varied("j/a/1", "j/a", 1, 0.125),
             varied("j/b/0", "j/b", 0, 0.0, status=TrajectoryStatus.TIMEOUT)]
    out = to_skyrl(batch).data
    check_skyrl_rows(out, expected_rows(batch, keep_excluded=False))
    assert out["stop_reasons"] == ["stop", "stop", "timeout"]


# -- TRL -----------------------------------------------------------------------------


def trl_batch() -> list[Trajectory]:
    """Groups of three single-segment members, in group order: a failure, an abort, a
    frozen sub-agent and a failure without tokens among them."""
    failed = varied("j/c/2", "j/c", 2, None, status=TrajectoryStatus.ERROR)
    failed.segments = []
    return [varied("j/a/0", "j/a", 0, 0.75), varied("j/a/1", "j/a", 1, 0.125),
            varied("j/a/2", "j/a", 2, None, status=TrajectoryStatus.ERROR),
            varied("j/b/0", "j/b", 0, 0.5, status=TrajectoryStatus.TRUNCATED),
            varied("j/b/1", "j/b", 1, None, status=TrajectoryStatus.ABORTED),
            varied("j/b/2", "j/b", 2, None, parent="p", trainable=False),
            varied("j/c/0", "j/c", 0, 0.0), varied("j/c/1", "j/c", 1, 0.875), failed]


def test_trl_rows_are_the_trajectories_token_by_token() -> None:
    batch = trl_batch()
    pad = 77
    data: dict[str, Any] = to_trl(batch, pad_token_id=pad, num_generations=3).data
    assert data["treadle_trajectory_id"] == [t.trajectory_id for t in batch]
    for i, t in enumerate(batch):
        if trains(t):
            (row,) = expected_rows([t], keep_excluded=False)
            check_token_lists(row, data["prompt_ids"][i], data["completion_ids"][i],
                              data["env_mask"][i], data["logprobs"][i])
            assert data["treadle_reward"][i] == t.reward
            assert data["treadle_policy_versions"][i] == t.segments[0].policy_versions
            assert data["treadle_excluded"][i] is None
        else:  # a masked placeholder under the trajectory's own prompt
            prompt = t.segments[0].prompt_ids if t.segments else [pad]
            assert (data["prompt_ids"][i], data["completion_ids"][i], data["env_mask"][i],
                    bits(data["logprobs"][i]), data["treadle_reward"][i]) == \
                (prompt, [pad], [0], bits([0.0]), None), t.trajectory_id
            assert data["treadle_policy_versions"][i] == [0]
            assert data["treadle_excluded"][i]
        assert data["treadle_status"][i] == t.status.value
