"""Record version 2: sub-agent links, frozen trajectories, metadata, segment starts;
version 1 records still read, with the defaults."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from subagent_helpers import METADATA, frozen_child, parent, v1_record

from treadle.store import (
    RecordError,
    dumps_record,
    loads_record,
    trajectory_from_record,
    trajectory_to_record,
)
from treadle.store.record import RECORD_VERSION, SEGMENT_FIELDS, SEGMENT_META
from treadle.types import (
    FailureStage,
    Trajectory,
    TrajectoryStatus,
)


def test_v2_round_trip_keeps_every_new_field() -> None:
    for t in (parent(), frozen_child(0), frozen_child(1)):
        record = trajectory_to_record(t)
        assert record["version"] == RECORD_VERSION == 6
        back = loads_record(dumps_record(record))
        assert back == t and trajectory_from_record(record) == t
        assert dumps_record(trajectory_to_record(back)) == dumps_record(record)
    p, c = loads_record(dumps_record(trajectory_to_record(parent()))), \
        loads_record(dumps_record(trajectory_to_record(frozen_child())))
    assert [(s.start_turn, s.start_reason) for s in p.segments] == \
        [(0, "start"), (1, "messages_edited"), (2, "system_changed")]
    assert p.children == ["job/g0/r0/sub0", "job/g0/r0/sub1"] and p.parent_id is None
    assert p.metadata == METADATA and p.trainable
    assert isinstance(p.metadata["big"], int) and p.metadata["ratio"].hex() == (1 / 3).hex()
    assert (c.parent_id, c.trainable, c.children, c.metadata) == \
        ("job/g0/r0", False, [], {"role": "explorer"})


def test_v2_record_layout() -> None:
    record = trajectory_to_record(parent())
    keys = list(record)
    # The new fields sit between the trajectory's counts and its turns, as documented.
    assert keys[keys.index("output_tokens") + 1:keys.index("turns")] == \
        ["parent_id", "children", "trainable", "metadata",
         "policy_span", "kv_across_updates", "resumed"]  # (v4, v4, v6)
    assert list(record["segments"][1]) == [*SEGMENT_FIELDS, *SEGMENT_META]
    assert SEGMENT_FIELDS == ("prompt_ids", "response_ids", "loss_mask", "logprobs",
                              "policy_versions")
    assert record["segments"][1]["start_reason"] == "messages_edited"


def test_metadata_is_a_fresh_copy_both_ways() -> None:
    t = parent()
    record = trajectory_to_record(t)
    record["metadata"]["nested"]["xs"].append(99)
    record["children"].append("x")
    assert t.metadata == METADATA and len(t.children) == 2
    back = trajectory_from_record(record)
    record["metadata"]["nested"]["xs"].clear()
    assert back.metadata["nested"]["xs"][-1] == 99


def test_a_v1_record_reads_with_the_defaults() -> None:
    t = trajectory_from_record(v1_record())
    assert (t.parent_id, t.children, t.trainable, t.metadata) == (None, [], True, {})
    assert [(s.start_turn, s.start_reason) for s in t.segments] == [(0, "start"), (0, "start")]
    assert t.reward == 0.5 and t.segments[0].logprobs == [-0.5, -1.0, 0.0]
    assert loads_record(json.dumps(v1_record())) == t
    # Written again it is a current record, which reads back the same.
    again = trajectory_to_record(t)
    assert again["version"] == 6 and trajectory_from_record(again) == t


def test_a_v1_record_may_not_have_v2_fields() -> None:
    for key, value in (("trainable", True), ("children", [])):
        record = v1_record()
        record[key] = value
        with pytest.raises(RecordError, match=f"record: unknown field\\(s\\) '{key}'"):
            trajectory_from_record(record)
    record = v1_record()
    record["segments"][1]["start_reason"] = "start"
    with pytest.raises(RecordError, match=r"segments\[1\]: unknown field\(s\) 'start_reason'"):
        trajectory_from_record(record)


def test_an_unknown_version_is_refused_before_its_fields() -> None:
    record = trajectory_to_record(parent())
    record.update(version=7, subagent_tree={})
    with pytest.raises(RecordError, match=r"version: 7 is not a record version this treadle "
                                          r"reads \(it reads 1, 2, 3, 4, 5 and 6\)"):
        trajectory_from_record(record)
    del record["version"], record["subagent_tree"]
    with pytest.raises(RecordError, match="record: missing field\\(s\\) 'version'"):
        trajectory_from_record(record)


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(record: dict[str, Any]) -> None:
        target: Any = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _delete(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(record: dict[str, Any]) -> None:
        target: Any = record
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return mutate


BAD_V2: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown top key", _set(["parent"], None), "record: unknown field(s) 'parent'"),
    ("unknown segment key", _set(["segments", 1, "start_index"], 0),
     "segments[1]: unknown field(s) 'start_index'"),
    ("missing children", _delete(["children"]), "record: missing field(s) 'children'"),
    ("missing metadata", _delete(["metadata"]), "record: missing field(s) 'metadata'"),
    ("missing start_reason", _delete(["segments", 2, "start_reason"]),
     "segments[2]: missing field(s) 'start_reason'"),
    ("missing start_turn", _delete(["segments", 0, "start_turn"]),
     "segments[0]: missing field(s) 'start_turn'"),
    ("start_reason not a string", _set(["segments", 1, "start_reason"], 7),
     "segments[1].start_reason: must be a non-empty string, got 7"),
    ("empty start_reason", _set(["segments", 1, "start_reason"], ""),
     "segments[1].start_reason: must be a non-empty string"),
    ("null start_reason", _set(["segments", 0, "start_reason"], None),
     "segments[0].start_reason: must be a non-empty string"),
    ("negative start_turn", _set(["segments", 1, "start_turn"], -1),
     "segments[1].start_turn: must be a non-negative integer"),
    ("bool start_turn", _set(["segments", 1, "start_turn"], True),
     "segments[1].start_turn: must be a non-negative integer"),
    ("frozen with a trained token", _set(["trainable"], False),
     "segments[0].loss_mask[0]: must be 0 in a frozen trajectory (trainable false), got 1"),
    ("trainable not a bool", _set(["trainable"], 1), "trainable: must be true or false"),
    ("parent is itself", _set(["parent_id"], "job/g0/r0"),
     "parent_id: 'job/g0/r0' is the trajectory's own id"),
    ("empty parent", _set(["parent_id"], ""), "parent_id: must be a non-empty string or null"),
    ("parent not a string", _set(["parent_id"], 3), "parent_id: must be a string"),
    ("children not an array", _set(["children"], "a,b"), "children: must be an array"),
    ("child not a string", _set(["children", 1], 5), "children[1]: must be a string, got 5"),
    ("empty child", _set(["children", 0], ""), "children[0]: must be a non-empty string"),
    ("repeated child", _set(["children", 1], "job/g0/r0/sub0"),
     "children[1]: 'job/g0/r0/sub0' is listed twice"),
    ("child is itself", _set(["children", 0], "job/g0/r0"),
     "children[0]: 'job/g0/r0' is the trajectory's own id"),
    ("metadata not an object", _set(["metadata"], [1]), "metadata: must be a JSON object"),
    ("NaN in metadata", _set(["metadata", "nested", "xs", 1], math.nan),
     "metadata.nested.xs[1]: must be finite, got nan"),
    ("infinity in metadata", _set(["metadata", "ratio"], -math.inf),
     "metadata.ratio: must be finite"),
    ("non-JSON in metadata", _set(["metadata", "depth"], {1, 2}),
     "metadata.depth: must be a JSON value"),
]


@pytest.mark.parametrize(("mutate", "message"), [(m, msg) for _, m, msg in BAD_V2],
                         ids=[name for name, _, _ in BAD_V2])
def test_bad_v2_record_raises_naming_the_field(mutate: Callable[[dict[str, Any]], None],
                                               message: str) -> None:
    record = trajectory_to_record(parent())
    trajectory_from_record(copy.deepcopy(record))  # the base is valid
    mutate(record)
    with pytest.raises(RecordError) as info:
        trajectory_from_record(record)
    assert message in str(info.value)


def test_metadata_nested_too_deep_is_refused_not_a_crash() -> None:
    record = trajectory_to_record(parent())
    deep: Any = 0
    for _ in range(200):
        deep = [deep]
    record["metadata"] = {"deep": deep}
    with pytest.raises(RecordError, match="metadata.deep" + r"\[0\]" * 63 + ": nested deeper"):
        trajectory_from_record(record)


def test_the_writer_refuses_what_the_reader_would_refuse() -> None:
    def refused(t: Trajectory, message: str) -> None:
        with pytest.raises(RecordError) as info:
            trajectory_to_record(t)
        assert message in str(info.value)

    t = frozen_child()
    t.segments[1].loss_mask, t.segments[1].logprobs = [1], [-0.5]
    refused(t, "segments[1].loss_mask[0]: must be 0 in a frozen trajectory")
    t = parent()
    t.parent_id = t.trajectory_id
    refused(t, "parent_id: 'job/g0/r0' is the trajectory's own id")
    t = parent()
    t.children.append(t.children[0])
    refused(t, "children[2]: 'job/g0/r0/sub0' is listed twice")
    t = parent()
    t.children = [None]  # type: ignore[list-item]
    refused(t, "children[0]: must be a non-empty string, got None")
    t = parent()
    t.segments[2].start_reason = ""
    refused(t, "segments[2].start_reason: must be a non-empty string")
    t = parent()
    t.segments[0].start_turn = -1
    refused(t, "segments[0].start_turn: must be a non-negative integer")
    t = parent()
    t.trainable = 0  # type: ignore[assignment]
    refused(t, "trainable: must be true or false")
    # Metadata must read back equal: no tuples, no non-string keys, no NaN, no objects.
    for value, message in (((1, 2), "metadata.k: must be a JSON value"),
                           ({1: "a"}, "metadata.k: keys must be strings, got 1"),
                           ([math.nan], "metadata.k[0]: must be finite"),
                           (object(), "metadata.k: must be a JSON value")):
        t = parent()
        t.metadata = {"k": value}
        refused(t, message)


def test_an_error_may_be_frozen_and_keeps_its_failure_fields() -> None:
    t = frozen_child()
    t.status, t.failure_stage, t.reason = (TrajectoryStatus.ERROR, FailureStage.HARNESS,
                                           "harness exited 137")
    back = loads_record(dumps_record(trajectory_to_record(t)))
    assert back == t and back.infra_failure and back.failure_stage is FailureStage.HARNESS
