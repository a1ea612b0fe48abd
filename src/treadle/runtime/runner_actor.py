"""A runner actor's side of `runtime.ray_runners`: trajectories run away from the scheduler.

`RunnerWorker` becomes a Ray actor (an asyncio one: every method runs on its event
loop). The service's calls (`runtime.runner_channel`) bring it batches of messages
(`runtime.runner_wire`), numbered, applied in that order (`runtime.batch_order`),
and take back what its trajectories did: an `exchange` applies its batch, then waits
until there is something and returns everything gathered since the last; a side
`push` only applies its batch (messages that could not wait for a long-polling
exchange to come back). Its trajectories run as they run in the
service — `runtime.rollout.replay_task` and `run_task` over
`runtime.turns.ScheduledTurns` — against `MirrorHost`, a `TrajectoryHost` whose
runners see a `RunnerHost` that mirrors the service's runtime:

- the engines (`Engines`: an HTTP client of its own per engine of the pool), the
  weights' version and cache salt, and whether calls may go (`Weights`, `Hold`);
- what a runner tells the runtime (events, calls started and ended, the journal,
  its end) is queued for the next exchange's answer, in order; a failed call is a
  question (`CallFailed`) whose `Answer` comes in a later batch;
- what the runtime tells a runner (`AdmitTurn`, `PreemptTurn`, ...) is applied to
  it as its batch is, in the order the scheduler decided.

A suite task runs with the actor's own copy of the service's tokenizer and its own
sandbox pools (`SuitePools` over the service's sandbox backend, sent when the actor
is made: a local backend's sandboxes run on the actor's node); a restarted attempt
plans its resume there, from the journal the service sent (`ResumeFrom`), and the
resume's point goes back (`Resumed`), as does the work tree its judges read
(`Captured`). Rewards run here (some run tests in the sandbox); the rubric's judges
run in the service.

A trajectory whose conversation is the service's (a gateway session: the harness
talks to the service) has only its runner here (`OpenTurns`): each turn is asked
for (`Generate`) and answered (`Generated`), and the conversation's events
(`TurnDone`, `ToolBegan`, `ToolDone`, `TurnsEnded`) reach the runner in order, so the
scheduler hears them as from a runner of its own; its engine calls are this actor's.

Its clock is the service's (the same scale, counted from the same instant), so the
scheduler sees tool latencies and a record's times as if the trajectory ran there.
The actor keeps no state the service needs: lost, its trajectories are run again
elsewhere (`ray_runners`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Coroutine
from typing import Any, Literal

from treadle.agent.journal import JournaledTurn
from treadle.agent.runner import TurnRunner
from treadle.agent.tokenizer import Tokenizer
from treadle.clock import Clock, ScaledClock
from treadle.core.events import Event
from treadle.engines.errors import EngineError
from treadle.envs.base import Suite
from treadle.runtime.batch_order import BatchOrder
from treadle.runtime.call_pacer import CallPacer
from treadle.runtime.contract import Runner
from treadle.runtime.pool import EngineSlot
from treadle.runtime.rollout import replay_task, run_task
from treadle.runtime.runner_wire import (
    AbortForPause,
    AdmitTurn,
    Answer,
    CallEnded,
    CallFailed,
    CallStarted,
    Cancel,
    CancelCall,
    Captured,
    Done,
    DropSuite,
    EngineLost,
    Engines,
    FailTurn,
    Finished,
    Generate,
    Generated,
    Held,
    Hold,
    Journaled,
    KeepSuite,
    OpenTurns,
    Packed,
    PreemptTurn,
    Resumed,
    Sampled,
    SandboxFleet,
    StartReplay,
    StartTask,
    Told,
    ToolBegan,
    ToolDone,
    ToRunner,
    ToService,
    TurnDone,
    TurnsEnded,
    Weights,
    engine_client,
    pack,
    unpack,
)
from treadle.runtime.suite_pools import SuitePools
from treadle.runtime.turns import ScheduledTurns
from treadle.sandbox.base import SandboxBackend
from treadle.sandbox.pool import PoolSettings
from treadle.sandbox.remote import RemoteBackend
from treadle.types import GroupKey, KVAcrossUpdates, ResumePoint, Trajectory

log = logging.getLogger(__name__)


class MirrorHost:
    """The runtime as this actor's runners see it (module docstring)."""

    def __init__(self, clock: Clock, *, request_timeout_s: float | None,
                 turn_retries: int, tokenizer: Tokenizer | None = None,
                 sandboxes: SuitePools | None = None) -> None:
        self.clock = clock
        self.request_timeout_s = request_timeout_s
        self.turn_retries = turn_retries
        self.tokenizer = tokenizer  # the service's (suite tasks; None: replays only)
        self.sandboxes = sandboxes or SuitePools(None, PoolSettings())
        self.suites: dict[str, Suite] = {}  # what `StartTask.suite` names
        self.policy_version = 0
        self.cache_salt = ""
        self.engines: dict[str, EngineSlot] = {}
        self.runners: dict[str, ScheduledTurns] = {}
        self.outbox: list[ToService] = []
        self.gathered = asyncio.Event()  # set while `outbox` holds something
        self.gate = asyncio.Event()  # set while engine calls may go
        self.queries: dict[int, asyncio.Future[Literal["failed", "retry"]]] = {}
        self._query_ids = 0
        self.tasks: dict[str, asyncio.Task[Trajectory]] = {}
        self.calls: dict[tuple[str, int], asyncio.Task[None]] = {}  # driven turns running
        self.attempts: dict[str, int] = {}  # of the trajectories it runs
        self._background: set[asyncio.Task[Any]] = set()

    def send(self, message: ToService) -> None:
        self.outbox.append(message)
        self.gathered.set()

    # -- TrajectoryHost (for replay_task) -------------------------------------------------

    def turns(self, traj_id: str, group_id: str,
              kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE, *,
              judge: bool = False, max_staleness: int | None = None) -> TurnRunner:
        runner = ScheduledTurns(_Link(self, traj_id), traj_id, group_id, kv, judge=judge,
                                max_staleness=max_staleness,
                                attempt=self.attempts.get(traj_id, 0))
        self.runners[traj_id] = runner
        return runner

    # -- the messages of a batch -----------------------------------------------------------

    def apply(self, batch: list[ToRunner]) -> None:
        removed: list[str] = []
        for m in batch:
            if isinstance(m, Engines):
                for a in m.added:
                    if a.engine_id not in self.engines:
                        self.engines[a.engine_id] = EngineSlot(
                            a.engine_id, engine_client(a), a.tp, a.max_batch,
                            a.kv_capacity_tokens, a.label)
                removed += m.removed
            elif isinstance(m, Weights):
                self.policy_version, self.cache_salt = m.policy_version, m.cache_salt
                if m.open:
                    self.gate.set()
                else:
                    self.gate.clear()
            elif isinstance(m, Hold):
                self.gate.clear()
                self.send(Held(m.hold_id))  # after every CallStarted sent before
            elif isinstance(m, KeepSuite):
                self.suites[m.key] = m.suite
            elif isinstance(m, DropSuite):
                self.suites.pop(m.key, None)
            elif isinstance(m, SandboxFleet):
                self._follow(m.accepting)
            elif isinstance(m, StartReplay | StartTask):
                self.attempts[m.traj_id] = m.attempt
                # A task's suite is looked up now: a DropSuite later in this batch
                # must not pull it away before the task's first step.
                task = asyncio.get_running_loop().create_task(
                    self._replay(m) if isinstance(m, StartReplay)
                    else self._task(m, self.suites.get(m.suite)))
                task.add_done_callback(functools.partial(self._settled, m.traj_id))
                self.tasks[m.traj_id] = task
            elif isinstance(m, OpenTurns):
                self.turns(m.traj_id, m.group_id, m.kv, max_staleness=m.max_staleness)
            elif isinstance(m, Generate):
                key = (m.traj_id, m.call)
                call = asyncio.get_running_loop().create_task(self._generate(m))
                call.add_done_callback(functools.partial(self._call_over, key))
                self.calls[key] = call
            elif isinstance(m, CancelCall):
                if (running_call := self.calls.get((m.traj_id, m.call))) is not None:
                    running_call.cancel()
            elif isinstance(m, TurnDone | ToolBegan | ToolDone | TurnsEnded):
                runner = self.runners.get(m.traj_id)
                if runner is not None:
                    _drive(runner, m)
            elif isinstance(m, Cancel):
                running = self.tasks.get(m.traj_id)
                if running is not None:
                    running.cancel()
            elif isinstance(m, Answer):
                future = self.queries.pop(m.query_id, None)
                if future is not None and not future.done():
                    future.set_result(m.verdict)
            else:
                runner = self.runners.get(m.traj_id)
                if runner is not None:
                    _decide(runner, m)
        for engine_id in removed:  # after the decisions: their EngineLost came first
            slot = self.engines.pop(engine_id, None)
            if slot is not None:
                self.spawn(slot.engine.aclose())

    def _call_over(self, key: tuple[str, int], _task: asyncio.Task[None]) -> None:
        self.calls.pop(key, None)

    async def _generate(self, m: Generate) -> None:
        """A driven turn (module docstring); its answer always goes back, but for a
        cancel (the service gave it up)."""
        runner = self.runners.get(m.traj_id)
        try:
            if runner is None:
                raise RuntimeError(f"trajectory {m.traj_id} has no runner here")
            out = await runner.generate(m.prompt_ids, m.max_tokens, m.sampling, m.stop_ids)
        except EngineError as e:
            self.send(Generated(m.traj_id, m.call, None, e))
        except Exception as e:
            self.send(Generated(m.traj_id, m.call, None, failure=f"{type(e).__name__}: {e}"))
        else:
            self.send(Generated(m.traj_id, m.call, out))

    async def _replay(self, m: StartReplay) -> Trajectory:
        journal = _Journal(self, m.traj_id) if m.journaled else None
        kept = m.resume
        return await replay_task(
            self, m.spec, traj_id=m.traj_id, key=GroupKey(m.group_id, m.repetition),
            task_id=m.task_id, attempt=m.attempt, kv=m.kv, journal=journal,
            resume=None if kept is None else (lambda _replay_of: kept),
            max_staleness=m.max_staleness)

    def _follow(self, accepting: tuple[str, ...]) -> None:
        """The fleet's servers, followed by this actor's copy of its backend."""
        backend = self.sandboxes.backend
        if isinstance(backend, RemoteBackend):
            backend.follow(accepting)
        else:  # the service sends none for another backend: a bug, but not this task's
            log.error("sandbox servers sent to a runner whose backend is %s",
                      type(backend).__name__)

    async def _task(self, m: StartTask, suite: Suite | None) -> Trajectory:
        """A suite task (module docstring); a suite not sent, or no tokenizer, raises
        (the service sends neither so: a bug, `Finished.raised`)."""
        if self.tokenizer is None:
            raise RuntimeError("this runner has no tokenizer: it runs replays only")
        if suite is None:
            raise RuntimeError(f"no suite {m.suite!r} was sent to this runner")
        capture = m.capture
        try:
            return await run_task(
                self, suite, m.task, traj_id=m.traj_id, key=GroupKey(m.group_id, m.repetition),
                tokenizer=self.tokenizer, sandboxes=self.sandboxes.pool(suite, m.task),
                limits=m.limits, sampling=m.sampling, chat_format=m.chat_format,
                attempt=m.attempt, kv=m.kv,
                journal=_Journal(self, m.traj_id) if m.journaled else None,
                resume=None if m.resume is None else m.resume.planner(
                    functools.partial(self._resumed, m.traj_id)),
                capture=capture, max_staleness=m.max_staleness)
        finally:
            if capture is not None:  # before its Finished: the service judges with it
                self.send(Captured(m.traj_id, capture.tree, capture.error))

    def _resumed(self, traj_id: str, point: ResumePoint) -> None:
        """A restarted attempt's resume, planned here: its point goes back."""
        self.send(Resumed(traj_id, point))

    def _settled(self, traj_id: str, task: asyncio.Task[Trajectory]) -> None:
        """A trajectory's task is over, however (a callback: a task cancelled before
        its first step never runs its body): its end and its record go back."""
        runner = self.runners.pop(traj_id, None)
        if runner is not None and not runner.done:
            runner.ended("abandoned")  # cancelled before its first event, or after
        self.tasks.pop(traj_id, None)
        self.attempts.pop(traj_id, None)
        if task.cancelled():
            self.send(Finished(traj_id, None, "cancelled in its runner"))
        elif (error := task.exception()) is not None:
            log.error("trajectory %s failed in its runner", traj_id, exc_info=error)
            self.send(Finished(traj_id, None, f"{type(error).__name__}: {error}",
                               raised=True))
        else:
            self.send(Finished(traj_id, task.result()))

    def ask(self, traj_id: str, slot: EngineSlot,
            error: EngineError) -> asyncio.Future[Literal["failed", "retry"]]:
        self._query_ids += 1
        future: asyncio.Future[Literal["failed", "retry"]] = (
            asyncio.get_running_loop().create_future())
        self.queries[self._query_ids] = future
        self.send(CallFailed(self._query_ids, traj_id, slot.engine_id, error))
        return future

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        running = [*self.tasks.values(), *self.calls.values(), *self._background]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self.sandboxes.close()
        for slot in self.engines.values():
            with contextlib.suppress(Exception):
                await slot.engine.aclose()


def _drive(runner: ScheduledTurns, m: TurnDone | ToolBegan | ToolDone | TurnsEnded) -> None:
    """Hand the conversation's event `m` to the driven runner it is about."""
    if isinstance(m, TurnDone):
        runner.turn_finished(m.output_tokens, m.context_tokens, m.final)
    elif isinstance(m, ToolBegan):
        runner.tool_started()
    elif isinstance(m, ToolDone):
        runner.tool_finished(m.latency_s, m.output_tokens, m.final)
    else:
        runner.ended(m.reason)


def _decide(runner: ScheduledTurns, m: ToRunner) -> None:
    """Hand the scheduler's decision `m` to the runner it is about."""
    if isinstance(m, AdmitTurn):
        runner.admit(m.engine_id, m.priority)
    elif isinstance(m, PreemptTurn):
        runner.preempt(m.engine_id)
    elif isinstance(m, EngineLost):
        runner.engine_lost(m.engine_id)
    elif isinstance(m, AbortForPause):
        runner.abort_for_pause()
    elif isinstance(m, FailTurn):
        runner.fail(m.error)


class _Link:
    """One trajectory's `RunnerHost`: the mirror, its messages named by the trajectory."""

    def __init__(self, host: MirrorHost, traj_id: str) -> None:
        self._host = host
        self._traj_id = traj_id
        self._sampled = 0

    @property
    def clock(self) -> Clock:
        return self._host.clock

    @property
    def policy_version(self) -> int:
        return self._host.policy_version

    @property
    def cache_salt(self) -> str:
        return self._host.cache_salt

    @property
    def request_timeout_s(self) -> float | None:
        return self._host.request_timeout_s

    @property
    def turn_retries(self) -> int:
        return self._host.turn_retries

    def tell(self, event: Event) -> None:
        self._host.send(Told(self._traj_id, event))

    async def calls_allowed(self) -> None:
        # Looked at again after each wake: a resume and a pause in one batch set the
        # gate and clear it before a woken waiter runs, and Event.wait returns anyway.
        while not self._host.gate.is_set():
            await self._host.gate.wait()

    def admitted_engine(self, engine_id: str) -> EngineSlot | None:
        return self._host.engines.get(engine_id)

    def call_started(self, slot: EngineSlot) -> None:
        self._host.send(CallStarted(self._traj_id, slot.engine_id))

    def call_ended(self, slot: EngineSlot) -> None:
        runner = self._host.runners.get(self._traj_id)
        sampled = runner.sampled if runner is not None else 0
        self._host.send(CallEnded(self._traj_id, slot.engine_id, sampled))

    async def call_failed(self, slot: EngineSlot,
                          error: EngineError) -> Literal["failed", "retry"]:
        return await self._host.ask(self._traj_id, slot, error)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        self._host.spawn(work)

    def trajectory_done(self, runner: Runner) -> None:
        self._host.send(Done(self._traj_id))
        if self._traj_id not in self._host.tasks:  # driven from the service: over here
            self._host.runners.pop(self._traj_id, None)
            self._host.attempts.pop(self._traj_id, None)


class _Journal:
    """A trajectory's `TurnJournal`: its entries go back to the service's journal."""

    def __init__(self, host: MirrorHost, traj_id: str) -> None:
        self._host = host
        self._traj_id = traj_id

    def sampled(self, tokens: int) -> None:
        self._host.send(Sampled(self._traj_id, tokens))

    def turn(self, entry: JournaledTurn) -> None:
        self._host.send(Journaled(self._traj_id, entry.index, entry.tokens, entry.encode()))


class RunnerWorker:
    """The runner actor (module docstring). `now`: the service's clock time when it
    made the actor, on a clock of `scale` (modelled seconds a real second);
    `call_gap_s`: how far apart its exchanges' answers start (`runtime.call_pacer`);
    `tokenizer`, `sandbox` and `pools`: the service's tokenizer, sandbox backend and
    pool settings, for suite tasks."""

    def __init__(self, scale: float, now: float, *, request_timeout_s: float | None,
                 turn_retries: int, call_gap_s: float = 0.0,
                 tokenizer: Tokenizer | None = None, sandbox: SandboxBackend | None = None,
                 pools: PoolSettings | None = None) -> None:
        self._pacer = CallPacer(call_gap_s)  # the exchanges' answers
        clock = ScaledClock(scale, origin=time.monotonic() - now * scale)
        self.host = MirrorHost(clock, request_timeout_s=request_timeout_s,
                               turn_retries=turn_retries, tokenizer=tokenizer,
                               sandboxes=SuitePools(sandbox, pools or PoolSettings()))
        self._order: BatchOrder[list[Packed]] = BatchOrder(
            lambda batch: self.host.apply(unpack(batch)))

    def where(self) -> tuple[int, str]:
        """(this process's id, the Ray node it runs on)."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def sandbox_waiting(self) -> int:
        """Starts waiting for a sandbox in its pools now (a sandbox fleet's demand)."""
        return self.host.sandboxes.waiting()

    async def push(self, seq: int, batch: list[Packed]) -> None:
        """A side push: batch `seq` of messages (`runner_wire.pack`ed), applied in its
        order (`BatchOrder`)."""
        self._order.arrive(seq, batch)

    async def exchange(self, seq: int, batch: list[Packed]) -> list[Packed]:
        """Batch `seq`, applied in its order as `push` does; then what its trajectories
        did since the last exchange (`pack`ed), once there is some, the answers
        `call_gap_s` apart while they keep coming."""
        self._order.arrive(seq, batch)
        await self.host.gathered.wait()
        await self._pacer.wait()
        out, self.host.outbox = self.host.outbox, []
        self.host.gathered.clear()
        return pack(out)

    async def close(self) -> None:
        await self.host.close()
