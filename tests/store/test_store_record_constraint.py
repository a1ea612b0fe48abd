"""A turn's structured-output constraint in the record: written only where there is
one (a record of freely sampled turns is byte for byte what it was before), read
back exactly, and a malformed one refused naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from treadle.store.errors import RecordError
from treadle.store.record import dumps_record, trajectory_from_record, trajectory_to_record
from treadle.types import (
    GroupKey,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    Trajectory,
    TrajectoryStatus,
    Turn,
)

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "maximum": 1e3}}}


def _traj(*constraints: JsonSchemaConstraint | JsonObjectConstraint | None) -> Trajectory:
    return Trajectory("t", GroupKey("g", 0), task_id="x", status=TrajectoryStatus.COMPLETED,
                      reward=1.0,
                      turns=[Turn(i, 2, constraint=c) for i, c in enumerate(constraints)])


def test_constraints_round_trip_and_a_free_turn_has_no_field() -> None:
    t = _traj(None, JsonSchemaConstraint(SCHEMA, "answer"), JsonObjectConstraint())
    record = trajectory_to_record(t)
    assert "constraint" not in record["turns"][0]
    assert record["turns"][1]["constraint"] == {"kind": "json_schema", "name": "answer",
                                                "schema": SCHEMA}
    assert record["turns"][2]["constraint"] == {"kind": "json_object"}
    back = trajectory_from_record(record)
    assert [turn.constraint for turn in back.turns] == [turn.constraint for turn in t.turns]
    assert dumps_record(trajectory_to_record(back)) == dumps_record(record)


def test_a_record_without_constraints_is_unchanged() -> None:
    record = trajectory_to_record(_traj(None, None))
    assert all(set(turn) == {"index", "output_tokens", "engine_id", "queued_s",
                             "generating_s", "policy_version", "tool_call"}
               for turn in record["turns"])


@pytest.mark.parametrize(("constraint", "field"), [
    ({"kind": "regex", "pattern": "a+"}, "turns[0].constraint.kind"),
    ({"kind": "json_schema", "name": None}, "turns[0].constraint"),  # no schema
    ({"kind": "json_schema", "name": None, "schema": [1]}, "turns[0].constraint.schema"),
    ({"kind": "json_object", "schema": {}}, "turns[0].constraint"),
])
def test_a_malformed_constraint_is_refused_naming_the_field(constraint: dict[str, Any],
                                                            field: str) -> None:
    record = copy.deepcopy(trajectory_to_record(_traj(JsonObjectConstraint())))
    record["turns"][0]["constraint"] = constraint
    with pytest.raises(RecordError, match=field.replace("[", r"\[").replace("]", r"\]")):
        trajectory_from_record(record)
