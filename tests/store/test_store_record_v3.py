"""Record version 3: what scored a trajectory (`reward_source`); version 2 records
still read, without one, and the exports carry it."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from subagent_helpers import parent

from treadle.store import RecordError, dumps_record, loads_record, trajectory_from_record
from treadle.store import trajectory_to_record as to_record
from treadle.store.export import read_parquet, write_parquet
from treadle.types import RewardSource, TrajectoryStatus


def test_every_source_round_trips_and_sits_after_the_reward() -> None:
    for source in [*RewardSource, None]:
        t = parent()
        t.reward_source = source
        if source is RewardSource.RUBRIC:  # a rubric's reward comes with its vector
            t.rewards = {"correct": t.reward}
        record = to_record(t)
        assert record["version"] == 6
        assert record["reward_source"] == (None if source is None else source.value)
        keys = list(record)
        assert keys[keys.index("reward") + 1] == "reward_source"
        assert loads_record(dumps_record(record)) == t


def test_a_v2_record_reads_without_a_source_and_may_not_have_one() -> None:
    t = parent()
    t.reward_source = RewardSource.VERIFIER
    record = to_record(t)
    del record["reward_source"], record["policy_span"], record["kv_across_updates"]
    del record["rewards"], record["judgements"], record["resumed"]
    record["version"] = 2
    back = trajectory_from_record(record)
    assert back.reward_source is None and back.reward == 1.0
    record["reward_source"] = "verifier"
    with pytest.raises(RecordError, match=r"unknown field\(s\) 'reward_source'"):
        trajectory_from_record(record)
    record["version"] = 3
    del record["reward_source"]
    with pytest.raises(RecordError, match=r"missing field\(s\) 'reward_source'"):
        trajectory_from_record(record)


def test_a_source_needs_a_reward_and_must_be_known() -> None:
    t = parent()
    t.reward, t.reward_source = None, RewardSource.REWARD_FILE
    with pytest.raises(RecordError, match="reward_source: must be null for a trajectory "
                                          "without a reward"):
        to_record(t)
    t.status, t.reward_source = TrajectoryStatus.COMPLETED, None
    record = to_record(t)
    record["reward_source"] = "reward_file"
    with pytest.raises(RecordError, match="reward_source"):
        trajectory_from_record(record)
    record["reward"], record["reward_source"] = 1.0, "the_harness_said_so"
    with pytest.raises(RecordError, match="reward_source"):
        trajectory_from_record(record)


def test_parquet_carries_the_source_and_reads_files_without_it(tmp_path: Path) -> None:
    t = parent()
    t.reward_source = RewardSource.EXIT_CODE
    path = tmp_path / "v3.parquet"
    write_parquet([(1, to_record(t))], path)
    table = pq.read_table(path)
    assert set(table.column("reward_source").to_pylist()) == {"exit_code"}
    assert [back for _, back in read_parquet(path)] == [t]
    pq.write_table(table.drop_columns(["reward_source", "policy_span", "kv_across_updates"]),
                   tmp_path / "v2.parquet")
    t.reward_source = None
    assert [back for _, back in read_parquet(tmp_path / "v2.parquet")] == [t]
