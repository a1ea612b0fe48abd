"""The longest queues that could give a turn away (`core.longest_queues`), and work
stealing built on them: the same decisions as looking at every engine each time."""

from __future__ import annotations

import heapq
import random
import types

from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.core.cost_model import CostModel
from treadle.core.events import Decision, Event
from treadle.core.longest_queues import MIN_DONOR, LongestQueues
from treadle.core.policies import build_policy, parse_policy
from treadle.core.policies.progressive import Progressive
from treadle.core.scheduler import EngineState, Phase, Scheduler
from treadle.sim.cluster import Cluster
from treadle.sim.runner import MAX_BATCH, history_for
from treadle.workloads.load import generate_named

COST = CostModel.named("qwen3-14b", "h100")

# (operation, engine): 0 a turn joins, 1 the head leaves, 2 a turn leaves from the
# middle, 3 the engine starts draining, 4 everything indexed afresh.
_OPS = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5)), max_size=300)


def _expected(engines: list[EngineState]) -> EngineState | None:
    """Every engine looked at: the longest queue of at least MIN_DONOR, ties the later."""
    donors = [(len(e.queue), i, e) for i, e in enumerate(engines)
              if len(e.queue) >= MIN_DONOR and not e.draining]
    return max(donors, key=lambda d: (d[0], d[1]))[2] if donors else None


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_the_longest_queue_is_found_as_looking_at_every_engine_finds_it(
        ops: list[tuple[int, int]]) -> None:
    engines = [EngineState(f"e{i}", 1, 8, 1000) for i in range(6)]
    index = LongestQueues()
    index.reset(engines)
    queued: list[list[str]] = [[] for _ in engines]  # each engine's, in queue order
    seq = 0
    for op, k in ops:
        e = engines[k]
        if op == 0:
            seq += 1
            e.queue.push(0.0, seq, f"t{seq}")
            queued[k].append(f"t{seq}")
            index.grew(e)
        elif op == 1 and queued[k]:
            assert e.queue.pop() is not None and queued[k].pop(0)
        elif op == 2 and queued[k]:
            e.queue.discard(queued[k].pop(len(queued[k]) // 2))
        elif op == 3:
            e.draining = True
        elif op == 4:
            index.reset(engines)
        assert index.longest() is _expected(engines)


def test_entries_left_behind_do_not_pile_up() -> None:
    engines = [EngineState(f"e{i}", 1, 8, 1000) for i in range(4)]
    index = LongestQueues()
    index.reset(engines)
    for seq in range(10_000):  # a queue that grows and shrinks for ever
        e = engines[seq % 4]
        e.queue.push(0.0, seq, f"t{seq}")
        index.grew(e)
        if len(e.queue) > 3:
            e.queue.pop()
    assert len(index._heap) <= 2 * len(engines) + 16
    assert index.longest() is _expected(engines)


def _scanning_steal(self: Progressive, now: float) -> None:
    """The reference: every live engine looked at, each decision (how stealing was
    written before `LongestQueues`)."""
    donors: list[EngineState] = []
    empty: list[EngineState] = []
    for e in self.live_engines():
        (donors if e.queue else empty).append(e)
    if not donors:
        return
    cap = self.admission_cap
    thieves = [e for e in empty if len(e.running) < cap(e)]
    heap = [(-e.queued, -i, e) for i, e in enumerate(donors)]
    heapq.heapify(heap)
    for thief in thieves:
        budget = self.kv_budget(thief)
        while not thief.queue and len(thief.running) < cap(thief) and heap:
            _, neg_rank, donor = heap[0]
            if donor.queued <= 1:
                break
            t = self._queue_head(donor)
            if t is None:
                break
            if budget is not None and thief.running and \
                    thief.kv_reserved + self.kv_need(t) > budget:
                break
            self._requeue(t, thief.engine_id, t.priority, now)
            self.steals += 1
            if donor.queued:
                heapq.heapreplace(heap, (-donor.queued, neg_rank, donor))
            else:
                heapq.heappop(heap)


class _Recorder(Scheduler):
    """A test double of a driver's view: `inner`, with every decision written down."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.name = inner.name
        self.decisions: list[tuple[float, Decision]] = []

    def on_event(self, event: Event, now: float) -> None:
        self.inner.on_event(event, now)

    def decide(self, now: float) -> list[Decision]:
        out = self.inner.decide(now)
        self.decisions.extend((now, d) for d in out)
        return out

    def wakeup(self) -> float | None:
        return self.inner.wakeup()


def _run(workload: str, policy: str, engines: int, n: int, scanning: bool
         ) -> tuple[list[tuple[float, Decision]], int]:
    work = generate_named(workload, n, seed=1, max_context=COST.model.max_context)
    spec = parse_policy(policy)
    inner = build_policy(spec, COST, batch_size=n, history=history_for(workload, n, 1),
                         seed=1, max_batch=MAX_BATCH,
                         layout=[1] * engines if spec.name == "treadle" else None)
    assert isinstance(inner, Progressive)
    if scanning:
        inner._steal = types.MethodType(_scanning_steal, inner)  # type: ignore[method-assign]
    recorder = _Recorder(inner)
    cluster = Cluster(COST, engines, recorder, list(work.trajectories), [1] * engines,
                      max_batch=MAX_BATCH, on_finish=lambda tid: abort_some())
    rng = random.Random(3)

    def abort_some() -> None:
        """Every few finishes, a queued trajectory is cancelled (a queue shrinks
        without an admission)."""
        queued = sorted(t.traj_id for t in inner.trajs.values() if t.phase is Phase.QUEUED
                        and t.engine_id is not None)
        if queued and rng.random() < 0.2:
            cluster.abort(rng.choice(queued), "cancelled")

    cluster.run()
    return recorder.decisions, inner.steals


def test_stealing_decides_exactly_as_looking_at_every_engine_does() -> None:
    for workload, policy in (("coding", "treadle"), ("bimodal", "heddle")):
        kept, steals = _run(workload, policy, 8, 2048, scanning=False)
        scanned, scan_steals = _run(workload, policy, 8, 2048, scanning=True)
        assert steals > 100 and steals == scan_steals
        assert kept == scanned
