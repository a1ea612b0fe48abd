"""The simulator's driver (`treadle.sim.cluster`) and runner (`treadle.sim.runner`):
every policy finishes every trajectory, runs are deterministic, the scheduler never
hears of the future, token counts add up, and `compare` reports against the bound."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from treadle.core.cost_model import GPUS, MODELS, CostModel, GpuSpec
from treadle.core.events import (
    Admit,
    Decision,
    Event,
    Migrate,
    Preempt,
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryArrived,
    TurnFinished,
    TurnPreempted,
)
from treadle.core.lower_bound import lower_bound
from treadle.core.policies import build_policy, parse_policy
from treadle.core.scheduler import Scheduler, TrajectoryScheduler
from treadle.sim.cluster import Cluster
from treadle.sim.runner import MAX_BATCH, compare, history_for, outcomes, simulate
from treadle.workloads import TrajectorySpec, TurnSpec, Workload, generate

POLICIES = ("slime", "verl", "verl-star", "heddle", "treadle", "oracle", "verl@tp8")


@functools.cache
def _cost() -> CostModel:
    return CostModel.named("qwen3-14b", "h100")


@functools.cache
def _tiny_kv_cost() -> CostModel:
    """Qwen3-8B on an H100 with memory for only ~4,000 KV tokens at TP 1, so the
    engines run out of KV and evict."""
    m, h100 = MODELS["qwen3-8b"], GPUS["h100"]
    p = CostModel(m, h100).params
    hbm = (m.weight_bytes + p.activation_reserve_bytes + 4000.5 * m.kv_bytes_per_token) / (
        p.memory_utilization)
    return CostModel(m, GpuSpec("tiny", hbm, h100.hbm_bw, h100.bf16_flops, h100.nvlink_bw,
                                "test double"))


# -- a spy around a real policy -------------------------------------------------------------


@dataclass
class SpyScheduler(Scheduler):
    """Test double: forwards everything to a real policy and records every event and
    decision, in call order, with the time the driver gave it."""

    inner: TrajectoryScheduler
    log: list[tuple[float, Event | Decision]] = field(default_factory=list)

    @property
    def events(self) -> list[tuple[float, Event]]:
        return [(now, x) for now, x in self.log if not isinstance(x, Decision)]

    def on_event(self, event: Event, now: float) -> None:
        self.log.append((now, event))
        self.inner.on_event(event, now)

    def decide(self, now: float) -> list[Decision]:
        out = self.inner.decide(now)
        self.log += [(now, d) for d in out]
        return out

    def wakeup(self) -> float | None:
        return self.inner.wakeup()

    @property
    def preemptions(self) -> int:
        return self.inner.preemptions

    @property
    def migrations(self) -> int:
        return self.inner.migrations


def run_spied(workload: Workload, policy: str, cost: CostModel, gpus: int,
              warm: bool) -> tuple[SpyScheduler, Cluster]:
    spec = parse_policy(policy)
    n = len(workload.trajectories)
    history = history_for(workload.name, n, 0) if warm else []
    truth = dict(zip((t.traj_id for t in workload.trajectories), outcomes(workload),
                     strict=True)) if spec.name == "oracle" else None
    inner = build_policy(spec, cost, batch_size=n, history=history, truth=truth,
                         max_batch=MAX_BATCH)
    pool: list[int] = inner.initial_pool(gpus)  # type: ignore[attr-defined]
    spy = SpyScheduler(inner)
    cluster = Cluster(cost, gpus, spy, list(workload.trajectories), pool, max_batch=MAX_BATCH)
    cluster.run()
    return spy, cluster


Scenario = tuple[Callable[[], Workload], Callable[[], CostModel], int, bool]
SCENARIOS: dict[str, Scenario] = {
    # name: (workload, cost, GPUs, warm start)
    "swe-warm": (lambda: generate("swe", 32, seed=0), _cost, 8, True),
    "coding-cold-16gpu": (lambda: generate("coding", 32, seed=1), _cost, 16, False),
    "math-warm": (lambda: generate("math", 32, seed=2), _cost, 8, True),
    "search-tiny-kv": (lambda: generate("search", 64, seed=0, max_context=2000),
                       _tiny_kv_cost, 8, False),
}


def check_no_future_leak(spy: SpyScheduler, workload: Workload, cost: CostModel) -> None:
    times = [t for t, _ in spy.events]
    assert times == sorted(times), "events out of time order"
    specs = {t.traj_id: t for t in workload.trajectories}
    by_traj: dict[str, list[tuple[float, object]]] = defaultdict(list)
    for now, logged in spy.log:  # call order: a decision follows the events it answers
        tid = getattr(logged, "traj_id", None)
        if tid is not None and (isinstance(logged, Admit) or not isinstance(logged, Decision)):
            by_traj[tid].append((now, logged))
    assert set(by_traj) == set(specs)
    for tid, spec in specs.items():
        log = by_traj[tid]
        first_now, first = log[0]
        assert isinstance(first, TrajectoryArrived) and first_now == 0.0
        assert first.prompt_tokens == spec.prompt_tokens and first.group_id == spec.group_id
        turn, context = 0, float(spec.prompt_tokens)
        turn_admitted: float | None = None
        engine: str | None = None
        tool_started: float | None = None
        turn_end = -1.0
        finished = False
        for now, item in log[1:]:
            assert not finished, f"{tid}: {item} after its last turn"
            if isinstance(item, Admit):
                assert tool_started is None, f"{tid}: admitted inside a tool call"
                if turn_admitted is None:
                    turn_admitted = now
                engine = item.engine_id
            elif isinstance(item, TurnPreempted):
                assert item.engine_id == engine
                assert 0 <= item.output_tokens_so_far < spec.turns[turn].output_tokens
            elif isinstance(item, TurnFinished):
                assert turn_admitted is not None, f"{tid}: turn {turn} finished unadmitted"
                shape: TurnSpec = spec.turns[turn]
                assert item.output_tokens == shape.output_tokens
                assert item.engine_id == engine
                assert item.final == (turn == len(spec.turns) - 1)
                context += shape.output_tokens
                assert abs(item.context_tokens - context) <= 1, (tid, turn)
                # Sampling takes at least the fastest per-token time of any engine.
                floor = turn_admitted + shape.output_tokens * cost.min_step_time(
                    context - shape.output_tokens)
                assert now >= floor * (1 - 1e-12), (tid, turn, now, floor)
                finished = item.final
                turn_admitted = None
                turn_end = now
            elif isinstance(item, ToolCallStarted):
                assert now == turn_end
                tool_started = now
            elif isinstance(item, ToolCallFinished):
                assert tool_started is not None
                shape = spec.turns[turn]
                assert now - tool_started == pytest.approx(shape.tool_latency_s, abs=1e-9)
                assert item.latency_s == shape.tool_latency_s
                assert item.output_tokens == shape.tool_output_tokens
                context += shape.tool_output_tokens
                tool_started = None
                turn += 1
            else:  # pragma: no cover - the cluster sends nothing else per trajectory
                raise AssertionError(f"unexpected {item!r}")
        assert finished and turn == len(spec.turns) - 1, tid


def check_nothing_left_over(spy: SpyScheduler, cluster: Cluster) -> None:
    """After the run, no engine holds a running sequence or KV, and the scheduler
    has nothing running or queued anywhere."""
    for eng in cluster.all_engines:
        assert not eng.running, eng.engine_id
        assert eng.kv_used() == pytest.approx(0.0, abs=1e-6), eng.engine_id
    for e in spy.inner.engines.values():
        assert not e.running and e.queued == 0 and e.kv_reserved == 0, e.engine_id
    assert not spy.inner.unrouted


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_policy_finishes_every_trajectory_and_never_sees_the_future(
        scenario: str, policy: str) -> None:
    make_workload, make_cost, gpus, warm = SCENARIOS[scenario]
    workload, cost = make_workload(), make_cost()
    spy, cluster = run_spied(workload, policy, cost, gpus, warm)
    assert all(st.finished_at is not None for st in cluster.trajs.values())
    check_no_future_leak(spy, workload, cost)
    check_nothing_left_over(spy, cluster)
    # Output tokens the scheduler was told of add up to the workload's, per trajectory.
    told: dict[str, int] = defaultdict(int)
    for _, ev in spy.events:
        if isinstance(ev, TurnFinished):
            told[ev.traj_id] += ev.output_tokens
    assert told == {t.traj_id: t.output_tokens for t in workload.trajectories}


def test_tiny_kv_scenario_really_evicts() -> None:
    """Guards the scenario above: it must exercise engine-side eviction."""
    make_workload, make_cost, gpus, _ = SCENARIOS["search-tiny-kv"]
    report, result = simulate(make_workload(), "slime", make_cost(), gpus)
    assert result.kv_evictions > 0
    assert report.kv_evictions == result.kv_evictions


@pytest.mark.parametrize("policy", POLICIES)
def test_results_count_the_workloads_tokens(policy: str) -> None:
    workload = generate("coding", 32, seed=4)
    report, result = simulate(workload, policy, _cost(), 8)
    assert result.output_tokens == workload.stats().total_output_tokens
    assert report.tokens_per_s == pytest.approx(result.output_tokens / result.makespan_s)
    assert 0.0 < result.utilisation <= 1.0 + 1e-9
    assert result.longest_traj_id == max(workload.trajectories,
                                         key=lambda t: (t.output_tokens, t.traj_id)).traj_id


# -- determinism -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_same_workload_and_seed_give_the_same_trace(policy: str) -> None:
    history = history_for("swe", 32, 0)
    runs = [simulate(generate("swe", 32, seed=0), policy, _cost(), 8, history=history, seed=0)
            for _ in range(2)]
    (r1, s1), (r2, s2) = runs
    assert r1.trace_digest == r2.trace_digest
    assert r1.makespan_s == r2.makespan_s
    assert s1.events == s2.events
    assert (r1.preemptions, r1.migrations, r1.kv_evictions) == (
        r2.preemptions, r2.migrations, r2.kv_evictions)
    other, _ = simulate(generate("swe", 32, seed=1), policy, _cost(), 8,
                        history=history_for("swe", 32, 1), seed=1)
    assert other.trace_digest != r1.trace_digest


def test_trace_digest_is_a_sha256_hex() -> None:
    report, _ = simulate(generate("math", 16, seed=0), "verl", _cost(), 8)
    assert len(report.trace_digest) == 64
    int(report.trace_digest, 16)


# -- the cluster's own checks ----------------------------------------------------------------


def test_cluster_rejects_a_pool_larger_than_the_cluster() -> None:
    w = generate("math", 16, seed=0)
    with pytest.raises(ValueError, match="GPUs"):
        Cluster(_cost(), 8, parse_and_build("slime"), list(w.trajectories), [4, 4, 1])


def parse_and_build(policy: str) -> TrajectoryScheduler:
    return build_policy(parse_policy(policy), _cost(), batch_size=16)


def test_one_trajectory_alone_runs_prefill_decode_and_tool_back_to_back() -> None:
    cost = _cost()
    traj = TrajectorySpec("t", "g", 500, (TurnSpec(800, 3.0, 100), TurnSpec(200, 0.0, 0)))
    _, result = simulate(Workload("one", (traj,)), "verl", cost, 1)
    expected = (cost.prefill_time(1, 500) + cost.decode_time(1, 1, 500, 800) + 3.0
                + cost.prefill_time(1, 100, 1300) + cost.decode_time(1, 1, 1400, 200))
    assert result.makespan_s == pytest.approx(expected, rel=1e-9)
    assert result.kv_evictions == 0 and result.migrations == 0


class FakeScriptedScheduler(Scheduler):
    """Test double: one trajectory "a", moved from e000 to e001 in its tool gap,
    admitted on e001 while its KV is still in flight and preempted at once (both
    legal decisions), then admitted again a second later."""

    def __init__(self) -> None:
        self.pending: list[Decision] = []
        self.readmit_at: float | None = None

    def on_event(self, event: Event, now: float) -> None:
        if isinstance(event, TrajectoryArrived):
            self.pending.append(Admit("a", "e000", 0.0))
        elif isinstance(event, ToolCallStarted):
            self.pending.append(Migrate("a", "e000", "e001"))
        elif isinstance(event, ToolCallFinished):
            self.pending += [Admit("a", "e001", 0.0), Preempt("a", "e001")]
            self.readmit_at = now + 1.0

    def decide(self, now: float) -> list[Decision]:
        if self.readmit_at is not None and now >= self.readmit_at:
            self.pending.append(Admit("a", "e001", 0.0))
            self.readmit_at = None
        out, self.pending = self.pending, []
        return out

    def wakeup(self) -> float | None:
        return self.readmit_at


def test_preempting_a_turn_whose_kv_is_in_flight_cancels_its_join() -> None:
    """Regression: the deferred join still ran after the Preempt, and the next Admit
    joined the turn a second time, leaking its context in the engine's KV."""
    cost = _cost()
    # 30K tokens of KV take ~0.3 s to move; the tool call takes 0.01 s.
    traj = TrajectorySpec("a", "g", 30_000, (TurnSpec(100, 0.01, 10), TurnSpec(2000, 0.0, 0)))
    sched = FakeScriptedScheduler()
    cluster = Cluster(cost, 2, sched, [traj], [1, 1])
    result = cluster.run()
    for eng in cluster.all_engines:
        assert eng.kv_used() == pytest.approx(0.0, abs=1e-6), eng.engine_id
    # The second turn starts at the re-admission, a second after the tool returned,
    # on the KV that landed meanwhile: only the 10 observation tokens are prefilled.
    tool_back = (cost.prefill_time(1, 30_000) + cost.decode_time(1, 1, 30_000, 100) + 0.01)
    expected = (tool_back + 1.0 + cost.prefill_time(1, 10, 30_100)
                + cost.decode_time(1, 1, 30_110, 2000))
    assert result.makespan_s == pytest.approx(expected, rel=1e-9)
    assert result.migrations == 0  # a test double keeps no count


class FakeTwoMovesScheduler(Scheduler):
    """Test double: trajectory "a" starts on e000; in its tool gap it is moved to
    e001 and, `second_after` seconds later while that KV is still in flight, on to
    `then` (or not moved again if None); its next turn is admitted on `admit_on`."""

    def __init__(self, second_after: float, then: str | None, admit_on: str) -> None:
        self.second_after, self.then, self.admit_on = second_after, then, admit_on
        self.pending: list[Decision] = []
        self.second_at: float | None = None

    def on_event(self, event: Event, now: float) -> None:
        if isinstance(event, TrajectoryArrived):
            self.pending.append(Admit("a", "e000", 0.0))
        elif isinstance(event, ToolCallStarted):
            self.pending.append(Migrate("a", "e000", "e001"))
            if self.then is not None:
                self.second_at = now + self.second_after
        elif isinstance(event, ToolCallFinished):
            self.pending.append(Admit("a", self.admit_on, 0.0))

    def decide(self, now: float) -> list[Decision]:
        if self.second_at is not None and now >= self.second_at and self.then is not None:
            self.pending.append(Migrate("a", "e001", self.then))
            self.second_at = None
        out, self.pending = self.pending, []
        return out

    def wakeup(self) -> float | None:
        return self.second_at


# 30K tokens of KV take ~0.3 s to move.
_MOVED = TrajectorySpec("a", "g", 30_000, (TurnSpec(100, 2.0, 10), TurnSpec(2000, 0.0, 0)))


def _first_turn_s(cost: CostModel) -> float:
    return cost.prefill_time(1, 30_000) + cost.decode_time(1, 1, 30_000, 100)


def test_a_second_move_in_one_tool_gap_carries_the_kv_along() -> None:
    """Regression: moving a trajectory again while its KV was in flight found
    nothing cached at the first destination and dropped the KV, so the next turn
    re-prefilled its whole context."""
    cost = _cost()
    sched = FakeTwoMovesScheduler(second_after=0.1, then="e002", admit_on="e002")
    result = Cluster(cost, 3, sched, [_MOVED], [1, 1, 1]).run()
    # The second move starts 0.1 s into the 2 s tool call and lands long before it
    # returns: only the 10 observation tokens are prefilled on e002.
    assert 0.1 + cost.migration_time(30_100) < 2.0
    expected = (_first_turn_s(cost) + 2.0 + cost.prefill_time(1, 10, 30_100)
                + cost.decode_time(1, 1, 30_110, 2000))
    assert result.makespan_s == pytest.approx(expected, rel=1e-9)


def test_a_turn_admitted_away_from_its_moving_kv_does_not_wait_for_it() -> None:
    """Regression: a turn admitted on another engine than its KV's destination
    waited for the transfer it could not use."""
    cost = _cost()
    quick = TrajectorySpec("a", "g", 30_000, (TurnSpec(100, 0.01, 10), TurnSpec(2000, 0.0, 0)))
    sched = FakeTwoMovesScheduler(second_after=0.0, then=None, admit_on="e002")
    result = Cluster(cost, 3, sched, [quick], [1, 1, 1]).run()
    assert cost.migration_time(30_100) > 0.2  # the KV lands well after the tool returns
    expected = (_first_turn_s(cost) + 0.01 + cost.prefill_time(1, 30_110)
                + cost.decode_time(1, 1, 30_110, 2000))
    assert result.makespan_s == pytest.approx(expected, rel=1e-9)


# -- compare ---------------------------------------------------------------------------------


def test_compare_returns_one_row_per_policy_at_or_above_the_bound() -> None:
    workload = generate("search", 32, seed=0)
    cost = _cost()
    policies = ["slime", "verl", "verl-star", "heddle", "treadle", "oracle", "verl@tp8",
                "slime@tp2"]
    progress: list[str] = []
    rows, timeline = compare(workload, policies, cost, 8, history=history_for("search", 32, 0),
                             progress=progress.append)
    assert [r.policy for r in rows] == policies
    assert len(progress) == len(policies)
    assert timeline is None
    bound = lower_bound(workload.trajectories, cost, 8).makespan_s
    for r in rows:
        assert r.lower_bound_s == pytest.approx(bound)
        assert r.ratio_to_lower_bound >= 1.0
        assert r.ratio_to_lower_bound == pytest.approx(r.makespan_s / r.lower_bound_s)
        assert r.makespan_s > 0 and r.tokens_per_s > 0
    by = {r.policy: r for r in rows}
    assert by["verl@tp8"].layout == "tp8x1"
    assert by["slime@tp2"].layout == "tp2x4"
    # The oracle keeps the best of its candidate layouts, its own plan among them.
    own, _ = simulate(workload, "oracle", cost, 8)
    assert by["oracle"].makespan_s <= own.makespan_s


def test_compare_records_the_timeline_policys_spans() -> None:
    workload = generate("math", 16, seed=0)
    rows, timeline = compare(workload, ["slime", "verl"], _cost(), 8, timeline_policy="verl")
    assert len(rows) == 2
    assert timeline is not None and timeline.spans
    assert {s.traj_id for s in timeline.spans} == {t.traj_id for t in workload.trajectories}


def test_an_evicted_turn_never_reports_all_its_tokens_generated() -> None:
    cost = _tiny_kv_cost()
    assert cost.kv_capacity_tokens(1) == 4000
    # 2,999 tokens of context in three sequences: the batch fills the 4,000-token
    # cache 333⅔ steps in, when c (the latest, the victim) is ⅓ of a token short of
    # its 334 tokens.
    trajs = [TrajectorySpec(tid, "g", ctx, (TurnSpec(out, 0.0, 0),))
             for tid, ctx, out in (("a", 1000, 5000), ("b", 1000, 5000), ("c", 999, 334))]
    spy = SpyScheduler(build_policy(parse_policy("slime"), cost, batch_size=3))
    Cluster(cost, 1, spy, trajs, [1]).run()
    evicted = [ev for _, ev in spy.events if isinstance(ev, TurnPreempted)]
    assert evicted and evicted[0].traj_id == "c"
    assert evicted[0].output_tokens_so_far < 334
