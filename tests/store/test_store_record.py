"""The trajectory record: exact round trips, strict reading with the field named."""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import plan, random_trajectory

from treadle.store import (
    RecordError,
    dumps_record,
    loads_record,
    trajectory_from_record,
    trajectory_to_record,
)
from treadle.types import (
    FailureStage,
    GroupKey,
    TokenSegment,
    ToolCall,
    Trajectory,
    TrajectoryStatus,
    Turn,
)


def _trajectories(n: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    return [random_trajectory(rng, p) for p in plan(n // 4, 4)]


def test_round_trip_is_exact_for_every_field() -> None:
    for t in _trajectories(200, seed=1):
        record = trajectory_to_record(t)
        assert trajectory_from_record(record) == t
        assert loads_record(dumps_record(record)) == t
        # Encoding is deterministic: equal trajectories give identical bytes.
        assert dumps_record(trajectory_to_record(loads_record(dumps_record(record)))) == \
            dumps_record(record)


def test_every_status_and_stage_round_trips() -> None:
    for status in TrajectoryStatus:
        stage = FailureStage.TOOL if status is TrajectoryStatus.ERROR else None
        t = Trajectory("t", GroupKey("g", 0), status=status, failure_stage=stage)
        back = trajectory_from_record(trajectory_to_record(t))
        assert back.status is status and back.failure_stage is stage


def test_floats_keep_every_bit() -> None:
    values = [0.1 + 0.2, 1e-300, -1e-300, 5e-324, 1.7976931348623157e308, -0.0,
              -2.718281828459045, 1 / 3, -13.000000000000002]
    seg = TokenSegment(prompt_ids=[1], response_ids=list(range(len(values))),
                       loss_mask=[1] * len(values), logprobs=values,
                       policy_versions=[0] * len(values))
    t = Trajectory("t", GroupKey("g", 0), segments=[seg], status=TrajectoryStatus.COMPLETED,
                   reward=values[0], metrics={"m": values[-1]})
    back = loads_record(dumps_record(trajectory_to_record(t)))
    assert [v.hex() for v in back.segments[0].logprobs] == [v.hex() for v in values]
    assert math.copysign(1.0, back.segments[0].logprobs[5]) == -1.0  # -0.0 stays negative
    assert back.reward is not None and back.reward.hex() == values[0].hex()


@settings(max_examples=200, deadline=None)
@given(reward=st.floats(allow_nan=False, allow_infinity=False),
       logprobs=st.lists(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
                         max_size=20),
       ids=st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=20, max_size=20),
       arguments=st.dictionaries(st.text(max_size=5), st.one_of(
           st.none(), st.booleans(), st.integers(), st.text(max_size=8)), max_size=4))
def test_round_trip_property(reward: float, logprobs: list[float], ids: list[int],
                             arguments: dict[str, Any]) -> None:
    n = len(logprobs)
    seg = TokenSegment(prompt_ids=ids, response_ids=ids[:n], loss_mask=[1] * n,
                       logprobs=logprobs, policy_versions=ids[:n])
    t = Trajectory("t", GroupKey("g", 0), segments=[seg], status=TrajectoryStatus.TRUNCATED,
                   reward=reward)
    back = loads_record(dumps_record(trajectory_to_record(t)))
    assert back == t
    assert [x.hex() for x in back.segments[0].logprobs] == [x.hex() for x in logprobs]
    t.turns = [Turn(0, 3, tool_call=ToolCall("python", arguments))]
    assert loads_record(dumps_record(trajectory_to_record(t))) == t


def test_record_lists_are_fresh_copies() -> None:
    t = _trajectories(4, seed=2)[0]
    t.segments = [TokenSegment([1], [2, 3], [1, 0], [-0.5, 0.0], [0, 0])]
    record = trajectory_to_record(t)
    record["segments"][0]["response_ids"].append(99)
    assert t.segments[0].response_ids == [2, 3]
    back = trajectory_from_record(trajectory_to_record(t))
    back.segments[0].logprobs[0] = 0.0
    assert t.segments[0].logprobs[0] == -0.5


def test_integers_are_accepted_as_numbers_and_become_floats() -> None:
    t = Trajectory("t", GroupKey("g", 0), segments=[TokenSegment([1], [2], [1], [-1.0], [0])],
                   status=TrajectoryStatus.COMPLETED, reward=1.0)
    record = trajectory_to_record(t)
    record["reward"] = 1
    record["segments"][0]["logprobs"] = [-1]
    back = trajectory_from_record(record)
    assert type(back.reward) is float and type(back.segments[0].logprobs[0]) is float
    assert back == t


def _base_record() -> dict[str, Any]:
    rng = random.Random(3)
    p = plan(1, 1)[0]
    t = random_trajectory(rng, p, TrajectoryStatus.COMPLETED)
    t.reward = 1.0
    t.segments = [TokenSegment([1, 2], [3, 4, 5, 6], [1, 1, 0, 1], [-0.1, -0.2, 0.0, -0.4],
                               [1, 1, 1, 2])]
    t.turns = [Turn(0, 2, tool_call=ToolCall("python", {"code": "1"}, 0.5, 1)), Turn(1, 1)]
    return trajectory_to_record(t)


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(record: dict[str, Any]) -> None:
        target: Any = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _delete(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda record: record.pop(key)


BAD_RECORDS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing field", _delete("status"), "missing field(s) 'status'"),
    ("unknown field", _set(["statsu"], "completed"), "unknown field(s) 'statsu'"),
    ("wrong version", _set(["version"], 7), "version: 7 is not a record version"),
    ("bool version", _set(["version"], True), "version: True is not a record version"),
    ("empty id", _set(["trajectory_id"], ""), "trajectory_id: must be a non-empty string"),
    ("id not a string", _set(["trajectory_id"], 7), "trajectory_id: must be a non-empty"),
    ("negative repetition", _set(["repetition"], -1), "repetition: must be a non-negative"),
    ("bool repetition", _set(["repetition"], True), "repetition: must be a non-negative"),
    ("float repetition", _set(["repetition"], 1.0), "repetition: must be a non-negative"),
    ("bad status", _set(["status"], "done"), "status: must be one of pending | running"),
    ("unhashable status", _set(["status"], ["completed"]), "status: must be one of"),
    ("bad stage", _set(["failure_stage"], "disk"), "failure_stage: must be one of init"),
    ("stage without error", _set(["failure_stage"], "tool"), "failure_stage: must be set "
                                                              "exactly when status is 'error'"),
    ("bool reward", _set(["reward"], True), "reward: must be a number"),
    ("string reward", _set(["reward"], "1.0"), "reward: must be a number"),
    ("metrics not object", _set(["metrics"], [1]), "metrics: must be a JSON object"),
    ("metric not number", _set(["metrics", "exact_match"], "yes"), "metrics.exact_match: must "
                                                                     "be a number"),
    ("infinite metric", _set(["metrics", "exact_match"], math.inf), "metrics.exact_match: "
                                                                      "must be finite"),
    ("infra flag wrong", _set(["infra_failure"], True), "infra_failure: must be False"),
    ("output tokens wrong", _set(["output_tokens"], 99), "output_tokens: 99 is not the sum"),
    ("turns not array", _set(["turns"], {}), "turns: must be an array"),
    ("turn not object", _set(["turns", 1], 5), "turns[1]: must be a JSON object"),
    ("turn field", _set(["turns", 1, "queued_s"], None), "turns[1].queued_s: must be a number"),
    ("tool latency", _set(["turns", 0, "tool_call", "latency_s"], "0.5"),
     "turns[0].tool_call.latency_s: must be a number"),
    ("tool arguments", _set(["turns", 0, "tool_call", "arguments"], "x=1"),
     "turns[0].tool_call.arguments: must be a JSON object"),
    ("tool unknown", _set(["turns", 0, "tool_call", "stdout"], ""),
     "turns[0].tool_call: unknown field(s) 'stdout'"),
    ("token not int", _set(["segments", 0, "response_ids", 2], 4.0),
     "segments[0].response_ids[2]: must be a non-negative integer"),
    ("negative token", _set(["segments", 0, "prompt_ids", 0], -3),
     "segments[0].prompt_ids[0]: must be a non-negative integer"),
    ("NaN logprob", _set(["segments", 0, "logprobs", 3], math.nan),
     "segments[0].logprobs[3]: must be finite"),
    ("bool logprob", _set(["segments", 0, "logprobs", 1], False),
     "segments[0].logprobs[1]: must be a number"),
    ("short mask", _set(["segments", 0, "loss_mask"], [1, 1, 0]),
     "segments[0]: segment lengths differ"),
    ("mask value", _set(["segments", 0, "loss_mask", 0], 2), "segments[0]: loss_mask[0] = 2"),
    ("logprob at mask 0", _set(["segments", 0, "logprobs", 2], -1.0),
     "segments[0]: logprobs[2] = -1.0 where loss_mask is 0"),
    ("timings missing", _set(["timings"], {"llm_s": 0.0}), "timings: missing field(s)"),
    ("not an object", lambda r: r.clear(), "record: missing field(s)"),
]


@pytest.mark.parametrize(("mutate", "message"), [(m, msg) for _, m, msg in BAD_RECORDS],
                         ids=[name for name, _, _ in BAD_RECORDS])
def test_bad_record_raises_naming_the_field(mutate: Callable[[dict[str, Any]], None],
                                            message: str) -> None:
    record = _base_record()
    trajectory_from_record(copy.deepcopy(record))  # the base is valid
    mutate(record)
    with pytest.raises(RecordError) as info:
        trajectory_from_record(record)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_error_record_rules() -> None:
    record = _base_record()
    record.update(status="error", failure_stage="engine", infra_failure=True, reward=None)
    assert trajectory_from_record(record).infra_failure
    record["reward"] = 0.0
    with pytest.raises(RecordError, match="reward: must be null for status 'error'"):
        trajectory_from_record(record)
    record.update(reward=None, failure_stage=None)
    with pytest.raises(RecordError, match="failure_stage: must be set exactly"):
        trajectory_from_record(record)


def test_writer_refuses_what_the_reader_would_refuse() -> None:
    no_stage = Trajectory("t", GroupKey("g", 0), status=TrajectoryStatus.ERROR)
    with pytest.raises(RecordError, match="failure_stage"):
        trajectory_to_record(no_stage)
    scored_error = Trajectory("t", GroupKey("g", 0), status=TrajectoryStatus.ERROR,
                              failure_stage=FailureStage.EVAL, reward=0.0)
    with pytest.raises(RecordError, match="reward: must be null"):
        trajectory_to_record(scored_error)
    bad_segment = Trajectory("t", GroupKey("g", 0),
                             segments=[TokenSegment([1], [2, 3], [1], [0.0], [0])])
    with pytest.raises(RecordError, match=r"segments\[0\]: segment lengths differ"):
        trajectory_to_record(bad_segment)
    nan_reward = Trajectory("t", GroupKey("g", 0), status=TrajectoryStatus.COMPLETED,
                            reward=math.nan)
    with pytest.raises(RecordError, match="cannot be JSON"):
        dumps_record(trajectory_to_record(nan_reward))


def test_loads_record_names_bad_json() -> None:
    with pytest.raises(RecordError, match="not JSON"):
        loads_record("{truncated")
    with pytest.raises(RecordError, match="record: must be a JSON object"):
        loads_record(json.dumps([1, 2]))
