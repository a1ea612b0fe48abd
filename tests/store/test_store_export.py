"""Exports: JSONL lines are the records; Parquet reads back as the same trajectories."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from store_helpers import plan, random_trajectory

from treadle.store import Store, trajectory_from_record
from treadle.store.export import (
    export_jsonl,
    export_parquet,
    parquet_schema,
    read_parquet,
    write_parquet,
)
from treadle.types import GroupKey, TokenSegment, Trajectory, TrajectoryStatus


@pytest.fixture
def filled(tmp_path: Path) -> tuple[Store, list[Trajectory]]:
    store = Store(tmp_path / "e.db")
    planned = plan(6, 5)
    rng = random.Random(21)
    store.create_job("j", {"n": 5}, planned)
    order = list(planned)
    rng.shuffle(order)
    finished = [random_trajectory(rng, p) for p in order]
    for t in finished:
        store.finish("j", t)
    return store, finished


def test_jsonl_lines_are_the_records_in_delivery_order(
        filled: tuple[Store, list[Trajectory]], tmp_path: Path) -> None:
    store, finished = filled
    path = tmp_path / "out.jsonl"
    assert export_jsonl(store, "j", path, page_size=4) == 30
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [trajectory_from_record(json.loads(line)) for line in lines] == finished


def test_parquet_reads_back_identical(filled: tuple[Store, list[Trajectory]],
                                      tmp_path: Path) -> None:
    store, finished = filled
    path = tmp_path / "out.parquet"
    assert export_parquet(store, "j", path, page_size=4) == 30
    back = list(read_parquet(path))
    assert [seq for seq, _ in back] == list(range(1, 31))
    assert [t for _, t in back] == finished
    # Token lists and logprobs are bit-exact, segment by segment.
    for (_, t), original in zip(back, finished, strict=True):
        for a, b in zip(t.segments, original.segments, strict=True):
            assert [x.hex() for x in a.logprobs] == [x.hex() for x in b.logprobs]
    assert pq.ParquetFile(path).metadata.num_row_groups == 8  # a row group per page


def test_parquet_from_records_is_the_export_of_the_store(
        filled: tuple[Store, list[Trajectory]], tmp_path: Path) -> None:
    store, _ = filled
    export_parquet(store, "j", tmp_path / "a.parquet")
    pairs = ((d.seq, d.record()) for d in store.iter_results("j"))
    assert write_parquet(pairs, tmp_path / "b.parquet", page_size=7) == 30
    assert pq.read_table(tmp_path / "b.parquet").equals(pq.read_table(tmp_path / "a.parquet"))
    assert pq.ParquetFile(tmp_path / "b.parquet").metadata.num_row_groups == 5


def test_parquet_layout_is_one_row_per_segment(tmp_path: Path) -> None:
    store = Store(":memory:")
    p = plan(1, 3)
    store.create_job("j", {}, p)
    segs = [TokenSegment([1, 2], [3, 4, 5], [1, 0, 1], [-0.5, 0.0, -0.25], [2, 2, 3]),
            TokenSegment([1, 9], [6], [1], [-1.5], [3])]
    store.finish("j", Trajectory(p[0].trajectory_id, GroupKey(p[0].group_id, 0), segments=segs,
                                 status=TrajectoryStatus.COMPLETED, reward=1.0,
                                 metrics={"exact_match": 1.0}, task_id=p[0].task_id))
    store.finish("j", Trajectory(p[1].trajectory_id, GroupKey(p[1].group_id, 1),
                                 status=TrajectoryStatus.TIMEOUT, reward=0.0,
                                 task_id=p[1].task_id))
    path = tmp_path / "layout.parquet"
    export_parquet(store, "j", path)
    table = pq.read_table(path)
    assert table.schema.equals(parquet_schema(), check_metadata=False)
    assert table.schema.metadata[b"treadle.layout"] == b"one row per token segment"
    rows = table.to_pylist()
    assert [(r["seq"], r["segment_index"], r["num_segments"]) for r in rows] == \
        [(1, 0, 2), (1, 1, 2), (2, None, 0)]
    assert rows[0]["response_ids"] == [3, 4, 5] and rows[1]["prompt_ids"] == [1, 9]
    assert rows[0]["logprobs"] == [-0.5, 0.0, -0.25] and rows[0]["loss_mask"] == [1, 0, 1]
    assert rows[0]["metrics"] == [("exact_match", 1.0)] and rows[0]["reward"] == 1.0
    assert rows[2]["response_ids"] == [] and rows[2]["status"] == "timeout"
    assert table.schema.field("logprobs").type == pa.list_(pa.float64())
    assert table.schema.field("response_ids").type == pa.list_(pa.int32())
    assert [t for _, t in read_parquet(path)] == [d.trajectory() for d in store.results("j")]


def test_export_of_an_empty_job_writes_an_empty_file(tmp_path: Path) -> None:
    store = Store(":memory:")
    store.create_job("j", {}, plan(1, 2))
    assert export_parquet(store, "j", tmp_path / "e.parquet") == 0
    assert pq.read_table(tmp_path / "e.parquet").num_rows == 0
    assert export_jsonl(store, "j", tmp_path / "e.jsonl") == 0
    assert (tmp_path / "e.jsonl").read_text() == ""
