"""Record version 4: a trajectory's span of policy versions (`policy_span`, checked
against its tokens) and what it did with its KV across weight updates
(`kv_across_updates`); version 3 records still read, and the exports carry both."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from subagent_helpers import frozen_child, parent

from treadle.store import RecordError, dumps_record, loads_record, trajectory_from_record
from treadle.store import trajectory_to_record as to_record
from treadle.store.export import read_parquet, write_parquet
from treadle.types import KVAcrossUpdates, Trajectory


def _across_an_update() -> Trajectory:
    """`parent()`, whose tokens were sampled by versions 2 and 3, its KV kept."""
    t = parent()
    t.turns[1].policy_version = t.turns[2].policy_version = 3
    t.kv_across_updates = KVAcrossUpdates.KEEP
    return t


def test_the_span_and_the_kv_choice_round_trip() -> None:
    t = _across_an_update()
    record = to_record(t)
    assert record["version"] == 6
    assert record["policy_span"] == [2, 3] and record["kv_across_updates"] == "keep"
    assert loads_record(dumps_record(record)) == t
    # A frozen sub-agent sampled its tokens too (mask 0): its turns give its span.
    assert to_record(frozen_child())["policy_span"] == [0, 0]


def test_a_span_that_is_not_the_tokens_is_refused() -> None:
    record = to_record(_across_an_update())
    for wrong in ([3, 3], [2, 2], None, [2]):
        record["policy_span"] = wrong
        with pytest.raises(RecordError, match="policy_span"):
            trajectory_from_record(record)
    record["policy_span"], record["kv_across_updates"] = [2, 3], "reuse"
    with pytest.raises(RecordError, match="kv_across_updates"):
        trajectory_from_record(record)


def test_a_v3_record_reads_with_kv_recomputed_and_may_not_have_the_fields() -> None:
    t = _across_an_update()
    record = to_record(t)
    del record["policy_span"], record["kv_across_updates"], record["rewards"]
    del record["judgements"], record["resumed"]
    record["version"] = 3
    back = trajectory_from_record(record)
    assert back.kv_across_updates is KVAcrossUpdates.RECOMPUTE
    assert back.policy_span == (2, 3)  # derived from the tokens, whatever the version
    record["kv_across_updates"] = "keep"
    with pytest.raises(RecordError, match=r"unknown field\(s\) 'kv_across_updates'"):
        trajectory_from_record(record)


def test_parquet_carries_both_and_reads_files_without_them(tmp_path: Path) -> None:
    t = _across_an_update()
    path = tmp_path / "v4.parquet"
    write_parquet([(1, to_record(t))], path)
    table = pq.read_table(path)
    assert table.column("policy_span").to_pylist() == [[2, 3]] * 3  # one row per segment
    assert set(table.column("kv_across_updates").to_pylist()) == {"keep"}
    assert [back for _, back in read_parquet(path)] == [t]
    pq.write_table(table.drop_columns(["policy_span", "kv_across_updates"]),
                   tmp_path / "v3.parquet")
    t.kv_across_updates = KVAcrossUpdates.RECOMPUTE
    assert [back for _, back in read_parquet(tmp_path / "v3.parquet")] == [t]
