"""Exports of record version 2: the sub-agent and segment-start columns round-trip,
version 1 records (stored, or in an older Parquet file) come out with the defaults."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from store_helpers import plan
from subagent_helpers import METADATA, frozen_child, parent, v1_record

from treadle.store import RecordError, Store, trajectory_from_record, trajectory_to_record
from treadle.store.export import (
    export_jsonl,
    export_parquet,
    parquet_schema,
    read_parquet,
    write_parquet,
)
from treadle.store.record import dumps_record
from treadle.types import GroupKey, Trajectory, TrajectoryStatus


def _trajectories() -> list[Trajectory]:
    tokenless = Trajectory("job/g0/r1", GroupKey("job/g0", 1), status=TrajectoryStatus.TIMEOUT,
                           reward=0.0, task_id="t0", children=["job/g0/r1/sub0"],
                           metadata={"note": "no tokens"})
    return [parent(), tokenless, frozen_child(0), frozen_child(1)]


def test_parquet_round_trips_the_v2_columns(tmp_path: Path) -> None:
    originals = _trajectories()
    path = tmp_path / "v2.parquet"
    assert write_parquet(((i + 1, trajectory_to_record(t)) for i, t in enumerate(originals)),
                         path, page_size=3) == 4
    assert [t for _, t in read_parquet(path)] == originals
    table = pq.read_table(path)
    assert table.schema.equals(parquet_schema(), check_metadata=False)
    assert table.schema.metadata[b"treadle.record_version"] == b"6"
    schema = table.schema
    assert schema.field("segment_start_turn").type == pa.int32()
    assert schema.field("segment_start_turn").nullable
    assert schema.field("segment_start_reason").type == pa.string()
    assert schema.field("children").type == pa.list_(pa.string())
    assert not schema.field("trainable").nullable and schema.field("parent_id").nullable
    rows = table.to_pylist()
    # parent: three segments; tokenless: one row without a segment; children: two each.
    assert [(r["seq"], r["segment_index"], r["segment_start_turn"], r["segment_start_reason"])
            for r in rows] == [
        (1, 0, 0, "start"), (1, 1, 1, "messages_edited"), (1, 2, 2, "system_changed"),
        (2, None, None, None),
        (3, 0, 0, "start"), (3, 1, 1, "messages_removed"),
        (4, 0, 0, "start"), (4, 1, 1, "messages_removed")]
    firsts = [rows[i] for i in (0, 3, 4, 6)]  # each trajectory's first row
    assert [(r["parent_id"], r["children"], r["trainable"]) for r in firsts] == [
        (None, ["job/g0/r0/sub0", "job/g0/r0/sub1"], True), (None, ["job/g0/r1/sub0"], True),
        ("job/g0/r0", [], False), ("job/g0/r0", [], False)]
    # A trajectory's fields are repeated on each of its rows.
    assert all(r["children"] == rows[0]["children"] for r in rows[:3])
    assert json.loads(rows[0]["metadata_json"]) == METADATA
    assert json.loads(rows[3]["metadata_json"]) == {"note": "no tokens"}
    assert all(set(r["loss_mask"]) <= {0} for r in rows if not r["trainable"])


def _store_with_a_v1_record(tmp_path: Path) -> tuple[Store, list[Trajectory]]:
    store = Store(tmp_path / "mixed.db")
    planned = plan(1, 2, job="old")
    store.create_job("old", {}, planned)
    old = trajectory_from_record(v1_record())  # trajectory_id "old/g/r1"
    new = parent()
    new.trajectory_id, new.key = planned[0].trajectory_id, GroupKey(planned[0].group_id, 0)
    new.children, new.task_id = [], planned[0].task_id
    old.trajectory_id, old.key = planned[1].trajectory_id, GroupKey(planned[1].group_id, 1)
    old.task_id = planned[1].task_id
    store.finish("old", new)
    store.finish("old", old)
    # The second as a treadle before version 2 stored it.
    record = v1_record()
    record.update(trajectory_id=old.trajectory_id, group_id=old.key.group_id, repetition=1,
                  task_id=old.task_id)
    raw = sqlite3.connect(tmp_path / "mixed.db")
    with raw:
        raw.execute("UPDATE trajectories SET record = ? WHERE trajectory_id = ?",
                    (dumps_record(record), old.trajectory_id))
    raw.close()
    return store, [new, old]


def test_exports_of_a_store_holding_a_v1_record(tmp_path: Path) -> None:
    store, expected = _store_with_a_v1_record(tmp_path)
    try:
        assert export_jsonl(store, "old", tmp_path / "out.jsonl") == 2
        lines = (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()
        # JSONL writes the records as stored: the old one stays version 1.
        assert [json.loads(line)["version"] for line in lines] == [6, 1]
        assert [trajectory_from_record(json.loads(line)) for line in lines] == expected
        # Parquet upgrades it: every row is version 3, the old one with the defaults.
        assert export_parquet(store, "old", tmp_path / "out.parquet") == 2
        assert [t for _, t in read_parquet(tmp_path / "out.parquet")] == expected
        rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
        old_rows = [r for r in rows if r["trajectory_id"] == expected[1].trajectory_id]
        assert [(r["parent_id"], r["children"], r["trainable"], r["metadata_json"],
                 r["segment_start_turn"], r["segment_start_reason"]) for r in old_rows] == \
            [(None, [], True, "{}", 0, "start")] * 2
    finally:
        store.close()


def test_a_parquet_file_from_before_v2_reads_with_the_defaults(tmp_path: Path) -> None:
    old = trajectory_from_record(v1_record())
    path = tmp_path / "new.parquet"
    write_parquet([(1, trajectory_to_record(old))], path)
    v2_only = ["parent_id", "children", "trainable", "metadata_json", "segment_start_turn",
               "segment_start_reason"]
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(v2_only), tmp_path / "v1.parquet")
    assert [t for _, t in read_parquet(tmp_path / "v1.parquet")] == [old]
    # Some of the new columns but not all is no export treadle wrote.
    pq.write_table(table.drop_columns(["trainable"]), tmp_path / "odd.parquet")
    with pytest.raises(RecordError, match="not trainable"):
        list(read_parquet(tmp_path / "odd.parquet"))
