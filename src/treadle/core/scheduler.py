"""The scheduler interface and the bookkeeping every policy shares.

`Scheduler` is the whole contract a driver sees: it feeds events in time order to
`on_event(event, now)` and, after each instant's events, calls `decide(now)` and
carries out the returned decisions; `wakeup()` tells it when the scheduler wants to
be asked again even if nothing happens (periodic re-planning).

`TrajectoryScheduler` keeps the state that all policies need — where each
trajectory is (queued, running, in a tool call, done), which engine holds its KV,
per-engine queues and running sets — and leaves policies four decisions:

- `route(t, now)`: which engine a ready turn is queued on;
- `priority(t, now)`: its priority there (lower runs first);
- `admission_cap(e)`: how many turns an engine may run at once;
- `rebalance(now)`: anything else — preemption, migration, pool changes.

Queues are per engine (`core.turn_queue.TurnQueue`), ordered by (priority, sequence
number), so ties fall back to FCFS and every run is deterministic. A judge's turns
(`TrajectoryArrived.judge`) are a class of their own: the policy's priority plus
`JUDGE_RANK`, so that they run in the gaps rollouts leave and a policy that preempts
pauses them first. A turn is admitted
as soon as its engine has a free slot. Decisions change this state immediately (the
driver is trusted to carry them out); the driver reports engine-side surprises back
as events (`TurnPreempted`, `EngineFailed`).
"""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from treadle.core.events import (
    AddEngine,
    Admit,
    Decision,
    DrainEngine,
    EngineAdded,
    EngineDraining,
    EngineFailed,
    EngineRemoved,
    Event,
    Migrate,
    PolicyUpdated,
    Preempt,
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryArrived,
    TrajectoryEnded,
    TurnFinished,
    TurnPreempted,
)
from treadle.core.predictor import Estimate
from treadle.core.turn_queue import TurnQueue

# Added to a judge turn's priority: above every rollout priority a policy gives (the
# built-in ones stay within a few 1e9: remaining tokens, 1e9 per version of age).
# An engine's own priority is a 32-bit integer: there a judge turn is clipped to the
# lowest rank, so engines that schedule by priority also run it last.
JUDGE_RANK = 1e12


class Phase(enum.Enum):
    QUEUED = "queued"  # its next turn waits in an engine queue
    RUNNING = "running"  # a turn is generating on an engine
    TOOL = "tool"  # inside a tool call; holds no engine slot
    DONE = "done"  # no more events


@dataclass(slots=True)
class TrajState:
    """What the scheduler knows about one trajectory (never its future)."""

    traj_id: str
    group_id: str  # GRPO group
    prompt_tokens: int  # initial context
    arrived_at: float  # clock time of arrival
    context_tokens: int  # current context length (prompt + outputs + observations)
    output_tokens: int = 0  # sampled so far, all turns
    turns_done: int = 0  # finished turns
    tool_time_s: float = 0.0  # total time in finished tool calls
    phase: Phase = Phase.QUEUED
    engine_id: str | None = None  # engine holding its KV / its queue / its running turn
    priority: float = 0.0  # priority of its current queue entry or running turn
    seq: int = 0  # FCFS tie-break of its current queue entry
    queued_at: float = 0.0  # when it entered the current queue
    queue_time_s: float = 0.0  # total time spent queued (preemptions included)
    kv_reserved: int = 0  # context counted against its engine's KV budget while running
    admitted_at: float = 0.0  # when its running turn (or the last one) was admitted
    # Policy version current when its first turn was admitted: the oldest version its
    # tokens can carry (None until then).
    first_version: int | None = None
    judge: bool = False  # a judge's call: ranked JUDGE_RANK after rollouts
    max_staleness: int | None = None  # its own bound (TrajectoryArrived.max_staleness)
    # A policy's memo of its work estimate (`Progressive.estimate`), with the turns
    # done and the memo generation it was made at: kept here, not in a dict of
    # tuples, as it is read several times a trajectory a decision.
    memo: Estimate | None = None
    memo_turns: int = -1
    memo_generation: int = -1


@dataclass(slots=True)
class EngineState:
    """One engine as the scheduler sees it."""

    engine_id: str
    tp: int  # GPUs it occupies
    max_batch: int  # hardware/engine limit on concurrent sequences
    kv_capacity_tokens: int  # KV cache size
    running: set[str] = field(default_factory=set)  # trajectories generating now
    queue: TurnQueue = field(default_factory=TurnQueue)  # ready turns waiting here
    kv_reserved: int = 0  # Σ context of running trajectories at their admission
    # Max-heap of running turns by (priority, seq), as (-priority, -seq, id); entries
    # of turns no longer running (or admitted again since) are dropped lazily.
    by_importance: list[tuple[float, int, str]] = field(default_factory=list)
    draining: bool = False  # admits nothing; removed once idle

    @property
    def queued(self) -> int:
        """Turns in `queue`."""
        return len(self.queue)

    @property
    def load(self) -> int:
        """Outstanding requests: running plus queued (what a router balances)."""
        return len(self.running) + len(self.queue)


class Scheduler(ABC):
    """The interface every driver uses."""

    name: str = "abstract"
    preemptions: int = 0  # pauses it has decided so far (drivers report it)
    migrations: int = 0  # KV moves it has decided so far
    replans: int = 0  # whole-batch re-placements so far (the costly decisions)

    def initial_pool(self, gpus: int) -> list[int]:
        """TP degree of each engine the driver starts with, within `gpus`."""
        raise NotImplementedError(f"{self.name} does not plan an engine pool")

    @abstractmethod
    def on_event(self, event: Event, now: float) -> None:
        """Take in one event. Events arrive in non-decreasing `now`."""

    @abstractmethod
    def decide(self, now: float) -> list[Decision]:
        """Decisions to carry out now, after this instant's events."""

    def wakeup(self) -> float | None:
        """Next time the scheduler wants `decide` called without an event, or None."""
        return None

    def engine_queues(self) -> dict[str, int]:
        """Turns waiting in each engine's queue now, by engine id (a view for
        monitoring; {} for a scheduler that keeps no per-engine queues)."""
        return {}

    def forget(self, traj_id: str) -> None:  # noqa: B027 - optional for a driver
        """Drop what is kept of a trajectory that sends no more events, so a
        long-lived driver's memory stays bounded. Unknown ids are ignored."""


class TrajectoryScheduler(Scheduler):
    """Shared bookkeeping; subclasses implement the policy hooks."""

    def __init__(self) -> None:
        self.trajs: dict[str, TrajState] = {}
        self.engines: dict[str, EngineState] = {}
        self._seq = 0
        self._out: list[Decision] = []
        self._dirty: set[str] = set()  # engines whose queue or slots changed
        self.unrouted: dict[str, TrajState] = {}  # ready turns with no engine yet
        self.preemptions = 0  # scheduler-initiated pauses
        self.migrations = 0  # KV moves between engines
        self.policy_version = 0  # weights the engines serve (`PolicyUpdated`)
        self.updated_at: list[float] = []  # when each version after the first arrived

    def engine_queues(self) -> dict[str, int]:
        return {eid: e.queued for eid, e in self.engines.items()}

    # -- policy hooks -------------------------------------------------------------

    @abstractmethod
    def route(self, t: TrajState, now: float) -> str | None:
        """Engine whose queue the trajectory's ready turn joins; None defers it to
        `self.unrouted` for `rebalance` to place."""

    def priority(self, t: TrajState, now: float) -> float:
        """Priority of the ready turn; lower runs first. Default: FCFS."""
        return 0.0

    def ranked(self, t: TrajState, now: float) -> float:
        """The rank a ready turn is queued (and run) at: the policy's `priority`,
        plus `JUDGE_RANK` for a judge's turn."""
        return self.priority(t, now) + (JUDGE_RANK if t.judge else 0.0)

    def admission_cap(self, e: EngineState) -> int:
        return e.max_batch

    def kv_need(self, t: TrajState) -> int:
        """KV tokens a turn is counted for against `kv_budget`: its context, plus
        whatever growth the policy expects."""
        return t.context_tokens

    def kv_budget(self, e: EngineState) -> float | None:
        """Most context tokens (counted at admission) the engine may run at once;
        None leaves KV pressure to the engine (it evicts, as vLLM does)."""
        return None

    def rebalance(self, now: float) -> None:
        """Preempt, migrate or change the pool through the `_preempt`, `_migrate`,
        `_add_engine` and `_drain` primitives. Called at the end of every `decide`."""

    def observe(self, event: Event, t: TrajState | None, now: float) -> None:
        """Called after the shared bookkeeping has applied `event` (predictors hook here)."""

    # -- driver interface -----------------------------------------------------------

    def on_event(self, event: Event, now: float) -> None:
        t: TrajState | None = None
        if isinstance(event, TrajectoryArrived):
            t = TrajState(event.traj_id, event.group_id, event.prompt_tokens, now,
                          context_tokens=event.prompt_tokens, judge=event.judge,
                          max_staleness=event.max_staleness)
            self.trajs[t.traj_id] = t
            self._ready(t, now)
        elif isinstance(event, TurnFinished):
            t = self.trajs[event.traj_id]
            if t.phase is Phase.QUEUED:
                # A preemption lost the race: the turn ended before the engine heard
                # of it (live engines only). Its queue entry goes stale.
                self._dequeue(t)
            self._leave_engine(t)
            t.output_tokens += event.output_tokens
            t.context_tokens = event.context_tokens
            t.turns_done += 1
            t.phase = Phase.DONE if event.final else Phase.TOOL
        elif isinstance(event, ToolCallStarted):
            t = self.trajs[event.traj_id]
        elif isinstance(event, ToolCallFinished):
            t = self.trajs[event.traj_id]
            t.tool_time_s += event.latency_s
            t.context_tokens += event.output_tokens
            if event.final:
                t.phase = Phase.DONE
            else:
                self._ready(t, now)
        elif isinstance(event, TurnPreempted):
            t = self.trajs[event.traj_id]
            if t.phase is Phase.RUNNING:  # else the scheduler preempted it already
                self._leave_engine(t)
                # Re-queued on the same engine with its old sequence number: an evicted
                # turn goes back to the front of its class, as in vLLM.
                eid = event.engine_id if event.engine_id in self.engines else None
                if eid is None:
                    t.engine_id = None
                    self._ready(t, now)
                else:
                    self._enqueue(t, eid, t.priority, now, seq=t.seq)
        elif isinstance(event, TrajectoryEnded):
            t = self.trajs[event.traj_id]
            self._leave_engine(t)
            self._dequeue(t)
            t.phase = Phase.DONE
        elif isinstance(event, EngineAdded):
            last = next(reversed(self.engines), None)
            self.engines[event.engine_id] = EngineState(
                event.engine_id, event.tp, event.max_batch, event.kv_capacity_tokens)
            # Keep engines in id order: routing ties go to the first, on any driver.
            # (Engines mostly come in id order: sorting at every one made bringing
            # up a pool quadratic.)
            if last is not None and event.engine_id < last:
                self.engines = dict(sorted(self.engines.items()))
            self._dirty.add(event.engine_id)
            self._route_unrouted(now)
        elif isinstance(event, EngineDraining):
            if event.engine_id in self.engines:
                self._drain(event.engine_id, now)
        elif isinstance(event, EngineRemoved):
            if self.engines.pop(event.engine_id, None) is not None:
                self._unhome(event.engine_id)
        elif isinstance(event, EngineFailed):
            self._engine_failed(event.engine_id, now)
        elif isinstance(event, PolicyUpdated):
            if event.version <= self.policy_version:
                raise ValueError(f"policy version {event.version} after {self.policy_version}: "
                                 "versions only grow")
            self.policy_version = event.version
            self.updated_at.append(now)
        self.observe(event, t, now)

    def decide(self, now: float) -> list[Decision]:
        self.rebalance(now)
        for eid in sorted(self._dirty):
            e = self.engines.get(eid)
            if e is not None:
                self._admit_from(e, now)
        self._dirty.clear()
        out, self._out = self._out, []
        return out

    # -- primitives for policies ---------------------------------------------------

    def forget(self, traj_id: str) -> None:
        t = self.trajs.get(traj_id)
        if t is not None and t.phase is Phase.DONE:
            del self.trajs[traj_id]  # a DONE trajectory is in no queue

    def _live(self, tid: str, eid: str, seq: int) -> TrajState | None:
        """The trajectory of a `by_importance` entry, if the entry is still current."""
        t = self.trajs.get(tid)
        if t is None or t.engine_id != eid or t.seq != seq:
            return None
        return t

    def _route_unrouted(self, now: float) -> None:
        """Give deferred turns another chance at routing (an engine came up)."""
        for t in sorted(self.unrouted.values(), key=lambda t: t.traj_id):
            eid = self.route(t, now)
            if eid is not None:
                self._enqueue(t, eid, self.ranked(t, now), now)

    def _ready(self, t: TrajState, now: float) -> None:
        """The trajectory's next turn can run: route it and queue it; with no engine
        to route to (none live, or the policy defers), it waits in `unrouted`."""
        # Stops at the first live engine (building `live_engines()` for every arrival
        # took 0.2 s of a 4,000-trajectory batch's arrival over 1,024 engines).
        live = any(not e.draining for e in self.engines.values())
        eid = self.route(t, now) if live else None
        if eid is None:
            t.phase, t.engine_id, t.queued_at = Phase.QUEUED, None, now
            self.unrouted[t.traj_id] = t
            return
        self._enqueue(t, eid, self.ranked(t, now), now)

    def _enqueue(self, t: TrajState, eid: str, prio: float, now: float,
                 seq: int | None = None) -> None:
        if seq is None:
            self._seq += 1
            seq = self._seq
        e = self.engines[eid]
        if self.unrouted.pop(t.traj_id, None) is not None:
            t.queue_time_s += now - t.queued_at
        t.phase, t.engine_id, t.priority, t.seq, t.queued_at = Phase.QUEUED, eid, prio, seq, now
        e.queue.push(prio, seq, t.traj_id)
        self._dirty.add(eid)

    def _dequeue(self, t: TrajState) -> None:
        """Drop a queued turn, from its engine's queue or from `unrouted`."""
        if self.unrouted.pop(t.traj_id, None) is not None:
            t.phase = Phase.DONE
        elif t.phase is Phase.QUEUED and t.engine_id in self.engines:
            self.engines[t.engine_id].queue.discard(t.traj_id)
            t.phase = Phase.DONE  # caller sets the real phase

    def _requeue(self, t: TrajState, eid: str, prio: float, now: float) -> None:
        """Move a queued turn to another engine or priority (no KV involved)."""
        self._dequeue(t)
        t.queue_time_s += now - t.queued_at
        self._enqueue(t, eid, prio, now)

    def _leave_engine(self, t: TrajState) -> None:
        if t.phase is Phase.RUNNING and t.engine_id in self.engines:
            e = self.engines[t.engine_id]
            e.running.discard(t.traj_id)
            e.kv_reserved -= t.kv_reserved
            t.kv_reserved = 0
            self._dirty.add(e.engine_id)

    def _admit_from(self, e: EngineState, now: float) -> None:
        cap = 0 if e.draining else self.admission_cap(e)
        budget = self.kv_budget(e)
        queue, running = e.queue, e.running
        while len(running) < cap and (head := queue.peek()) is not None:
            prio, seq, tid = head
            t = self.trajs[tid]
            need = self.kv_need(t) if budget is not None else 0
            if budget is not None and running and e.kv_reserved + need > budget:
                break  # the head waits for KV; nothing behind it jumps the queue
            queue.pop_peeked()
            t.queue_time_s += now - t.queued_at
            t.phase, t.admitted_at = Phase.RUNNING, now
            if t.first_version is None:
                t.first_version = self.policy_version
            t.kv_reserved = need
            e.kv_reserved += need
            running.add(tid)
            heapq.heappush(e.by_importance, (-prio, -seq, tid))
            self._out.append(Admit(tid, e.engine_id, prio))

    def _rerank_running(self, t: TrajState, prio: float) -> None:
        """A running turn's new priority: its rank when a pause is chosen."""
        assert t.phase is Phase.RUNNING and t.engine_id is not None
        t.priority = prio
        heapq.heappush(self.engines[t.engine_id].by_importance, (-prio, -t.seq, t.traj_id))

    def _preempt(self, t: TrajState, now: float) -> None:
        """Pause a running turn and put it back in its engine's queue (KV kept)."""
        assert t.phase is Phase.RUNNING and t.engine_id is not None
        eid = t.engine_id
        self._leave_engine(t)
        self._out.append(Preempt(t.traj_id, eid))
        self.preemptions += 1
        self._enqueue(t, eid, t.priority, now, seq=t.seq)

    def _migrate(self, t: TrajState, dst: str) -> None:
        """Move a trajectory's KV during its tool gap; its next turn goes to `dst`."""
        assert t.phase is Phase.TOOL and t.engine_id is not None and t.engine_id != dst
        self._out.append(Migrate(t.traj_id, t.engine_id, dst))
        self.migrations += 1
        t.engine_id = dst

    def _move_running(self, t: TrajState, dst: str, now: float) -> None:
        """Pause a running turn and carry its KV to `dst`, where it queues: a move
        outside a tool gap, which the turn waits for (live, the paused call keeps
        its tokens and the next admission names `dst`)."""
        assert t.phase is Phase.RUNNING and t.engine_id is not None and t.engine_id != dst
        src = t.engine_id
        self._leave_engine(t)
        self._out.append(Preempt(t.traj_id, src))
        self._out.append(Migrate(t.traj_id, src, dst))
        self.preemptions += 1
        self.migrations += 1
        self._enqueue(t, dst, t.priority, now, seq=t.seq)

    def _add_engine(self, tp: int) -> None:
        self._out.append(AddEngine(tp))

    def _drain(self, eid: str, now: float) -> None:
        """Stop admitting to the engine and send its queued turns elsewhere."""
        e = self.engines[eid]
        if e.draining:
            return
        e.draining = True
        self._out.append(DrainEngine(eid))
        stranded = [self.trajs[tid] for _, _, tid in e.queue.drain()]  # (priority, FCFS)
        for t in stranded:
            if t.phase is Phase.QUEUED and t.engine_id == eid:
                t.queue_time_s += now - t.queued_at
                t.engine_id = None
                self._ready(t, now)

    def _engine_failed(self, eid: str, now: float) -> None:
        e = self.engines.pop(eid, None)
        if e is None:
            return
        queued = [tid for _, _, tid in e.queue.drain()]
        for tid in sorted(e.running) + queued:
            t = self.trajs[tid]
            if t.engine_id == eid and t.phase in (Phase.RUNNING, Phase.QUEUED):
                if t.phase is Phase.QUEUED:
                    t.queue_time_s += now - t.queued_at
                t.engine_id, t.kv_reserved = None, 0
                self._ready(t, now)
        self._unhome(eid)

    def _unhome(self, eid: str) -> None:
        """The engine is gone (failed, or drained and removed while trajectories were
        parked on it in a tool call): their KV with it, they are routed afresh when
        their tools return."""
        for t in self.trajs.values():
            if t.phase is Phase.TOOL and t.engine_id == eid:
                t.engine_id = None

    # -- shared routing helpers ------------------------------------------------------

    def age(self, t: TrajState) -> int:
        """Policy versions since the trajectory's oldest token was sampled (0 before
        its first turn is admitted): its staleness were it delivered now."""
        return 0 if t.first_version is None else self.policy_version - t.first_version

    def least_important_running(self, e: EngineState) -> TrajState | None:
        """The running turn with the largest (priority, seq): the one to pause first."""
        while e.by_importance:
            neg_prio, neg_seq, tid = e.by_importance[0]
            t = self._live(tid, e.engine_id, -neg_seq)
            if t is not None and tid in e.running and t.priority == -neg_prio:
                return t
            heapq.heappop(e.by_importance)
        return None

    def live_engines(self) -> list[EngineState]:
        """Engines accepting work, in id order (deterministic)."""
        return [e for e in self.engines.values() if not e.draining]

    def least_loaded(self) -> str | None:
        """The live engine with the fewest outstanding requests per GPU-share of
        capacity; ties go to the first in id order. None when no engine is live."""
        best: EngineState | None = None
        for e in self.live_engines():
            if best is None or e.load * best.max_batch < best.load * e.max_batch:
                best = e
        return None if best is None else best.engine_id
