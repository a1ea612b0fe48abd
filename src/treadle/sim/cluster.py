"""The simulator's driver: a cluster of `SimEngine`s and a workload, run under a
scheduler from `core` on a simulated clock (what it keeps and reports:
`sim.records`).

It plays the part the live runtime plays in production: it feeds the scheduler
events in time order and carries out its decisions. It also holds the truth the
scheduler must not see: a turn's output length is revealed (as `TurnFinished`)
only once the engine has generated it, a tool's latency only when it returns.

The constructor's trajectories arrive at t = 0 (one synchronous RL step; `run`
reports the makespan). A multi-step driver (`sim.steps`) also `launch`es and
`abort`s trajectories, `pause_engines` (new weights, a colocated trainer),
`set_policy_version` and hears of every finished trajectory (`on_finish`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from treadle.core.cost_model import CostModel
from treadle.core.events import (
    AddEngine,
    Admit,
    Decision,
    DrainEngine,
    EngineAdded,
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
from treadle.core.scheduler import Scheduler
from treadle.sim.engine import SimEngine
from treadle.sim.kernel import Handle, Kernel
from treadle.sim.records import SimResult, SimTrajectory
from treadle.sim.timeline import EngineInfo, Span
from treadle.workloads import TrajectorySpec

DECIDE_ORDER = 100  # a decide() runs after every other callback of its instant


class Cluster:
    """Runs one workload under one scheduler."""

    def __init__(self, cost: CostModel, gpus: int, scheduler: Scheduler,
                 trajectories: list[TrajectorySpec], initial_pool: list[int],
                 *, max_batch: int = 1024, record_spans: bool = False,
                 on_finish: Callable[[str], None] | None = None) -> None:
        if sum(initial_pool) > gpus:
            raise ValueError(f"initial pool needs {sum(initial_pool)} GPUs, cluster has {gpus}")
        self.cost, self.gpus, self.sched = cost, gpus, scheduler
        self.max_batch = max_batch
        self.kernel = Kernel()
        self.engines: dict[str, SimEngine] = {}
        self.all_engines: list[SimEngine] = []
        self._engine_span: dict[str, list[float]] = {}
        self._next_engine = 0
        self._gpus_used = 0
        self._draining: set[str] = set()
        # TP degrees of `AddEngine`s waiting for GPUs that engines still draining
        # hold (a launcher waits for them, as a Ray placement group does).
        self._awaiting_gpus: list[int] = []
        self._waiting: dict[str, list[tuple[float, int, str]]] = {}  # engine-side KV queue
        self._wait_seq = 0
        self._pending: dict[str, tuple[Handle, str]] = {}  # engine -> next own event
        self._decide_at: float | None = None
        self._wakes: set[float] = set()  # times a scheduler wake-up is pending
        self.trajs = {s.traj_id: SimTrajectory(s, context=s.prompt_tokens,
                                               new_tokens=s.prompt_tokens)
                      for s in trajectories}
        self._hash = hashlib.sha256()
        self.record_spans = record_spans
        self.spans: list[Span] = []
        self.kv_evictions = 0
        self.reconfigurations = 0
        self._unfinished = len(self.trajs)
        self.on_finish = on_finish
        self.policy_version = 0  # weights the engines serve (`set_policy_version`)
        for tp in initial_pool:
            self._start_engine(tp, ready_at=0.0)
        for spec in trajectories:
            self.kernel.at(0.0, self._arrive(spec))

    # -- running ---------------------------------------------------------------------

    def run(self, max_events: int = 50_000_000) -> SimResult:
        self.kernel.run(max_events=max_events)
        return self.result()

    def result(self) -> SimResult:
        """What the run measured; RuntimeError if a trajectory never finished."""
        if self._unfinished:
            stuck = sorted(t for t, s in self.trajs.items() if s.finished_at is None)[:5]
            raise RuntimeError(f"{self._unfinished} trajectories never finished, e.g. {stuck}")
        makespan = max(s.finished_at or 0.0 for s in self.trajs.values())
        longest = max(self.trajs.values(),
                      key=lambda s: (s.spec.output_tokens, s.spec.traj_id))
        infos = []
        for e in self.all_engines:
            life = self._engine_span[e.engine_id]
            infos.append(EngineInfo(e.engine_id, e.tp, start=life[0],
                                    end=life[1] if len(life) > 1 else None))
        return SimResult(
            makespan_s=makespan,
            output_tokens=sum(s.spec.output_tokens for s in self.trajs.values()),
            gpus=self.gpus,
            engine_gpu_busy_s=sum(e.busy_s * e.tp for e in self.all_engines),
            longest_traj_id=longest.spec.traj_id,
            longest_queue_s=longest.queue_s,
            preemptions=self.sched.preemptions, kv_evictions=self.kv_evictions,
            migrations=self.sched.migrations, reconfigurations=self.reconfigurations,
            events=self.kernel.fired, trace_digest=self._hash.hexdigest(),
            spans=self.spans, engines=infos,
        )

    def _trace(self, kind: str, traj: str, engine: str) -> None:
        self._hash.update(f"{self.kernel.now:.9f} {kind} {traj} {engine}\n".encode())

    def _emit(self, event: Event) -> None:
        now = self.kernel.now
        self.sched.on_event(event, now)
        if self._decide_at != now:
            self._decide_at = now
            self.kernel.at(now, self._decide, order=DECIDE_ORDER)

    def _decide(self) -> None:
        now = self.kernel.now
        self._decide_at = None
        for d in self.sched.decide(now):
            self._apply(d)
        wake = self.sched.wakeup()
        if wake is not None and wake > now and self._unfinished and wake not in self._wakes:
            self._wakes.add(wake)
            self.kernel.at(wake, self._wake, order=DECIDE_ORDER)

    def _wake(self) -> None:
        self._wakes.discard(self.kernel.now)
        if self._decide_at != self.kernel.now:
            self._decide()

    # -- trajectories -------------------------------------------------------------------

    def _arrive(self, spec: TrajectorySpec, judge: bool = False) -> Callable[[], None]:
        def fire() -> None:
            self._trace("judge" if judge else "arrive", spec.traj_id, "")
            self._emit(TrajectoryArrived(spec.traj_id, spec.group_id, spec.prompt_tokens, judge))
        return fire

    def _turn_done(self, eng: SimEngine, tid: str) -> None:
        now = self.kernel.now
        st = self.trajs[tid]
        context, _ = eng.leave(tid, keep_cache=True)
        self._span(eng.engine_id, tid, "turn", st.span_start, now)
        turn = st.spec.turns[st.turn]
        st.context = context
        st.sampled += turn.output_tokens
        final = st.turn == len(st.spec.turns) - 1
        self._trace("turn", tid, eng.engine_id)
        self._emit(TurnFinished(tid, eng.engine_id, turn.output_tokens, round(context), final))
        if final:
            st.finished_at = now
            self._unfinished -= 1
            if self.on_finish is not None:
                self.on_finish(tid)
            return
        self._emit(ToolCallStarted(tid))
        st.span_start = now
        st.tool = self.kernel.after(turn.tool_latency_s, self._tool_done(tid, eng.engine_id))

    def _tool_done(self, tid: str, home: str) -> Callable[[], None]:
        def fire() -> None:
            st = self.trajs[tid]
            turn = st.spec.turns[st.turn]
            st.tool = None
            self._span(home, tid, "tool", st.span_start, self.kernel.now)
            st.turn += 1
            st.turn_done = 0.0
            st.context += turn.tool_output_tokens
            st.new_tokens = turn.tool_output_tokens
            st.ready_at = self.kernel.now
            self._trace("tool", tid, "")
            self._emit(ToolCallFinished(tid, turn.tool_latency_s, turn.tool_output_tokens))
        return fire

    def _span(self, eid: str, tid: str, kind: str, start: float, end: float,
              dst: str = "") -> None:
        if self.record_spans and end > start:
            self.spans.append(Span(eid, tid, kind, start, end, dst))

    # -- what a multi-step driver does ----------------------------------------------------

    def digest(self) -> str:
        """sha256 of the event trace so far."""
        return self._hash.hexdigest()

    def launch(self, spec: TrajectorySpec, *, judge: bool = False) -> None:
        """A new trajectory arrives now (with `judge`: a judge's call, of the
        scheduler's judge class); its id must be new to this cluster."""
        if spec.traj_id in self.trajs:
            raise ValueError(f"trajectory {spec.traj_id!r} was launched already")
        self.trajs[spec.traj_id] = SimTrajectory(spec, context=spec.prompt_tokens,
                                                 new_tokens=spec.prompt_tokens,
                                                 ready_at=self.kernel.now)
        self._unfinished += 1
        self._arrive(spec, judge)()

    def sampled(self, tid: str) -> float:
        """Output tokens the trajectory has sampled so far (a running turn's too)."""
        st, eng = self.trajs[tid], self._engine_running(tid)
        if eng is None:
            return st.sampled + (0.0 if st.tool is not None else st.turn_done)
        eng.advance(self.kernel.now)
        return st.sampled + eng.progress(tid)

    def abort(self, tid: str, reason: str) -> float:
        """End an unfinished trajectory now, wherever it is (generating, waiting, in
        a tool call), dropping its KV; the scheduler hears `TrajectoryEnded`. Returns
        the output tokens it had sampled, which are thrown away."""
        st = self.trajs[tid]
        if st.finished_at is not None:
            raise ValueError(f"trajectory {tid!r} has finished; nothing to abort")
        tokens = self.sampled(tid)
        eng = self._engine_running(tid)
        if eng is not None:
            self._leave(eng, tid, keep_cache=False)
        for eid, waiting in self._waiting.items():
            if any(w == tid for _, _, w in waiting):
                waiting[:] = [w for w in waiting if w[2] != tid]
                if eid in self.engines:
                    self._fill(self.engines[eid])
        for handle in (st.deferred, st.tool):
            if handle is not None:
                handle.cancel()
        for e in self.engines.values():
            e.take_cached(tid)
        del self.trajs[tid]
        self._unfinished -= 1
        self._trace("abort", tid, reason)
        self._emit(TrajectoryEnded(tid, reason))
        if eng is not None:
            self._fill(eng)
        return tokens

    def pause_engines(self, until: Callable[[SimEngine], float], *, drop_kv: bool) -> None:
        """Pause every engine until `until(engine)`. With `drop_kv` the engines lose
        their KV (new weights, or a trainer taking the memory): running turns are
        evicted (`TurnPreempted`; they re-prefill when they run again), cached
        prefixes and KV in transit are dropped."""
        now = self.kernel.now
        for eid in sorted(self.engines):
            eng = self.engines[eid]
            eng.advance(now)
            if drop_kv:
                for tid in sorted(eng.running):
                    self._leave(eng, tid, keep_cache=False)
                    self._trace("drop", tid, eid)
                    self._emit(TurnPreempted(tid, eid, int(self.trajs[tid].turn_done)))
                eng.clear_cache()
            eng.pause(until(eng))
            self._reschedule(eng)
        if drop_kv:
            for st in self.trajs.values():
                st.kv_arrives = None

    def set_policy_version(self, version: int) -> None:
        """The engines serve `version` from now on (`PolicyUpdated`)."""
        self.policy_version = version
        self._trace("policy", "", str(version))
        self._emit(PolicyUpdated(version))

    def _engine_running(self, tid: str) -> SimEngine | None:
        return next((e for e in self.engines.values() if tid in e.running), None)

    # -- decisions ------------------------------------------------------------------------

    def _apply(self, d: Decision) -> None:
        if isinstance(d, Admit):
            self._admit(d.traj_id, d.engine_id, d.priority)
        elif isinstance(d, Preempt):
            self._preempt(d.traj_id, d.engine_id)
        elif isinstance(d, Migrate):
            self._migrate(d.traj_id, d.src_engine_id, d.dst_engine_id)
        elif isinstance(d, AddEngine):
            draining = sum(self.engines[e].tp for e in self._draining if e in self.engines)
            if self._gpus_used - draining + sum(self._awaiting_gpus) + d.tp > self.gpus:
                raise ValueError(f"no room for a TP-{d.tp} engine: {self._gpus_used}/"
                                 f"{self.gpus} GPUs in use, {draining} being drained")
            self._awaiting_gpus.append(d.tp)
            self._start_awaited()
        elif isinstance(d, DrainEngine):
            self._draining.add(d.engine_id)
            self._maybe_remove(d.engine_id)

    def _admit(self, tid: str, eid: str, prio: float) -> None:
        st = self.trajs[tid]
        st.deferred = None
        eng = self.engines[eid]
        if st.kv_arrives is not None:
            dst, tokens, at = st.kv_arrives
            if at > self.kernel.now and dst == eid:  # KV still moving: join when it lands
                st.deferred = self.kernel.at(at, lambda: self._admit(tid, eid, prio))
                return
            st.kv_arrives = None
            if dst in self.engines:
                self.engines[dst].put_cached(tid, tokens)
        eng.advance(self.kernel.now)
        if eng.fits(st.context) or not eng.running:
            self._join(eng, tid, prio)
        else:
            self._wait_seq += 1
            waiting = self._waiting.setdefault(eid, [])
            waiting.append((prio, self._wait_seq, tid))
            waiting.sort()
        self._reschedule(eng)

    def _join(self, eng: SimEngine, tid: str, prio: float) -> None:
        now = self.kernel.now
        st = self.trajs[tid]
        turn = st.spec.turns[st.turn]
        st.queue_s += now - st.ready_at
        if self.record_spans and st.ready_at < now and st.turn_done > 0:
            self._span(eng.engine_id, tid, "preempted", st.ready_at, now)
        eng.join(tid, now, st.context, st.new_tokens, turn.output_tokens - st.turn_done,
                 st.turn_done, prio)
        if st.first_version is None:
            st.first_version = self.policy_version
        st.new_tokens = 0.0
        st.span_start = now
        self._trace("join", tid, eng.engine_id)

    def _preempt(self, tid: str, eid: str) -> None:
        eng = self.engines[eid]
        waiting = self._waiting.get(eid, [])
        for i, (_, _, w) in enumerate(waiting):
            if w == tid:  # never joined: nothing to undo on the engine
                del waiting[i]
                return
        if tid not in eng.running:
            st = self.trajs[tid]
            if st.deferred is not None:  # its KV is still in flight: call off the join
                st.deferred.cancel()
                st.deferred = None
            return
        eng.advance(self.kernel.now)
        self._leave(eng, tid, keep_cache=True)
        self._trace("preempt", tid, eid)
        self._fill(eng)

    def _leave(self, eng: SimEngine, tid: str, keep_cache: bool) -> None:
        st = self.trajs[tid]
        st.context, st.turn_done = eng.leave(tid, keep_cache=keep_cache)
        if not keep_cache:
            st.new_tokens = st.context  # KV dropped: everything re-prefills
        self._span(eng.engine_id, tid, "turn", st.span_start, self.kernel.now)
        st.ready_at = self.kernel.now
        self._reschedule(eng)

    def _migrate(self, tid: str, src: str, dst: str) -> None:
        st = self.trajs[tid]
        if st.kv_arrives is not None:
            # A second move in one tool gap: the KV is still on its way to the first
            # destination (the source keeps its blocks until the transfer is done) or
            # waits there; either copy is sent on to the new one.
            tokens = st.kv_arrives[1]
        else:
            tokens = self.engines[src].take_cached(tid) if src in self.engines else 0.0
        if tokens <= 0:
            return  # nothing cached to move: the next turn re-prefills on dst
        now = self.kernel.now
        took = self.cost.migration_time(tokens)
        st.kv_arrives = (dst, tokens, now + took)
        self._span(src, tid, "migrate", now, now + took, dst)
        self._trace("migrate", tid, dst)

    # -- engines --------------------------------------------------------------------------

    def _start_engine(self, tp: int, ready_at: float) -> None:
        if self._gpus_used + tp > self.gpus:
            raise ValueError(f"no room for a TP-{tp} engine: {self._gpus_used}/{self.gpus} "
                             "GPUs in use")
        self._gpus_used += tp
        eid = f"e{self._next_engine:03d}"
        self._next_engine += 1

        def up() -> None:
            eng = SimEngine(eid, tp, self.cost, self.max_batch)
            eng.t = self.kernel.now
            self.engines[eid] = eng
            self.all_engines.append(eng)
            self._engine_span[eid] = [self.kernel.now]
            self._trace("engine_up", "", eid)
            self._emit(EngineAdded(eid, tp, self.max_batch, eng.kv_capacity))

        if ready_at <= self.kernel.now:
            up()
        else:
            self.kernel.at(ready_at, up)

    def _maybe_remove(self, eid: str) -> None:
        eng = self.engines.get(eid)
        if eng is None or eid not in self._draining or eng.running or self._waiting.get(eid):
            return
        eng.advance(self.kernel.now)
        del self.engines[eid]
        self._draining.discard(eid)
        self._gpus_used -= eng.tp
        self._engine_span[eid].append(self.kernel.now)
        pending = self._pending.pop(eid, None)
        if pending:
            pending[0].cancel()
        self._trace("engine_down", "", eid)
        self._emit(EngineRemoved(eid))
        self._start_awaited()

    def _start_awaited(self) -> None:
        """Start the added engines that the free GPUs hold, in the order asked."""
        while self._awaiting_gpus and self._gpus_used + self._awaiting_gpus[0] <= self.gpus:
            tp = self._awaiting_gpus.pop(0)
            self.reconfigurations += 1
            self._start_engine(tp, ready_at=self.kernel.now + self.cost.restart_time(tp))

    def _reschedule(self, eng: SimEngine) -> None:
        old = self._pending.pop(eng.engine_id, None)
        if old:
            old[0].cancel()
        nxt = eng.next_event()
        if nxt is None:
            return
        at, kind = nxt
        at = max(at, self.kernel.now)
        self._pending[eng.engine_id] = (self.kernel.at(at, lambda: self._engine_event(eng)), kind)

    def _engine_event(self, eng: SimEngine) -> None:
        _, kind = self._pending.pop(eng.engine_id)
        eng.advance(self.kernel.now)
        if kind == "kv_full" and len(eng.running) > 1:
            victim = eng.evict_victim()
            self.kv_evictions += 1
            self._leave(eng, victim, keep_cache=False)
            self._trace("evict", victim, eng.engine_id)
            self._emit(TurnPreempted(victim, eng.engine_id, int(self.trajs[victim].turn_done)))
        for tid in eng.finished(due=kind == "done"):
            self._turn_done(eng, tid)
        self._fill(eng)
        self._reschedule(eng)

    def _fill(self, eng: SimEngine) -> None:
        """Let sequences waiting for KV join, then drop the engine if it drains."""
        waiting = self._waiting.get(eng.engine_id)
        while waiting:
            prio, _, tid = waiting[0]
            if not (eng.fits(self.trajs[tid].context) or not eng.running):
                break
            waiting.pop(0)
            self._join(eng, tid, prio)
        self._reschedule(eng)
        self._maybe_remove(eng.engine_id)

