"""Synthetic workloads (`treadle.workloads.synthetic`) and traces (`.trace`)."""

from __future__ import annotations

import functools
import itertools
import json
import math
import pickle
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from treadle.workloads import (
    WORKLOADS,
    Percentiles,
    TrajectorySpec,
    TurnSpec,
    Workload,
    generate,
)
from treadle.workloads import synthetic as wl
from treadle.workloads.trace import TraceError, dump_trace, load_trace

HEDDLE_MEAN_TOOL_LATENCY_S = {"coding": 0.41, "search": 1.41, "math": 0.046}


@functools.cache
def _default(name: str, seed: int = 0) -> Workload:
    # Generating the four suites takes ~0.3 s; share them between tests.
    return generate(name, 1024, seed=seed)


# -- generators --------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_workload_other_seed_other(name: str) -> None:
    a = generate(name, 64, seed=7)
    assert a == generate(name, 64, seed=7)
    assert a.trajectories != generate(name, 64, seed=8).trajectories


@pytest.mark.parametrize("name", WORKLOADS)
def test_ids_and_groups(name: str) -> None:
    w = generate(name, 48, seed=3, group_size=16)
    assert w.name == name
    assert len(w.trajectories) == 48
    groups: dict[str, list[str]] = {}
    for t in w.trajectories:
        groups.setdefault(t.group_id, []).append(t.traj_id)
    assert len(groups) == 3
    assert all(len(ids) == 16 for ids in groups.values())
    assert w.trajectories[0].traj_id == f"{name}-s3-g0000-r00"
    # Siblings are adjacent, in repetition order.
    assert [t.group_id for t in w.trajectories[:16]] == [f"{name}-s3-g0000"] * 16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"trajectories": 100}, "multiple of group_size 16"),
        ({"trajectories": 0}, "positive multiple"),
        ({"trajectories": 30, "group_size": 8}, "multiple of group_size 8"),
        ({"group_size": 0}, "group_size must be >= 1"),
        ({"max_context": 1}, "max_context must be >= 2"),
    ],
)
def test_generate_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate("coding", **kwargs)


def test_generate_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"unknown workload 'chess'.*coding, search, math, swe"):
        generate("chess")


@pytest.mark.parametrize("name", WORKLOADS)
def test_more_trajectories_extend_the_workload(name: str) -> None:
    assert generate(name, 64).trajectories == generate(name, 128).trajectories[:64]


def test_group_size_one_and_other_sizes() -> None:
    assert len({t.group_id for t in generate("math", 5, group_size=1).trajectories}) == 5
    assert generate("search", 24, group_size=8).stats().groups == 3


@pytest.mark.parametrize("name", WORKLOADS)
def test_siblings_have_similar_lengths(name: str) -> None:
    # The per-group difficulty factor must dominate: the variance of log output
    # length inside a group is well under the variance between group means.
    groups: dict[str, list[float]] = {}
    for t in _default(name).trajectories:
        groups.setdefault(t.group_id, []).append(math.log(t.output_tokens))
    within = statistics.mean(statistics.pvariance(v) for v in groups.values())
    between = statistics.pvariance([statistics.mean(v) for v in groups.values()])
    assert within < 0.5 * between


@pytest.mark.parametrize("name", ["coding", "search", "swe"])
def test_successive_turns_are_correlated(name: str) -> None:
    # AR(1) noise within a trajectory: neighbouring turns differ less than turns
    # two apart. Differences cancel the group and trajectory factors; for AR(1)
    # E[(x[k+2]-x[k])²] / E[(x[k+1]-x[k])²] = 1 + ρ, and 1 if turns were independent.
    lag1: list[float] = []
    lag2: list[float] = []
    for t in _default(name).trajectories:
        # Skip the first turn (scaled up) and the last (it may be cut at the cap).
        logs = [math.log(u.output_tokens) for u in t.turns[1:-1]]
        lag1 += [(b - a) ** 2 for a, b in itertools.pairwise(logs)]
        lag2 += [(b - a) ** 2 for a, b in zip(logs, logs[2:], strict=False)]
    assert statistics.mean(lag2) > 1.25 * statistics.mean(lag1)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(HEDDLE_MEAN_TOOL_LATENCY_S))
def test_mean_tool_latency_matches_heddle(name: str, seed: int) -> None:
    target = HEDDLE_MEAN_TOOL_LATENCY_S[name]
    measured = _default(name, seed).stats().mean_tool_latency_s
    assert abs(measured - target) <= 0.1 * target, (name, measured, target)


def test_swe_tool_latency_mixture() -> None:
    latencies = [u.tool_latency_s for t in _default("swe").trajectories for u in t.turns[:-1]]
    assert min(latencies) >= 0.1 and max(latencies) <= 90.0
    slow = sum(1 for x in latencies if x >= 10.0) / len(latencies)
    assert 0.1 < slow < 0.2  # test runs are a minority
    assert statistics.median(latencies) < 1.0  # most calls are fast reads/edits


@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("cap", [40960, 8192, 1500])
def test_context_never_exceeds_max_context(name: str, cap: int) -> None:
    w = _default(name) if cap == 40960 else generate(name, 256, max_context=cap)
    contexts = [t.context_tokens for t in w.trajectories]
    assert max(contexts) <= cap
    for t in w.trajectories:
        assert t.turns[-1].tool_latency_s == 0 and t.turns[-1].tool_output_tokens == 0
        assert all(u.output_tokens >= 1 for u in t.turns)
    if cap < 40960:
        assert cap in contexts  # the cap binds somewhere, and the last turn is cut to fit


@pytest.mark.parametrize("name", WORKLOADS)
def test_raising_the_cap_only_uncuts(name: str) -> None:
    # Each trajectory has its own random stream, so a trajectory that fits under
    # the smaller cap is identical under both.
    small = generate(name, 128, seed=5, max_context=16384)
    large = generate(name, 128, seed=5, max_context=131072)
    fitting = 0
    for a, b in zip(small.trajectories, large.trajectories, strict=True):
        assert a.prompt_tokens == b.prompt_tokens
        if b.context_tokens <= 16384:
            assert a == b
            fitting += 1
        else:
            assert a.context_tokens <= 16384 and a.num_turns <= b.num_turns
            assert a.turns[:-1] == b.turns[: a.num_turns - 1]
    assert fitting > 0


def test_large_cap_shows_the_swe_turn_tail() -> None:
    # The 40K cap cuts swe's 50+ turn tail; the uncapped shape keeps it.
    assert generate("swe", 1024, max_context=131072).stats().turns.max >= 50


def test_tiny_cap_clamps_the_prompt() -> None:
    w = generate("swe", 16, max_context=100)
    assert all(t.prompt_tokens == 99 and t.context_tokens == 100 for t in w.trajectories)
    assert all(t.num_turns == 1 and t.output_tokens == 1 for t in w.trajectories)


@pytest.mark.parametrize("name", WORKLOADS)
def test_shapes_are_long_tailed_and_in_range(name: str) -> None:
    s = _default(name).stats()
    # p99 several times the median; the context cap compresses swe's tail most.
    assert s.output_tokens.p99 >= (2.5 if name == "swe" else 3.0) * s.output_tokens.p50
    lo, hi = {"coding": (2, 8), "search": (3, 12), "math": (1, 4), "swe": (15, 25)}[name]
    typical = s.turns.p50 if name == "swe" else s.turns.mean
    assert lo <= typical <= hi
    prompts = [t.prompt_tokens for t in _default(name).trajectories]
    low, high = (2000, 6000) if name == "swe" else (100, 2000)
    assert low <= min(prompts) and max(prompts) <= high


_DOC = re.compile(
    r"Output tokens per trajectory: p50 ([\d,]+), p90 ([\d,]+), p99 ([\d,]+) \(max ([\d,]+)\)\.\s+"
    r"Turns: mean ([\d.]+) \(p50 (\d+), p90 (\d+), p99 (\d+), max (\d+)\)\. "
    r"Mean tool latency: ([\d.]+) s"
)


@pytest.mark.parametrize("name", WORKLOADS)
def test_docstring_figures_are_current(name: str) -> None:
    # Each generator's docstring quotes its own measured shape; keep it honest.
    doc = getattr(wl, f"_{name}").__doc__
    found = _DOC.search(doc)
    assert found, f"_{name} docstring lacks the measured figures"
    nums = [float(g.replace(",", "")) for g in found.groups()]
    s = _default(name).stats()
    o, t = s.output_tokens, s.turns
    assert nums[:4] == [o.p50, o.p90, o.p99, o.max]
    assert nums[4] == round(t.mean, 2)
    assert nums[5:9] == [t.p50, t.p90, t.p99, t.max]
    assert nums[9] == round(s.mean_tool_latency_s, 3)


# -- data model and stats ----------------------------------------------------------


def _traj(traj_id: str, group: str, outputs: list[int], latency: float = 1.0) -> TrajectorySpec:
    turns = [TurnSpec(o, latency, 10) for o in outputs[:-1]] + [TurnSpec(outputs[-1], 0.0, 0)]
    return TrajectorySpec(traj_id, group, 100, tuple(turns))


def test_trajectory_properties() -> None:
    turns = (TurnSpec(10, 0.5, 7), TurnSpec(20, 1.25, 3), TurnSpec(5, 0, 0))
    t = TrajectorySpec("a", "g", 50, turns)
    assert t.output_tokens == 35
    assert t.tool_time_s == 1.75
    assert t.context_tokens == 50 + 35 + 10
    assert t.num_turns == 3


def test_stats_percentiles_on_a_hand_built_workload() -> None:
    # 100 trajectories with 1..100 output tokens in one turn, plus tool calls on
    # the first ten (two turns each: output i split 1 + (i-1)).
    trajs = [_traj(f"t{i}", f"g{i % 4}", [i]) for i in range(11, 101)]
    trajs += [_traj(f"t{i}", "g0", [1, i - 1] if i > 1 else [1], latency=0.5) for i in range(1, 11)]
    s = Workload("hand", tuple(trajs)).stats()
    assert s.trajectories == 100 and s.groups == 4
    assert (s.output_tokens.p50, s.output_tokens.p90, s.output_tokens.p99) == (50, 90, 99)
    assert s.output_tokens.max == 100 and s.output_tokens.mean == 50.5
    assert s.total_output_tokens == 5050
    assert s.tool_calls == 9 and s.total_turns == 109
    assert s.mean_tool_latency_s == 0.5
    assert (s.turns.p50, s.turns.p90, s.turns.p99, s.turns.max) == (1, 1, 2, 2)
    assert s.tool_time_s.max == 0.5 and s.tool_time_s.p90 == 0.0
    assert s.context_tokens.max == 100 + 100


def test_percentiles_nearest_rank() -> None:
    p = Percentiles.of([5.0, 1.0, 3.0])
    assert (p.p50, p.p90, p.p99, p.max, p.mean) == (3.0, 5.0, 5.0, 5.0, 3.0)
    assert Percentiles.of([7]).p50 == 7
    with pytest.raises(ValueError):
        Percentiles.of([])


def test_stats_without_tool_calls() -> None:
    assert Workload("w", (_traj("a", "g", [3]),)).stats().mean_tool_latency_s == 0.0


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: TurnSpec(0, 0.0, 0), "output_tokens must be >= 1"),
        (lambda: TurnSpec(1, -0.1, 0), "tool_latency_s must be finite and >= 0"),
        (lambda: TurnSpec(1, math.nan, 0), "tool_latency_s must be finite"),
        (lambda: TurnSpec(1, 0.0, -1), "tool_output_tokens must be >= 0"),
        (lambda: TrajectorySpec("a", "g", 10, ()), "at least one turn"),
        (lambda: TrajectorySpec("a", "g", 0, (TurnSpec(1, 0, 0),)), "prompt_tokens 0 is < 1"),
        (lambda: TrajectorySpec("a", "g", 10, (TurnSpec(1, 0.2, 0),)), "last turn"),
        (lambda: Workload("w", ()), "no trajectories"),
        (lambda: Workload("w", (_traj("a", "g", [1]), _traj("a", "h", [2]))), "duplicate"),
    ],
)
def test_constructors_validate(build: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


# -- traces ------------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKLOADS)
def test_trace_round_trip(name: str, tmp_path: Path) -> None:
    w = generate(name, 64, seed=11)
    path = tmp_path / f"{name}.jsonl"
    dump_trace(w, path)
    back = load_trace(path)
    assert back == w  # the name comes back from the file stem
    assert len(path.read_text().splitlines()) == 64


def test_trace_round_trip_is_float_exact(tmp_path: Path) -> None:
    awkward = [0.1 + 0.2, 1e-7, 123456.78901234567, 5e-324, 1.7976931348623157e308, 3.0]
    turns = (*(TurnSpec(1, x, 0) for x in awkward), TurnSpec(1, 0, 0))
    w = Workload("floats", (TrajectorySpec("a", "g", 1, turns),))
    dump_trace(w, tmp_path / "floats.jsonl")
    back = load_trace(tmp_path / "floats.jsonl").trajectories[0].turns
    assert [u.tool_latency_s for u in back[:-1]] == awkward
    assert all(type(u.tool_latency_s) is float for u in back)


def _line(**changes: Any) -> str:
    record: dict[str, Any] = {
        "id": "t0",
        "group": "g0",
        "prompt_tokens": 100,
        "turns": [
            {"output_tokens": 10, "tool_latency_s": 0.5, "tool_output_tokens": 20},
            {"output_tokens": 30, "tool_latency_s": 0.0, "tool_output_tokens": 0},
        ],
    }
    for key, value in changes.items():
        if value is _DROP:
            del record[key]
        else:
            record[key] = value
    return json.dumps(record)


_DROP = object()


def _turn(out: Any = 10, lat: Any = 0.5, obs: Any = 20) -> dict[str, Any]:
    return {"output_tokens": out, "tool_latency_s": lat, "tool_output_tokens": obs}


_LAST = _turn(30, 0.0, 0)

# (bad line, field, fragment of the problem). Each goes on line 3 of a file whose
# line 1 is valid and line 2 is blank.
BAD_LINES: list[tuple[str, str, str]] = [
    ('{"id": "t0", "group": ', "", "malformed JSON"),
    ("[1, 2]", "", "must be a JSON object, got list"),
    ('"just a string"', "", "must be a JSON object, got str"),
    ("1" * 5000, "", "malformed JSON"),  # beyond Python's int digit limit
    ("[" * 100000 + "]" * 100000, "", "malformed JSON"),
    (_line(id=_DROP), "id", "missing"),
    (_line(group=_DROP), "group", "missing"),
    (_line(prompt_tokens=_DROP), "prompt_tokens", "missing"),
    (_line(turns=_DROP), "turns", "missing"),
    (_line(id=7), "id", "must be a string, got int 7"),
    (_line(id=""), "id", "must not be empty"),
    (_line(group=None), "group", "must be a string, got NoneType None"),
    (_line(prompt_tokens="100"), "prompt_tokens", "must be an integer, got str '100'"),
    (_line(prompt_tokens=100.0), "prompt_tokens", "must be an integer, got float 100.0"),
    (_line(prompt_tokens=True), "prompt_tokens", "must be an integer, got bool True"),
    (_line(prompt_tokens=-5), "prompt_tokens", "must be >= 1, got -5"),
    (_line(prompt_tokens=0), "prompt_tokens", "must be >= 1, got 0"),
    (_line(turns={}), "turns", "must be a list, got dict"),
    (_line(turns=[]), "turns", "must hold at least one turn"),
    (_line(turns=[5, _LAST]), "turns[0]", "must be an object, got int 5"),
    (_line(turns=[{"tool_latency_s": 0.5, "tool_output_tokens": 1}, _LAST]),
     "turns[0].output_tokens", "missing"),
    (_line(turns=[{"output_tokens": 1, "tool_output_tokens": 1}, _LAST]),
     "turns[0].tool_latency_s", "missing"),
    (_line(turns=[{"output_tokens": 1, "tool_latency_s": 0.5}, _LAST]),
     "turns[0].tool_output_tokens", "missing"),
    (_line(turns=[_turn(out=0), _LAST]), "turns[0].output_tokens", "must be >= 1, got 0"),
    (_line(turns=[_turn(out=-3), _LAST]), "turns[0].output_tokens", "must be >= 1, got -3"),
    (_line(turns=[_turn(out=2.5), _LAST]), "turns[0].output_tokens", "must be an integer"),
    (_line(turns=[_turn(), _turn(), _turn(lat=-1.0), _LAST]),
     "turns[2].tool_latency_s", "must be >= 0, got -1.0"),
    (_line(turns=[_turn(lat="0.5"), _LAST]), "turns[0].tool_latency_s", "must be a number"),
    (_line(turns=[_turn(lat=False), _LAST]), "turns[0].tool_latency_s", "must be a number"),
    (_line(turns=[_turn(obs=-1), _LAST]), "turns[0].tool_output_tokens", "must be >= 0, got -1"),
    (_line(turns=[_turn(), _turn(30, 0.7, 0)]),
     "turns[1].tool_latency_s", "must be 0 on the last turn, got 0.7"),
    (_line(turns=[_turn(30, 0, 5)]), "turns[0].tool_output_tokens",
     "must be 0 on the last turn, got 5"),
    (_line(id="first"), "id", "duplicate id 'first' (first on line 1)"),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "field", "problem"), BAD_LINES)
def test_bad_trace_line_raises_with_line_and_field(
    bad: str, field: str, problem: str, tmp_path: Path
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(_line(id="first") + "\n\n" + bad + "\n" + _line(id="later") + "\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    err = info.value
    assert (err.line, err.field) == (3, field)
    assert problem in str(err)
    message = str(err)
    assert "\n" not in message and len(message) < 400
    prefix = f"{path}:3: " + (f"field {field!r}: " if field else "")
    assert message.startswith(prefix)


def test_trace_error_message_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    lines = [_line(id=f"t{i}") for i in range(11)]
    lines.append(_line(id="t11", turns=[_turn(), _turn(), _turn(), _turn(lat=-1.0), _LAST]))
    Path("trace.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as info:
        load_trace("trace.jsonl")
    assert str(info.value) == (
        "trace.jsonl:12: field 'turns[3].tool_latency_s': must be >= 0, got -1.0"
    )
    err = pickle.loads(pickle.dumps(info.value))
    assert (err.line, err.field, str(err)) == (12, "turns[3].tool_latency_s", str(info.value))
    assert isinstance(err, ValueError)


def test_trace_non_finite_and_bad_bytes(tmp_path: Path) -> None:
    path = tmp_path / "nan.jsonl"
    path.write_text(_line().replace('"tool_latency_s": 0.5', '"tool_latency_s": NaN') + "\n")
    with pytest.raises(TraceError, match=r"nan\.jsonl:1: field 'turns\[0\].tool_latency_s': "
                       "must be finite, got nan"):
        load_trace(path)
    path.write_text(_line().replace('"tool_latency_s": 0.5', '"tool_latency_s": 1e999') + "\n")
    with pytest.raises(TraceError, match="must be finite, got inf"):
        load_trace(path)
    path.write_bytes(_line().encode() + b"\n" + b'{"id": "\xff"}\n')
    with pytest.raises(TraceError, match=r"nan\.jsonl:2: not valid UTF-8") as info:
        load_trace(path)
    assert info.value.field == ""


def test_trace_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n\n")
    with pytest.raises(TraceError, match=r"empty\.jsonl:0: no trajectories") as info:
        load_trace(path)
    assert info.value.line == 0


def test_trace_skips_blank_lines_and_ignores_unknown_fields(tmp_path: Path) -> None:
    record = json.loads(_line())
    record["reward"] = 1.0
    record["turns"][0]["tool_name"] = "sandbox"
    path = tmp_path / "extra.jsonl"
    path.write_text("\n   \n" + json.dumps(record) + "\r\n\n" + _line(id="t1") + "\n\n")
    w = load_trace(path)
    assert w.name == "extra"
    assert [t.traj_id for t in w.trajectories] == ["t0", "t1"]
    assert w.trajectories[0].turns == (TurnSpec(10, 0.5, 20), TurnSpec(30, 0.0, 0))
    assert type(w.trajectories[0].turns[1].tool_latency_s) is float


def test_trace_accepts_integer_latency(tmp_path: Path) -> None:
    path = tmp_path / "ints.jsonl"
    path.write_text(_line(turns=[_turn(lat=2), _turn(30, 0, 0)]) + "\n")
    turns = load_trace(path).trajectories[0].turns
    assert turns[0].tool_latency_s == 2.0 and type(turns[0].tool_latency_s) is float
