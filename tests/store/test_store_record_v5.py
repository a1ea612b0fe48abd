"""Record version 5: a rubric's reward vector (`rewards`) and its judges' verdicts
(`judgements`, the judge's own tokens kept) round trip, in JSON and Parquet; a
flagged trajectory (a required dimension without a verdict) has no reward; version
4 records still read, with no vector."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from subagent_helpers import parent

from treadle.store import RecordError, dumps_record, loads_record, trajectory_from_record
from treadle.store import trajectory_to_record as to_record
from treadle.store.export import read_parquet, write_parquet
from treadle.types import Judgement, JudgementStatus, RewardSource, Trajectory


def judged(*, failed: bool = False, optional: bool = False) -> Trajectory:
    t = parent()
    status = JudgementStatus.FAILED if failed else JudgementStatus.JUDGED
    value, score = (None, None) if failed else (0.75, 4.0)
    t.judgements = [Judgement("clarity", status, value, score,
                              "judge failed: attempt 1: JudgeCallError: refused" if failed
                              else "clear", optional, "endpoint http://j/v1 model m", 1,
                              False, "Rate it", '{"score": 4}' if not failed else "",
                              [5, 6] if not failed else [], [-0.5, -0.25] if not failed
                              else [])]
    t.rewards = {"correct": 1.0, "clarity": value}
    flagged = failed and not optional
    t.reward = None if flagged else 0.875
    t.reward_source = None if flagged else RewardSource.RUBRIC
    return t


@pytest.mark.parametrize("kind", ["judged", "flagged", "optional failed"])
def test_the_reward_vector_round_trips(kind: str) -> None:
    t = judged(failed=kind != "judged", optional=kind == "optional failed")
    record = to_record(t)
    assert record["version"] == 6 and record["rewards"] == t.rewards
    assert record["judgements"][0]["status"] == t.judgements[0].status.value
    assert loads_record(dumps_record(record)) == t
    assert t.flagged == (kind == "flagged")


def test_a_flagged_trajectory_has_no_reward_and_values_match_the_vector() -> None:
    t = judged(failed=True)
    t.reward = 0.0  # what a judge failure must never become
    with pytest.raises(RecordError, match="flagged"):
        to_record(t)
    record = to_record(judged())
    record["rewards"]["clarity"] = 0.5
    with pytest.raises(RecordError, match=r"rewards\.clarity"):
        trajectory_from_record(record)
    record = to_record(judged())
    record["judgements"][0]["value"] = None
    with pytest.raises(RecordError, match=r"judgements\[0\]: value and score"):
        trajectory_from_record(record)
    record = to_record(judged())
    record["rewards"] = {}
    record["judgements"] = []
    with pytest.raises(RecordError, match="rubric"):
        trajectory_from_record(record)


def test_a_v4_record_reads_without_a_vector() -> None:
    record = to_record(parent())
    del record["rewards"], record["judgements"], record["resumed"]
    record["version"] = 4
    back = trajectory_from_record(record)
    assert back.rewards == {} and back.judgements == [] and not back.flagged
    record["rewards"] = {}
    with pytest.raises(RecordError, match=r"unknown field\(s\) 'rewards'"):
        trajectory_from_record(record)


def test_parquet_carries_the_vector_and_reads_files_without_it(tmp_path: Path) -> None:
    ok, flagged = judged(), judged(failed=True)
    flagged.trajectory_id = "t-flagged"
    path = tmp_path / "v5.parquet"
    write_parquet([(1, to_record(ok)), (2, to_record(flagged))], path)
    table = pq.read_table(path)
    rows = table.to_pylist()
    assert {r["trajectory_id"]: r["flagged"] for r in rows} == {ok.trajectory_id: False,
                                                              "t-flagged": True}
    assert dict(rows[0]["rewards"]) == {"correct": 1.0, "clarity": 0.75}
    assert [back for _, back in read_parquet(path)] == [ok, flagged]
    pq.write_table(table.drop_columns(["rewards", "judgements_json", "flagged"]),
                   tmp_path / "v4.parquet")
    back = next(read_parquet(tmp_path / "v4.parquet"))[1]
    assert back.rewards == {} and back.judgements == []
