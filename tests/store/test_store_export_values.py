"""The exports' token columns are the trajectories' segments, value for value.

The round-trip tests (test_store_export.py) read a file back through treadle's own
reader, which a mistake made on both sides (written wrong, read back "right") gets
past. Here the JSONL lines are read as plain JSON and the Parquet file as plain
pyarrow rows, and each is compared with the trajectories that were stored: ids,
loss masks, logprobs bit for bit (0.0 where the mask is 0), per-token policy
versions, rewards, group ids and the sub-agent fields, segment by segment. The
batch has multi-segment trajectories, a trainable and a frozen sub-agent (mask 0
throughout), an infrastructure failure with tokens and one without.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from client.client_helpers import varied, varied_batch
from treadle.store import PlannedTrajectory, Store, trajectory_to_record
from treadle.store.export import export_jsonl, export_parquet, write_parquet
from treadle.types import TokenSegment, Trajectory, TrajectoryStatus


def _batch() -> list[Trajectory]:
    tokenless = varied("j/b/3", "j/b", 3, None, status=TrajectoryStatus.ERROR)
    tokenless.segments = []
    return [*varied_batch(), tokenless]


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[Store, list[Trajectory]]]:
    """A store holding the batch, finished in a shuffled order: the delivery order."""
    batch = _batch()
    store = Store(tmp_path / "v.db")
    store.create_job("j", {}, [PlannedTrajectory(t.trajectory_id, t.key.group_id, t.task_id,
                                                 t.key.repetition) for t in batch])
    order = list(batch)
    random.Random(3).shuffle(order)
    for t in order:
        store.finish("j", t)
    yield store, order
    store.close()


def bits(values: Sequence[Any]) -> list[str]:
    """Floats as their exact bits (an int, a float32 or a rounded value shows)."""
    assert all(type(v) is float for v in values), values
    return [v.hex() for v in values]


def check_segment(got: dict[str, Any], segment: TokenSegment, label: object) -> None:
    assert got["prompt_ids"] == segment.prompt_ids, label
    assert got["response_ids"] == segment.response_ids, label
    assert got["loss_mask"] == segment.loss_mask, label
    assert bits(got["logprobs"]) == bits(segment.logprobs), label
    assert all(lp == 0.0 for lp, m in zip(got["logprobs"], got["loss_mask"], strict=True)
               if m == 0), label
    assert got["policy_versions"] == segment.policy_versions, label


def test_jsonl_lines_hold_the_segments_as_they_were(
        stored: tuple[Store, list[Trajectory]], tmp_path: Path) -> None:
    store, delivered = stored
    path = tmp_path / "out.jsonl"
    assert export_jsonl(store, "j", path) == len(delivered)
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == len(delivered)
    for line, t in zip(lines, delivered, strict=True):
        assert (line["trajectory_id"], line["group_id"], line["repetition"], line["task_id"],
                line["status"], line["reward"], line["parent_id"], line["trainable"]) == (
            t.trajectory_id, t.key.group_id, t.key.repetition, t.task_id, t.status.value,
            t.reward, t.parent_id, t.trainable)
        assert len(line["segments"]) == len(t.segments), t.trajectory_id
        for i, (got, segment) in enumerate(zip(line["segments"], t.segments, strict=True)):
            check_segment(got, segment, (t.trajectory_id, i))
            assert (got["start_turn"], got["start_reason"]) == \
                (segment.start_turn, segment.start_reason)


def parquet_rows_are_the_segments(path: Path, delivered: Sequence[Trajectory]) -> None:
    rows = pq.read_table(path).to_pylist()
    expected = [(seq, t, i, s) for seq, t in enumerate(delivered, start=1)
                for i, s in enumerate(t.segments or [None])]
    assert len(rows) == len(expected)
    for row, (seq, t, i, segment) in zip(rows, expected, strict=True):
        label = (t.trajectory_id, i)
        assert (row["seq"], row["trajectory_id"], row["group_id"], row["repetition"],
                row["task_id"], row["status"], row["infra_failure"], row["reward"],
                row["parent_id"], row["trainable"], row["num_segments"]) == (
            seq, t.trajectory_id, t.key.group_id, t.key.repetition, t.task_id,
            t.status.value, t.infra_failure, t.reward, t.parent_id, t.trainable,
            len(t.segments)), label
        if segment is None:  # a trajectory without tokens: one row, empty lists
            assert (row["segment_index"], row["prompt_ids"], row["response_ids"],
                    row["loss_mask"], row["logprobs"], row["policy_versions"]) == \
                (None, [], [], [], [], []), label
            continue
        assert (row["segment_index"], row["segment_start_turn"],
                row["segment_start_reason"]) == (i, segment.start_turn,
                                                 segment.start_reason), label
        check_segment(row, segment, label)


def test_parquet_rows_hold_the_segments_as_they_were(
        stored: tuple[Store, list[Trajectory]], tmp_path: Path) -> None:
    store, delivered = stored
    path = tmp_path / "out.parquet"
    assert export_parquet(store, "j", path, page_size=4) == len(delivered)
    parquet_rows_are_the_segments(path, delivered)


def test_parquet_from_records_holds_the_segments_as_they_were(tmp_path: Path) -> None:
    batch = _batch()
    path = tmp_path / "records.parquet"
    assert write_parquet(((i + 1, trajectory_to_record(t)) for i, t in enumerate(batch)),
                         path, page_size=3) == len(batch)
    parquet_rows_are_the_segments(path, batch)
