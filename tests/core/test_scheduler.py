"""The shared scheduler bookkeeping (`treadle.core.scheduler`) and the baselines
(`treadle.core.policies.baselines`), driven by hand with events: FCFS queues,
admission caps, routing (pinning vs least loaded vs verl*'s 32x switch), engine
preemption, failure and drain, and policy-name parsing."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from treadle.core.events import (
    Admit,
    Decision,
    DrainEngine,
    EngineAdded,
    EngineFailed,
    EngineRemoved,
    PolicyUpdated,
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryArrived,
    TrajectoryEnded,
    TurnFinished,
    TurnPreempted,
)
from treadle.core.policies import POLICIES, PolicySpec, parse_policy
from treadle.core.policies.baselines import PAPER_CONCURRENCY, Baseline, Slime, Verl, VerlStar
from treadle.core.scheduler import EngineState, Phase, TrajectoryScheduler, TrajState

BIG_KV = 10**9

# -- a test double and helpers ----------------------------------------------------------


class FakeFifoScheduler(TrajectoryScheduler):
    """Test double: FCFS (the default priority), least-loaded routing unless pinned
    to one engine, an optional fixed admission cap, and drains on request."""

    name = "fake-fifo"

    def __init__(self, cap: int | None = None, pin: str | None = None) -> None:
        super().__init__()
        self.cap = cap
        self.pin = pin
        self.drain_requests: list[str] = []

    def route(self, t: TrajState, now: float) -> str | None:
        e = self.engines.get(self.pin) if self.pin is not None else None
        if e is not None and not e.draining:
            return e.engine_id
        return self.least_loaded()

    def admission_cap(self, e: EngineState) -> int:
        return e.max_batch if self.cap is None else min(self.cap, e.max_batch)

    def rebalance(self, now: float) -> None:
        for eid in self.drain_requests:
            self._drain(eid, now)
        self.drain_requests.clear()


def add_engine(s: TrajectoryScheduler, eid: str, tp: int = 1, max_batch: int = 1024,
               now: float = 0.0) -> None:
    s.on_event(EngineAdded(eid, tp, max_batch, BIG_KV), now)


def arrive(s: TrajectoryScheduler, tid: str, now: float = 0.0, prompt: int = 100) -> None:
    s.on_event(TrajectoryArrived(tid, f"g-{tid}", prompt), now)


def admits(decisions: list[Decision]) -> list[tuple[str, str]]:
    return [(d.traj_id, d.engine_id) for d in decisions if isinstance(d, Admit)]


def finish_turn(s: TrajectoryScheduler, tid: str, now: float, final: bool,
                tokens: int = 50) -> None:
    t = s.trajs[tid]
    assert t.engine_id is not None
    s.on_event(TurnFinished(tid, t.engine_id, tokens, t.context_tokens + tokens, final), now)
    if not final:
        s.on_event(ToolCallStarted(tid), now)


def tool_done(s: TrajectoryScheduler, tid: str, now: float, tokens: int = 20) -> None:
    s.on_event(ToolCallFinished(tid, 1.0, tokens), now)


# -- FCFS and admission caps ---------------------------------------------------------------


def test_fcfs_order_on_one_engine() -> None:
    s = FakeFifoScheduler(cap=2)
    add_engine(s, "e0")
    for tid in ("z", "a", "m", "b", "y"):  # arrival order, not id order
        arrive(s, tid)
    assert admits(s.decide(0.0)) == [("z", "e0"), ("a", "e0")]
    assert s.decide(0.0) == []  # nothing changed, nothing decided
    finish_turn(s, "z", 1.0, final=True)
    assert admits(s.decide(1.0)) == [("m", "e0")]
    finish_turn(s, "a", 2.0, final=False)
    assert admits(s.decide(2.0)) == [("b", "e0")]
    tool_done(s, "a", 3.0)  # a's next turn queues behind y
    assert s.decide(3.0) == []
    finish_turn(s, "m", 4.0, final=True)
    assert admits(s.decide(4.0)) == [("y", "e0")]
    finish_turn(s, "b", 5.0, final=True)
    assert admits(s.decide(5.0)) == [("a", "e0")]
    a = s.trajs["a"]
    assert a.turns_done == 1 and a.output_tokens == 50 and a.context_tokens == 170
    assert a.queue_time_s == pytest.approx(0.0 + (5.0 - 3.0))
    assert a.tool_time_s == 1.0


def test_default_priority_is_fcfs_and_admits_carry_it() -> None:
    s = FakeFifoScheduler()
    add_engine(s, "e0")
    arrive(s, "a")
    (d,) = s.decide(0.0)
    assert isinstance(d, Admit) and d.priority == 0.0
    assert s.wakeup() is None


@pytest.mark.parametrize(("tp", "paper_tp", "max_batch", "cap"), [
    (1, 1, 1024, PAPER_CONCURRENCY),
    (1, 1, 64, 64),
    (4, 1, 1024, 4 * PAPER_CONCURRENCY),
    (4, 1, 256, 256),
    (2, 2, 1024, PAPER_CONCURRENCY),
    (8, 2, 1024, 4 * PAPER_CONCURRENCY),
])
def test_baseline_admission_cap_is_respected(tp: int, paper_tp: int, max_batch: int,
                                             cap: int) -> None:
    s = Slime(tp, paper_tp)
    add_engine(s, "e0", tp=tp, max_batch=max_batch)
    n = cap + 37
    for i in range(n):
        arrive(s, f"t{i:04d}")
    first = admits(s.decide(0.0))
    assert [tid for tid, _ in first] == [f"t{i:04d}" for i in range(cap)]
    e = s.engines["e0"]
    assert len(e.running) == cap and e.queued == n - cap and e.load == n
    finish_turn(s, "t0000", 1.0, final=True)
    finish_turn(s, "t0001", 1.0, final=True)
    assert [tid for tid, _ in admits(s.decide(1.0))] == [f"t{cap:04d}", f"t{cap + 1:04d}"]
    assert len(e.running) == cap


def test_baseline_pool_is_homogeneous_and_rejects_too_few_gpus() -> None:
    assert Verl(2, 2).initial_pool(8) == [2, 2, 2, 2]
    assert Slime(8, 1).initial_pool(20) == [8, 8]
    with pytest.raises(ValueError, match="TP-4"):
        VerlStar(4, 1).initial_pool(2)


# -- routing ---------------------------------------------------------------------------------


def _two_engines_with_a_in_a_tool(policy: Baseline) -> Baseline:
    """e0 ends up with 2 running turns and a in a tool call (its KV on e0); e1 has 1."""
    add_engine(policy, "e0")
    add_engine(policy, "e1")
    arrive(policy, "a")
    arrive(policy, "b")
    assert admits(policy.decide(0.0)) == [("a", "e0"), ("b", "e1")]
    finish_turn(policy, "a", 1.0, final=False)
    arrive(policy, "c", 1.0)
    arrive(policy, "d", 1.0)  # tie 1:1, first engine wins
    assert admits(policy.decide(1.0)) == [("c", "e0"), ("d", "e0")]
    assert policy.engines["e0"].load == 2 and policy.engines["e1"].load == 1
    return policy


def test_verl_pins_a_trajectory_to_its_first_engine_across_tool_calls() -> None:
    s = _two_engines_with_a_in_a_tool(Verl(1, 1))
    tool_done(s, "a", 2.0)
    assert admits(s.decide(2.0)) == [("a", "e0")]
    # And again on the next tool call, however unbalanced.
    for i in range(5):
        arrive(s, f"x{i}", 2.5)
    s.decide(2.5)
    finish_turn(s, "a", 3.0, final=False)
    tool_done(s, "a", 4.0)
    assert admits(s.decide(4.0)) == [("a", "e0")]


def test_slime_sends_every_turn_to_the_least_loaded_engine() -> None:
    s = _two_engines_with_a_in_a_tool(Slime(1, 1))
    tool_done(s, "a", 2.0)
    assert admits(s.decide(2.0)) == [("a", "e1")]


def test_verl_routes_afresh_when_its_engine_is_gone() -> None:
    s = _two_engines_with_a_in_a_tool(Verl(1, 1))
    s.on_event(EngineFailed("e0", "xid 79"), 1.5)
    s.decide(1.5)
    assert s.trajs["a"].engine_id is None  # its KV died with the engine
    tool_done(s, "a", 2.0)
    assert admits(s.decide(2.0)) == [("a", "e1")]


def _imbalanced(policy: Baseline, others: int) -> Baseline:
    """a (in a tool call) pinned on e0, which carries `others` turns; e1 carries 1."""
    add_engine(policy, "e0")
    arrive(policy, "a")
    policy.decide(0.0)
    finish_turn(policy, "a", 1.0, final=False)
    for i in range(others):
        arrive(policy, f"x{i:02d}", 1.0)
    add_engine(policy, "e1", now=1.0)
    arrive(policy, "z", 1.0)
    policy.decide(1.0)
    assert policy.engines["e0"].load == others and policy.engines["e1"].load == 1
    return policy


@pytest.mark.parametrize(("others", "engine"), [(32, "e0"), (33, "e1"), (200, "e1")])
def test_verl_star_switches_to_the_least_loaded_above_a_32x_imbalance(others: int,
                                                                       engine: str) -> None:
    s = _imbalanced(VerlStar(1, 1), others)
    tool_done(s, "a", 2.0)
    s.decide(2.0)
    assert s.trajs["a"].engine_id == engine


@pytest.mark.parametrize("others", [32, 33, 200])
def test_verl_never_switches(others: int) -> None:
    s = _imbalanced(Verl(1, 1), others)
    tool_done(s, "a", 2.0)
    s.decide(2.0)
    assert s.trajs["a"].engine_id == "e0"


def test_verl_star_ratio_counts_an_idle_engine_as_one() -> None:
    s = VerlStar(1, 1)
    add_engine(s, "e0")
    arrive(s, "a")
    s.decide(0.0)
    finish_turn(s, "a", 1.0, final=False)
    for i in range(32):
        arrive(s, f"x{i:02d}", 1.0)
    add_engine(s, "e1", now=1.0)  # idle: 32 > 32·max(1, 0) is false
    tool_done(s, "a", 2.0)
    s.decide(2.0)
    assert s.trajs["a"].engine_id == "e0"


def test_least_loaded_weighs_load_by_engine_capacity() -> None:
    s = FakeFifoScheduler()
    add_engine(s, "e0", max_batch=100)
    add_engine(s, "e1", max_batch=400)
    for i in range(4):
        arrive(s, f"t{i}")
    s.decide(0.0)
    # e1 holds 4x the batch: it takes 4 of every 5 turns.
    assert [s.trajs[f"t{i}"].engine_id for i in range(4)] == ["e0", "e1", "e1", "e1"]


def test_least_loaded_ties_go_to_the_first_engine_in_id_order() -> None:
    """Regression: engines used to be iterated in insertion order."""
    s = FakeFifoScheduler()
    add_engine(s, "e1")
    add_engine(s, "e0")
    assert [e.engine_id for e in s.live_engines()] == ["e0", "e1"]
    assert s.least_loaded() == "e0"


def test_turns_wait_unrouted_without_a_live_engine_until_one_comes_up() -> None:
    s = FakeFifoScheduler()
    assert s.least_loaded() is None
    arrive(s, "a", now=0.0)
    arrive(s, "b", now=1.0)
    assert s.decide(1.0) == [] and set(s.unrouted) == {"a", "b"}
    add_engine(s, "e0", now=5.0)
    assert admits(s.decide(5.0)) == [("a", "e0"), ("b", "e0")]
    assert not s.unrouted
    assert s.trajs["a"].queue_time_s == pytest.approx(5.0)
    assert s.trajs["b"].queue_time_s == pytest.approx(4.0)


def test_the_last_engine_failing_leaves_its_turns_unrouted() -> None:
    s = FakeFifoScheduler()
    add_engine(s, "e0")
    arrive(s, "a")
    s.decide(0.0)
    s.on_event(EngineFailed("e0", "gone"), 1.0)
    assert s.decide(1.0) == [] and set(s.unrouted) == {"a"}
    s.on_event(TrajectoryEnded("a", "no engine left"), 2.0)
    assert not s.unrouted and s.trajs["a"].phase is Phase.DONE


# -- engine-side surprises ------------------------------------------------------------------


def test_turn_preempted_requeues_on_the_same_engine_with_its_old_sequence_number() -> None:
    s = FakeFifoScheduler(cap=1)
    add_engine(s, "e0")
    add_engine(s, "e1")
    for tid in ("a", "b", "c", "d"):  # a, c -> e0; b, d -> e1
        arrive(s, tid)
    assert admits(s.decide(0.0)) == [("a", "e0"), ("b", "e1")]
    seq = s.trajs["a"].seq
    finish_turn(s, "b", 0.5, final=True)
    assert admits(s.decide(0.5)) == [("d", "e1")]
    finish_turn(s, "d", 0.6, final=True)
    s.decide(0.6)  # e1 is now idle, e0 still holds c in its queue
    s.on_event(TurnPreempted("a", "e0", 37), 1.0)
    a = s.trajs["a"]
    assert a.phase is Phase.QUEUED and a.engine_id == "e0" and a.seq == seq
    # Its old sequence number puts it ahead of c, which arrived after it.
    assert admits(s.decide(1.0)) == [("a", "e0")]
    assert s.trajs["c"].phase is Phase.QUEUED
    assert s.engines["e0"].queued == 1 and s.engines["e0"].running == {"a"}
    assert a.queue_time_s == 0.0  # re-admitted at once


def test_engine_failed_reroutes_running_and_queued_turns_to_surviving_engines() -> None:
    s = FakeFifoScheduler(cap=1)
    for eid in ("e0", "e1", "e2"):
        add_engine(s, eid)
    for tid in ("a", "b", "c", "d", "e", "f", "g"):  # round robin: a d g | b e | c f
        arrive(s, tid)
    assert admits(s.decide(0.0)) == [("a", "e0"), ("b", "e1"), ("c", "e2")]
    finish_turn(s, "a", 1.0, final=False)  # a: in a tool, KV on e0
    assert admits(s.decide(1.0)) == [("d", "e0")]
    s.on_event(EngineFailed("e0", "xid 79"), 2.0)
    out = s.decide(2.0)
    assert "e0" not in s.engines
    assert all(getattr(d, "engine_id", None) != "e0" for d in out)
    # d (was running) and g (was queued) wait on the survivors, running first.
    assert (s.trajs["d"].engine_id, s.trajs["d"].phase) == ("e1", Phase.QUEUED)
    assert (s.trajs["g"].engine_id, s.trajs["g"].phase) == ("e2", Phase.QUEUED)
    assert s.trajs["a"].engine_id is None and s.trajs["a"].phase is Phase.TOOL
    assert s.trajs["d"].kv_reserved == 0
    tool_done(s, "a", 3.0)
    assert s.trajs["a"].engine_id == "e1"
    # Every trajectory still finishes, each queue in FCFS order.
    order: list[tuple[str, str]] = []
    now = 4.0
    while any(t.phase is not Phase.DONE for t in s.trajs.values()):
        for e in list(s.engines.values()):
            for tid in sorted(e.running):
                finish_turn(s, tid, now, final=True)
        order += admits(s.decide(now))
        now += 1.0
    assert [tid for tid, eid in order if eid == "e1"] == ["e", "d", "a"]
    assert [tid for tid, eid in order if eid == "e2"] == ["f", "g"]


def test_engine_failed_keeps_the_queue_time_already_spent() -> None:
    """Regression: a queued turn re-routed after a failure lost its waiting time."""
    s = FakeFifoScheduler(cap=1)
    add_engine(s, "e0")
    add_engine(s, "e1")
    for tid in ("a", "b", "c"):  # a, c -> e0; b -> e1
        arrive(s, tid)
    s.decide(0.0)
    s.on_event(EngineFailed("e0", "lost"), 10.0)
    s.decide(10.0)
    finish_turn(s, "b", 20.0, final=True)
    assert admits(s.decide(20.0)) == [("a", "e1")]
    finish_turn(s, "a", 30.0, final=True)
    assert admits(s.decide(30.0)) == [("c", "e1")]
    assert s.trajs["a"].queue_time_s == pytest.approx(10.0)
    assert s.trajs["c"].queue_time_s == pytest.approx(30.0)  # queued from 0 to 30


def test_trajectory_ended_drops_queued_and_running_turns() -> None:
    s = FakeFifoScheduler(cap=1)
    add_engine(s, "e0")
    for tid in ("a", "b", "c"):
        arrive(s, tid)
    s.decide(0.0)
    s.on_event(TrajectoryEnded("b", "cancelled"), 1.0)  # queued
    assert s.engines["e0"].queued == 1
    s.on_event(TrajectoryEnded("a", "timeout"), 1.0)  # running
    assert admits(s.decide(1.0)) == [("c", "e0")]
    assert s.trajs["a"].phase is Phase.DONE and s.trajs["b"].phase is Phase.DONE
    assert s.engines["e0"].running == {"c"} and s.engines["e0"].queued == 0


def test_a_turn_that_finishes_before_its_preemption_lands_leaves_no_queue_entry() -> None:
    """Live engines only: the scheduler preempted a turn that had already ended."""
    s = FakeFifoScheduler(cap=1)
    add_engine(s, "e0")
    arrive(s, "a")
    arrive(s, "b")
    s.decide(0.0)
    s._preempt(s.trajs["a"], 1.0)  # a back in the queue in front of b
    assert s.engines["e0"].queued == 2
    s.on_event(TurnFinished("a", "e0", 50, 150, final=False), 1.0)  # a's reply arrives
    assert s.engines["e0"].queued == 1 and s.trajs["a"].phase is Phase.TOOL
    assert admits(s.decide(1.0)) == [("b", "e0")]
    s.on_event(TurnPreempted("b", "e0", 3), 1.6)  # an engine-side retry of b
    s.on_event(TurnPreempted("b", "e0", 3), 1.6)  # reported twice: requeued once
    assert s.engines["e0"].queued == 1 and s.trajs["b"].phase is Phase.QUEUED


def test_a_final_tool_call_ends_the_trajectory_without_another_turn() -> None:
    s = FakeFifoScheduler()
    add_engine(s, "e0")
    arrive(s, "a")
    s.decide(0.0)
    finish_turn(s, "a", 1.0, final=False)
    s.on_event(ToolCallFinished("a", 0.1, 0, final=True), 1.1)
    assert s.decide(1.1) == [] and s.trajs["a"].phase is Phase.DONE
    assert s.engines["e0"].load == 0


def test_forget_drops_only_finished_trajectories_and_stale_entries_are_skipped() -> None:
    s = FakeFifoScheduler(cap=1)
    add_engine(s, "e0")
    for tid in ("a", "b", "c"):
        arrive(s, tid)
    s.decide(0.0)
    s.on_event(TrajectoryEnded("b", "cancelled"), 1.0)  # its heap entry goes stale
    s.forget("b")
    s.forget("a")  # still running: kept
    s.forget("nobody")
    assert "b" not in s.trajs and "a" in s.trajs
    finish_turn(s, "a", 2.0, final=True)
    assert admits(s.decide(2.0)) == [("c", "e0")]
    s.forget("a")
    assert set(s.trajs) == {"c"}


# -- drain -------------------------------------------------------------------------------------


def test_drain_moves_queued_turns_away_and_admits_nothing_more() -> None:
    s = FakeFifoScheduler(cap=1)
    add_engine(s, "e0")
    add_engine(s, "e1")
    for tid in ("a", "b", "c", "d", "e"):  # a c e -> e0; b d -> e1
        arrive(s, tid)
    assert admits(s.decide(0.0)) == [("a", "e0"), ("b", "e1")]
    s.drain_requests += ["e0", "e0"]
    out = s.decide(1.0)
    assert [d for d in out if isinstance(d, DrainEngine)] == [DrainEngine("e0")]
    e0 = s.engines["e0"]
    assert e0.draining and e0.queued == 0 and e0.running == {"a"}
    assert s.trajs["c"].engine_id == "e1" and s.trajs["e"].engine_id == "e1"
    assert s.engines["e1"].queued == 3
    assert [e.engine_id for e in s.live_engines()] == ["e1"]
    # The running turn finishes on e0; nothing more is admitted there.
    finish_turn(s, "a", 2.0, final=False)
    assert admits(s.decide(2.0)) == []
    tool_done(s, "a", 3.0)  # a's next turn cannot go back to a draining engine
    assert s.trajs["a"].engine_id == "e1"
    s.drain_requests.append("e0")  # a second drain is a no-op
    assert s.decide(3.0) == []
    s.on_event(EngineRemoved("e0"), 4.0)
    assert "e0" not in s.engines
    finish_turn(s, "b", 5.0, final=True)
    assert admits(s.decide(5.0)) == [("d", "e1")]


def test_drain_keeps_fcfs_order_of_the_moved_turns() -> None:
    """Regression: drained turns were re-routed in heap-array order, not FCFS."""
    s = FakeFifoScheduler(cap=1, pin="e0")
    add_engine(s, "e0")
    add_engine(s, "e1")
    ids = ["a", "b", "c", "d", "e", "f"]
    for tid in ids:
        arrive(s, tid)
    order = admits(s.decide(0.0))
    assert order == [("a", "e0")]
    s.drain_requests.append("e0")
    order += admits(s.decide(1.0))
    now = 2.0
    while len(order) < len(ids):
        (running,) = s.engines["e1"].running
        finish_turn(s, running, now, final=True)
        order += admits(s.decide(now))
        now += 1.0
    assert [tid for tid, _ in order] == ids


# -- random driving: invariants hold whatever happens ---------------------------------------


def _check_invariants(s: TrajectoryScheduler, running: dict[str, str]) -> None:
    for e in s.engines.values():
        assert len(e.running) <= s.admission_cap(e), e.engine_id
        assert e.running == {tid for tid, eid in running.items() if eid == e.engine_id}
        queued = [t for t in s.trajs.values()
                  if t.phase is Phase.QUEUED and t.engine_id == e.engine_id]
        assert e.queued == len(queued), e.engine_id
        if not e.draining:
            # A turn waits only while its engine is full.
            assert not queued or len(e.running) >= s.admission_cap(e), e.engine_id
    for tid, t in s.trajs.items():
        assert (t.phase is Phase.RUNNING) == (tid in running), tid


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("make", [lambda: Slime(1, 1), lambda: Verl(1, 1),
                                  lambda: VerlStar(1, 1), lambda: FakeFifoScheduler(cap=3)],
                         ids=["slime", "verl", "verl-star", "fake-fifo"])
def test_random_event_streams_keep_the_bookkeeping_consistent(
        make: Callable[[], TrajectoryScheduler], seed: int) -> None:
    rng = random.Random(seed)
    s = make()
    for i in range(3):
        add_engine(s, f"e{i}", max_batch=rng.choice([2, 4, 200]))
    n = 40
    for i in range(n):
        arrive(s, f"t{i:02d}", prompt=rng.randint(10, 1000))
    running: dict[str, str] = {}
    in_tool: list[str] = []
    done: set[str] = set()
    now = 0.0
    for _ in range(5000):
        for tid, eid in admits(s.decide(now)):
            assert tid not in running and tid not in done
            assert s.trajs[tid].engine_id == eid
            running[tid] = eid
        _check_invariants(s, running)
        if len(done) == n:
            break
        now += rng.choice([0.0, 0.5, 1.0])
        roll = rng.random()
        if running and roll < 0.6:
            tid = rng.choice(sorted(running))
            running.pop(tid)
            final = rng.random() < 0.25
            finish_turn(s, tid, now, final=final, tokens=rng.randint(1, 500))
            (done.add(tid) if final else in_tool.append(tid))
        elif in_tool and roll < 0.85:
            tid = in_tool.pop(rng.randrange(len(in_tool)))
            tool_done(s, tid, now, tokens=rng.randint(0, 300))
        elif running and roll < 0.95:
            tid = rng.choice(sorted(running))
            s.on_event(TurnPreempted(tid, running.pop(tid), rng.randint(0, 10)), now)
        elif running:
            tid = rng.choice(sorted(running))
            s.on_event(TrajectoryEnded(tid, "cancelled"), now)
            running.pop(tid)
            done.add(tid)
    assert len(done) == n
    assert all(t.phase is Phase.DONE for t in s.trajs.values())
    assert all(e.queued == 0 and not e.running for e in s.engines.values())


# -- policy names --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["fifo", "Verl", "", "verl@tp", "slime@gpu2", "treadle2"])
def test_unknown_policy_names_raise_naming_the_choices(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_policy(bad)
    message = str(info.value)
    for name in POLICIES:
        assert name in message


@pytest.mark.parametrize("spec", ["heddle@tp4", "treadle@tp8", "oracle@tp1"])
def test_tp_suffix_is_rejected_for_policies_that_plan_their_own_layout(spec: str) -> None:
    with pytest.raises(ValueError, match="@tp suffix"):
        parse_policy(spec)


@pytest.mark.parametrize("spec", ["verl@tp3", "slime@tp16", "verl-star@tp0"])
def test_tp_suffix_must_be_a_valid_degree(spec: str) -> None:
    with pytest.raises(ValueError, match="TP degree"):
        parse_policy(spec)


@pytest.mark.parametrize(("spec", "parsed"), [
    ("verl", PolicySpec("verl", None)),
    ("verl@tp4", PolicySpec("verl", 4)),
    (" verl-star@tp8 ", PolicySpec("verl-star", 8)),
    ("slime@tp1", PolicySpec("slime", 1)),
    ("treadle", PolicySpec("treadle", None)),
    ("oracle", PolicySpec("oracle", None)),
])
def test_parse_policy_accepts_names_and_baseline_tp_suffixes(spec: str,
                                                            parsed: PolicySpec) -> None:
    assert parse_policy(spec) == parsed
    assert parse_policy(parsed.label) == parsed


# -- policy versions -------------------------------------------------------------------------


def test_policy_updated_ages_a_trajectory_from_its_first_admission() -> None:
    s = FakeFifoScheduler(cap=1)
    add_engine(s, "e0")
    arrive(s, "a")
    arrive(s, "b")
    assert admits(s.decide(0.0)) == [("a", "e0")]  # b waits, nothing sampled yet
    s.on_event(PolicyUpdated(1), 1.0)
    assert (s.policy_version, s.updated_at) == (1, [1.0])
    a, b = s.trajs["a"], s.trajs["b"]
    assert (a.first_version, s.age(a)) == (0, 1)
    assert (b.first_version, s.age(b)) == (None, 0)
    finish_turn(s, "a", 2.0, final=True)
    assert admits(s.decide(2.0)) == [("b", "e0")]
    s.on_event(PolicyUpdated(3), 3.0)  # versions may skip
    s.on_event(TurnPreempted("b", "e0", 10), 3.0)
    assert admits(s.decide(3.0)) == [("b", "e0")]  # admitted again: its oldest token stays
    assert (b.first_version, s.age(b)) == (1, 2)


@pytest.mark.parametrize("version", [2, 1, 0])
def test_policy_versions_only_grow(version: int) -> None:
    s = FakeFifoScheduler()
    if version:
        s.on_event(PolicyUpdated(2), 0.0)
    with pytest.raises(ValueError, match="only grow"):
        s.on_event(PolicyUpdated(version), 1.0)


def test_an_engine_removed_while_a_trajectory_is_parked_on_it_leaves_it_homeless() -> None:
    """Drained and removed while a trajectory waits on a tool call with its KV there:
    the KV is gone with the engine, and the next turn is routed afresh."""
    s = FakeFifoScheduler(cap=1)
    add_engine(s, "e0")
    add_engine(s, "e1")
    arrive(s, "a")
    assert admits(s.decide(0.0)) == [("a", "e0")]
    finish_turn(s, "a", 1.0, final=False)  # parked on e0 in a tool call
    s.drain_requests.append("e0")
    s.decide(2.0)
    s.on_event(EngineRemoved("e0"), 3.0)
    assert s.trajs["a"].engine_id is None
    tool_done(s, "a", 4.0)
    assert admits(s.decide(4.0)) == [("a", "e1")]


def test_engines_are_kept_in_id_order_whatever_order_they_come_up_in() -> None:
    s = FakeFifoScheduler()
    for eid in ("e1", "e3", "e0", "e4", "e2", "e4"):  # e4 twice: replaced in place
        add_engine(s, eid)
    assert list(s.engines) == ["e0", "e1", "e2", "e3", "e4"]
