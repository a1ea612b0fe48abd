"""Merging idle engines for the long tail (`core.policies.tail_merge`), decided by
treadle's policy and carried out by the simulator: the merge is priced by the cost
model, the tail moves to the new engine (in a tool gap or out of a running turn),
and the step ends sooner than on the pool it started with."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from treadle.cli import main
from treadle.core.cost_model import CostModel
from treadle.core.events import AddEngine, Decision, Event
from treadle.core.policies import build_policy, parse_policy
from treadle.core.policies.tail_merge import idle_engines, plan_merge, tokens_left
from treadle.core.policies.treadle_policy import Treadle
from treadle.core.scheduler import EngineState, Phase, Scheduler, TrajState
from treadle.sim.cluster import Cluster
from treadle.sim.runner import MAX_BATCH, outcomes
from treadle.workloads import TrajectorySpec, TurnSpec, Workload


@functools.cache
def _cost() -> CostModel:
    return CostModel.named("qwen3-14b", "h100")


def _tail_workload(long_turns: int, tokens: int, tool_s: float = 2.0) -> Workload:
    """Three one-turn trajectories and one of `tokens` in `long_turns` turns with
    `tool_s` tool calls between them: on four TP-1 engines, three fall idle at once."""
    short = [TrajectorySpec(f"s{i}", f"g{i}", 200, (TurnSpec(100, 0.0, 0),))
             for i in range(3)]
    each = tokens // long_turns
    turns = (*(TurnSpec(each, tool_s, 50) for _ in range(long_turns - 1)),
             TurnSpec(each, 0.0, 0))
    return Workload("tail", (*short, TrajectorySpec("long", "g9", 200, turns)))


def _run(workload: Workload, *, reconfigure: bool) -> tuple[Treadle, float]:
    """The oracle (treadle's policy with the true lengths) on four TP-1 engines."""
    truth = dict(zip((t.traj_id for t in workload.trajectories), outcomes(workload),
                     strict=True))
    policy = build_policy(parse_policy("oracle"), _cost(), batch_size=4, truth=truth,
                          layout=(1, 1, 1, 1), max_batch=MAX_BATCH, reconfigure=reconfigure)
    assert isinstance(policy, Treadle)
    cluster = Cluster(_cost(), 4, policy, list(workload.trajectories), [1, 1, 1, 1],
                      max_batch=MAX_BATCH)
    result = cluster.run()
    assert result.output_tokens == sum(t.output_tokens for t in outcomes(workload))
    return policy, result.makespan_s


@pytest.mark.parametrize("turns", [20, 1], ids=["moved-in-a-tool-gap", "moved-while-running"])
def test_idle_engines_merge_into_one_of_tp_2_and_the_tail_finishes_sooner(turns: int) -> None:
    workload = _tail_workload(turns, 20_000)
    merged, merged_s = _run(workload, reconfigure=True)
    _, plain_s = _run(workload, reconfigure=False)
    assert [(m.tp, len(m.drain), m.moved) for m in merged.merges] == [(2, 2, ("long",))]
    # Once the long one is done, the TP-2 engine is split back into the two TP-1 ones
    # it replaced, for the next batch.
    assert merged.splits == 1 and merged.merged_engines == {}
    assert sorted(e.tp for e in merged.engines.values()) == [1, 1, 1, 1]
    first = merged.merges[0]
    assert first.finish_merged_s < first.finish_now_s
    # 20,000 tokens at 13.1 ms (TP 1) against a 20 s restart and 8.2 ms (TP 2).
    assert merged_s < 0.8 * plain_s, (merged_s, plain_s)


def test_a_tail_too_short_to_pay_for_the_restart_is_left_where_it_is() -> None:
    workload = _tail_workload(2, 2_000)  # 26 s at TP 1
    merged, merged_s = _run(workload, reconfigure=True)
    _, plain_s = _run(workload, reconfigure=False)
    assert merged.merges == []
    assert merged_s == plain_s


class _NoLaunches(Scheduler):
    """Test double: a driver whose launches never come up (every `AddEngine` of
    `inner` is dropped; the rest passes through)."""

    def __init__(self, inner: Treadle) -> None:
        self.inner = inner

    def on_event(self, event: Event, now: float) -> None:
        self.inner.on_event(event, now)

    def decide(self, now: float) -> list[Decision]:
        return [d for d in self.inner.decide(now) if not isinstance(d, AddEngine)]

    def wakeup(self) -> float | None:
        return self.inner.wakeup()


def test_a_merge_whose_engine_never_comes_up_is_given_up_and_merged_again() -> None:
    short = [TrajectorySpec(f"s{i}", f"g{i}", 200, (TurnSpec(100, 0.0, 0),)) for i in range(7)]
    turns = (*(TurnSpec(1000, 2.0, 50) for _ in range(39)), TurnSpec(1000, 0.0, 0))
    workload = Workload("tail", (*short, TrajectorySpec("long", "g9", 200, turns)))
    truth = dict(zip((t.traj_id for t in workload.trajectories), outcomes(workload),
                     strict=True))
    policy = build_policy(parse_policy("oracle"), _cost(), batch_size=8, truth=truth,
                          layout=(1,) * 8, max_batch=MAX_BATCH)
    assert isinstance(policy, Treadle)
    Cluster(_cost(), 8, _NoLaunches(policy), list(workload.trajectories), [1] * 8,
            max_batch=MAX_BATCH).run()
    # Seven idle engines: four drained for a TP-4 engine that never comes; ten of its
    # restarts later it is given up, and the three left idle are merged (a TP-2 one).
    assert [(m.tp, len(m.drain)) for m in policy.merges] == [(4, 4), (2, 2)]
    assert policy.merged_engines == {} and policy.splits == 0


def _traj(tid: str, engine: str, phase: Phase, context: int, admitted_at: float = 0.0) -> TrajState:
    return TrajState(tid, "g", 100, 0.0, context_tokens=context, phase=phase,
                     engine_id=engine, admitted_at=admitted_at)


def test_tokens_left_count_what_a_running_turn_decoded_and_stop_at_the_context_limit() -> None:
    limit = _cost().model.max_context
    tool = _traj("a", "e0", Phase.TOOL, 1000)
    running = _traj("b", "e0", Phase.RUNNING, 1000, admitted_at=10.0)
    assert tokens_left(tool, 5000.0, 0.01, 20.0, limit) == 5000.0
    assert tokens_left(running, 5000.0, 0.01, 20.0, limit) == 4000.0  # 10 s at 10 ms
    assert tokens_left(tool, 1e9, 0.01, 20.0, limit) == limit - 1000
    assert tokens_left(running, 100.0, 0.01, 20.0, limit) == 1.0  # never below one


def test_only_engines_with_nothing_placed_on_them_are_drained() -> None:
    engines = [EngineState(f"e{i}", 1, 64, 100_000) for i in range(4)]
    engines[1].running.add("x")
    engines[3].draining = True
    live = [_traj("x", "e1", Phase.RUNNING, 500), _traj("y", "e2", Phase.TOOL, 500)]
    assert [e.engine_id for e in idle_engines(engines, live)] == ["e0"]
    # One idle TP-1 engine sums to no larger degree: no merge, however long the tail.
    assert plan_merge(live, engines, _cost(), lambda t: 30_000.0, 0.0) is None


def test_the_bench_runs_treadle_on_every_pool_with_and_without_merges(tmp_path: Path) -> None:
    out = tmp_path / "reconfigure.json"
    assert main(["bench", "reconfigure", "--workloads", "pareto", "--trajectories", "32",
                 "--gpus", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    [row] = report["workloads"]
    assert set(row["verl_by_tp"]) == {"1", "2", "4", "8"}
    assert row["best_baseline_s"] == min(row["verl_by_tp"].values())
    runs = row["runs"]
    assert [(r["pool"], r["reconfigure"]) for r in runs] == [
        (pool, merged) for pool in ("tp1", "tp2", "tp4", "tp8", "chosen")
        for merged in (False, True)]
    for plain, merged in zip(runs[::2], runs[1::2], strict=True):
        assert plain["merges"] == [] and plain["layout"] == merged["layout"]
        assert merged["over_plain"] == merged["makespan_s"] / plain["makespan_s"]
    assert [r["merges"] for r in runs if r["pool"] == "tp8"] == [[], []]  # nothing larger
    assert row["treadle_over_best"] == row["best_baseline_s"] / runs[-1]["makespan_s"]


def test_the_bench_refuses_bad_settings_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "reconfigure", "--workloads", "nope"]) == 2
    assert main(["bench", "reconfigure", "--gpus", "12"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["treadle: error: unknown workload 'nope'; choose from coding, search, "
                   "math, swe, pareto, bimodal, flat, short",
                   "treadle: error: --trajectories must be a multiple of 16 and --gpus of 8"]


def _splits(late: bool) -> tuple[int, int]:
    """The tail workload, a trajectory parked in a 3,000 s tool call beside it, and,
    if `late`, one more arriving at 100 s (as a continuous job keeps launching
    groups): the merged engines split back while "waiting" is still out, and in all."""
    tail = _tail_workload(20, 20_000)
    waiting = TrajectorySpec("waiting", "g8", 200,
                             (TurnSpec(100, 3_000.0, 50), TurnSpec(100, 0.0, 0)))
    later = TrajectorySpec("later", "g7", 200, (TurnSpec(100, 0.0, 0),))
    workload = Workload("tail", (*tail.trajectories[:2], waiting, tail.trajectories[3],
                                 later))
    truth = dict(zip((t.traj_id for t in workload.trajectories), outcomes(workload),
                     strict=True))
    policy = build_policy(parse_policy("oracle"), _cost(), batch_size=4, truth=truth,
                          layout=(1, 1, 1, 1), max_batch=MAX_BATCH)
    assert isinstance(policy, Treadle)
    cluster = Cluster(_cost(), 4, policy, list(workload.trajectories[:4]), [1, 1, 1, 1],
                      max_batch=MAX_BATCH)
    if late:
        cluster.kernel.at(100.0, lambda: cluster.launch(later))
    cluster.kernel.run(until=2_999.0)  # "waiting" is in its tool call until 3,000 s
    while_out = policy.splits
    cluster.run()
    assert [(m.tp, m.moved) for m in policy.merges] == [(2, ("long",))]
    assert policy.merged_engines == {}
    assert sorted(e.tp for e in policy.engines.values()) == [1, 1, 1, 1]
    return while_out, policy.splits


def test_a_merged_engine_is_split_back_once_its_tail_ends_if_new_work_arrived() -> None:
    """With trajectories arriving after the merge (a continuous job), the merged
    engine is split back when its tail ends, while others still run; with none
    (one synchronous step), it is kept until nothing is left."""
    assert _splits(late=True) == (1, 1)  # split while "waiting" is still out
    assert _splits(late=False) == (0, 1)  # split once nothing is left
