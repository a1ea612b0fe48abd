"""The live runtime: treadle's scheduling core driven by real engines on a clock.

    runtime = Runtime(build_policy(...), launcher=LocalLauncher(EmulatedProcess()), gpus=8)
    await runtime.start()                              # the policy's initial pool
    turns = runtime.turns("t0", group_id="g0")         # a TurnRunner for the agent loop
    traj = await run_agent(episode, tokenizer, turns, traj_id="t0", key=...)
    await runtime.close()

It is the counterpart of the simulator's `Cluster`: it feeds the scheduler
(`core.scheduler.Scheduler`) the events of real trajectories in time order and
carries out its decisions —

- `Admit`: the trajectory's waiting turn is sent to that engine with that priority;
- `Preempt`: the engine aborts the call; the turn keeps its tokens and waits for
  its next admission (see `runtime.turns`);
- `Migrate`: counted; the next turn goes to the new engine, which prefills the
  context itself (no engine here can receive KV from another);
- `AddEngine`: the launcher starts an engine of that TP degree (`EngineAdded` when
  it is healthy); `DrainEngine`: nothing more is sent there and it is stopped and
  removed (`EngineRemoved`) once no call is in flight on it.

Parts: `runtime.control` feeds the scheduler and times it, `runtime.pool` holds the
engines, `runtime.turns` runs each trajectory's turns; the runtime and those runners
see each other only through `runtime.contract` (`RunnerHost`, `Runner`; runners in
other processes, `runtime.ray_runners`, are `adopt`ed proxies of a `follow`er).

Time is the `Clock`'s: every wait of the runtime — the scheduler's wake-ups, the
grace for engines to come back, relaunch back-offs, health checks — is on it, so a
`ScaledClock` replays a trace faster than real while the scheduler sees the trace's
seconds, and a `treadle.testing.FakeClock` makes it exact in tests. Only
`request_timeout_s`, handed to the engines' HTTP clients, is real seconds. The
scheduler is called synchronously on the event loop and timed (`Runtime.control`).
Nothing else blocking runs on the loop: engines are HTTP clients, tools run in
sandboxes (subprocesses), file I/O goes to threads.

Failures: an engine whose call fails is health-checked; a dead one is failed
(`EngineFailed`: every trajectory it held is re-routed, re-prefilled elsewhere) and
stopped, and if this runtime launched it, a replacement is launched on its GPUs
under the `RelaunchPolicy` (bounded attempts, back-off on the clock). A background
check fails engines that stop answering, busy ones too (a stopped process would
hold its calls until their timeout); one that says it does not serve the model is
failed at once. While no engine is live (none yet, or the last one failed, was
removed or drained), a waiting turn is given a
grace of `engine_wait_s` from the later of that moment and the start of its wait:
an engine registered or launched within it picks the turn up; after it the turn
fails with `NoEngineAvailable` (its trajectory ends with status error, stage
engine) — unless an engine is starting then, in which case that start's end
decides. Every engine call carries `request_timeout_s`.

Weight updates: `pause("drain")` holds new calls and waits until none is in flight;
`pause("abort")` also aborts the calls in flight (their turns resume later). After
the engines' weights change, `resume(policy_version=v)` stamps `v` on every token
sampled from then on. `update_weights` does all three, in one of three modes
("abort", "drain", "keep": calls in flight frozen in engines that can keep them and
continued under the new weights), within a timeout after which the old weights
serve; an engine launched afterwards (a replacement, an `AddEngine`) loads the same
weights before it joins. Every engine call carries the cache salt of the weights
(`cache_salt`), so KV cached under old weights serves a new call only where its
trajectory chose to keep KV across updates.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, Literal

from treadle.clock import Clock, WallClock
from treadle.core.events import (
    AddEngine,
    Admit,
    Decision,
    DrainEngine,
    EngineFailed,
    Event,
    Migrate,
    PolicyUpdated,
    Preempt,
)
from treadle.core.scheduler import Scheduler
from treadle.engines.base import Engine, PauseMode
from treadle.engines.errors import (
    EngineError,
    EngineStartError,
    NoEngineAvailable,
    WeightUpdateTimeout,
)
from treadle.runtime.contract import Runner, RuntimeFollower
from treadle.runtime.control import ControlStats, DecisionLoop
from treadle.runtime.launcher import EngineLauncher, LaunchedEngine
from treadle.runtime.pool import DEFAULT_RELAUNCH, EnginePool, EngineSlot, RelaunchPolicy
from treadle.runtime.turns import ScheduledTurns
from treadle.runtime.weights import WeightUpdate, keeps, quiesce, roll_back, weights_salt
from treadle.types import KVAcrossUpdates

__all__ = ["ControlStats", "EngineSlot", "RelaunchPolicy", "Runtime", "WeightUpdate"]

log = logging.getLogger(__name__)


class Runtime:
    """Drives one `Scheduler` over a pool of engines. See the module docstring.

    Durations are seconds of `clock` except `request_timeout_s` (real seconds).
    `relaunch=None` never replaces a failed engine. `engine_ids` prefixes its engines'
    ids, so that two runtimes of one service never hand out the same id.
    """

    def __init__(self, scheduler: Scheduler, *, launcher: EngineLauncher | None = None,
                 gpus: int = 0, clock: Clock | None = None,
                 request_timeout_s: float | None = 600.0, turn_retries: int = 3,
                 engine_wait_s: float = 60.0, health_interval_s: float = 5.0,
                 relaunch: RelaunchPolicy | None = DEFAULT_RELAUNCH,
                 engine_ids: str = "e") -> None:
        self.scheduler = scheduler
        self.launcher = launcher
        self.gpus = gpus  # GPUs the launcher may use (initial pool and AddEngine)
        self.clock: Clock = clock or WallClock()
        self.request_timeout_s = request_timeout_s  # real seconds per engine call
        self.turn_retries = turn_retries  # calls repeated on a live engine before giving up
        self.engine_wait_s = engine_wait_s  # a waiting turn's grace while no engine is live
        self.policy_version = 0  # stamped on every sampled token
        # One salt per set of weights this runtime served: the same version loaded
        # again (a rolled-back update) must not meet KV a trajectory that kept its KV
        # across updates computed under other weights with that version's salt.
        self._salt_prefix = uuid.uuid4().hex[:8]
        self._weights_served = 0
        self.trainer_run: str | None = None  # the run whose weights the engines serve
        self.control = ControlStats()
        self.pool = EnginePool(self, self.clock, launcher=launcher, gpus=gpus,
                               health_interval_s=health_interval_s, relaunch=relaunch,
                               id_prefix=engine_ids)
        self._decisions = DecisionLoop(scheduler, self.clock, self.control, self._apply,
                                       wanted=lambda: bool(self._runners))
        self._runners: dict[str, Runner] = {}
        self._announced = 0  # the newest version the scheduler was told of
        self._gate = asyncio.Event()  # set while engine calls may be sent
        self._gate.set()
        self._weights: tuple[str, int] | None = None  # the last update's (path, version)
        self._lost_at: float | None = self.clock.now()  # when the last live engine went
        self._grace: asyncio.Task[None] | None = None  # fails waiters while none is live
        self._grace_poke = asyncio.Event()  # capacity changed: the grace looks again
        self._tasks: set[asyncio.Task[Any]] = set()
        self._followers: list[RuntimeFollower] = []  # runners' hosts elsewhere
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------

    async def start(self, pool: Sequence[int] | None = None) -> None:
        """Start `pool` (TP degrees; default the scheduler's initial pool on `gpus`)
        with the launcher, if there is one, and the health checks. EngineStartError if
        no engine of the pool came up."""
        if self.launcher is not None and (self.gpus > 0 or pool):
            pool = list(pool) if pool else self.scheduler.initial_pool(self.gpus)
            results = await asyncio.gather(*(self.pool.launch(tp) for tp in pool),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            for tp, r in zip(pool, results, strict=True):
                if isinstance(r, BaseException):
                    log.error("a TP-%d engine of the pool did not start: %s: %s", tp,
                              type(r).__name__, r)
            if errors and len(errors) == len(results):
                raise EngineStartError(f"no engine of the pool {pool} started: {errors[0]}")
        self.pool.watch_health()
        self.capacity_changed()

    async def close(self) -> None:
        """Stop engines this runtime launched, close every client; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._decisions.close()
        tasks = [t for t in (self._grace, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pool.close()

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    # -- trajectories ------------------------------------------------------------------

    def turns(self, traj_id: str, group_id: str,
              kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE, *,
              judge: bool = False, max_staleness: int | None = None) -> ScheduledTurns:
        """The runner of a new trajectory (its first `generate` announces it); `kv`:
        what its calls after a weight update do with KV cached before it; `judge`: a
        judge's call, of the scheduler's judge class (after rollouts, preempted first);
        `max_staleness`: its job's bound, which a policy weighing staleness schedules
        it by (None: the policy's own)."""
        runner = ScheduledTurns(self, traj_id, group_id, kv, judge=judge,
                                max_staleness=max_staleness)
        self.adopt(runner)
        return runner

    def adopt(self, runner: Runner) -> None:
        """Schedule a trajectory's runner (`turns`', or a runner actor's proxy)."""
        if runner.traj_id in self._runners:
            raise ValueError(f"trajectory {runner.traj_id!r} is already running")
        self._runners[runner.traj_id] = runner
        self.control.max_live = max(self.control.max_live, len(self._runners))

    def follow(self, follower: RuntimeFollower) -> None:
        self._followers.append(follower)  # told of holds, releases and engine changes

    @property
    def live_trajectories(self) -> int:
        return len(self._runners)

    def decide(self) -> None:
        """Ask the scheduler for decisions now, without an event (the loop does so
        after every burst of events and at the scheduler's wake-ups)."""
        self._decisions.decide()

    # -- engines -----------------------------------------------------------------------

    def register_engine(self, engine: Engine, *, tp: int = 1, max_batch: int = 256,
                        kv_capacity_tokens: int = 1 << 20, label: str = "",
                        launched: LaunchedEngine | None = None) -> str:
        """Add a healthy engine to the pool; returns its id. The runtime closes its
        client on removal (and stops it if `launched`)."""
        return self.pool.register(engine, tp=tp, max_batch=max_batch,
                                  kv_capacity_tokens=kv_capacity_tokens, label=label,
                                  launched=launched)

    def drain_engine(self, engine_id: str) -> None:
        """Send nothing more to the engine; it is removed once idle (not replaced)."""
        self.pool.drain(engine_id)

    def remove_engine(self, engine_id: str, reason: str = "removed") -> None:
        """Take the engine away now, not replaced; its trajectories move (re-prefill)."""
        self.pool.fail(self.pool.slot(engine_id), reason, replace=False)

    def engines(self) -> list[EngineSlot]:
        """The engines in the pool (failed and removed ones are gone)."""
        return self.pool.slots()

    def has_engines(self) -> bool:
        """True while an engine is live or starting."""
        return self.pool.live() > 0 or self.pool.starting > 0

    @property
    def failures(self) -> Sequence[tuple[str, str]]:
        """The latest engine failures, (label, why), oldest first."""
        return self.pool.failures

    def no_engine_error(self) -> NoEngineAvailable:
        return self.pool.no_engine_error()

    # -- weight updates ------------------------------------------------------------------

    async def pause(self, mode: Literal["drain", "abort"] = "drain") -> None:
        """Hold new engine calls; return once none is in flight. "abort" aborts the
        calls in flight (their turns keep their tokens and resume after `resume`)."""
        self._gate.clear()
        await asyncio.gather(*(f.hold() for f in self._followers))
        if mode == "abort":
            for runner in list(self._runners.values()):
                runner.abort_for_pause()
        await self.pool.idle.wait()

    async def update_weights(self, weights_path: str, policy_version: int,
                             mode: PauseMode = "drain", *, timeout_s: float | None = None,
                             trainer_run: str | None = None) -> WeightUpdate:
        """The weight-update barrier: hold new calls, deal with the calls in flight by
        `mode`, load `weights_path` into every engine, resume stamping
        `policy_version`. Modes:

        - "abort": calls in flight are aborted; their turns keep the tokens the
          engine returned and resume under the new weights;
        - "drain": calls in flight finish under the old weights first;
        - "keep": calls in flight on an engine that can keep them (its
          `capabilities.pause_modes`) are frozen there while it loads and continue
          under the new weights (each token stamped with the weights that sampled it);
          on an engine that cannot, they are aborted and resumed as with "abort".
          New calls are held only while the engines load.

        Bounded: if it has not finished `timeout_s` seconds (clock) after it began,
        WeightUpdateTimeout, and the old weights serve: engines that loaded the new
        ones load the old ones again (within another `timeout_s`) and any that does
        not, or was still loading, is failed (replaced, if launched, by one that loads
        the old weights); the policy version is unchanged. ValueError (before
        pausing) if an engine cannot load weights; an engine that fails to load them
        is failed (its turns move to the others, which serve the new weights) so that
        no token of the old weights is stamped with the new version. Engines launched
        later load these weights before they join."""
        slots = self.pool.slots()
        unable = [s.label for s in slots if not s.engine.capabilities.weight_updates]
        if unable:
            raise ValueError(f"engines cannot load weights: {', '.join(unable)}")
        previous = self._weights
        self._weights = (weights_path, policy_version)
        started = self.clock.now()
        self._gate.clear()
        loads: dict[asyncio.Task[None], EngineSlot] = {}
        kept = aborted = 0
        try:
            async with self.clock.timeout(timeout_s):
                await asyncio.gather(*(f.hold() for f in self._followers))
                quiesced = await quiesce(self._runners.values(), self.pool, mode)
                kept, aborted = quiesced.kept, quiesced.aborted
                for slot in self.pool.slots():  # with any that joined meanwhile
                    engine_mode: PauseMode = ("keep" if mode == "keep" and keeps(slot)
                                              else "drain")
                    task = asyncio.ensure_future(slot.engine.update_weights(
                        weights_path, policy_version, engine_mode,
                        recompute_kept=slot.engine_id in quiesced.recompute_on))
                    loads[task] = slot
                if loads:
                    await asyncio.wait(loads)
        except TimeoutError:
            self._weights = previous
            late = await roll_back(self.pool, loads, previous, self.clock.timeout(timeout_s))
            # Kept calls ran on the new weights meanwhile: their KV takes a new salt.
            self._weights_served += bool(loads)
            self.resume()
            waited = (f"engines still loading: {', '.join(late)}" if late
                      else "calls in flight still running")
            raise WeightUpdateTimeout(
                f"the update to policy version {policy_version} did not finish within "
                f"{timeout_s} s ({waited}); the engines serve policy version "
                f"{self.policy_version}") from None
        except BaseException:
            self._weights = previous
            self.resume()
            raise
        for task, slot in loads.items():
            error = task.exception()
            if error is not None:
                self.pool.fail(slot, f"weight update failed: {error}", replace=False)
        self.resume(policy_version, trainer_run=trainer_run)
        return WeightUpdate(policy_version, mode, self.clock.now() - started, kept, aborted)

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of the weights served now: KV an engine cached for
        calls of other weights never serves a call carrying it."""
        return (f"{weights_salt(self.policy_version, self.trainer_run)}-"
                f"{self._salt_prefix}.{self._weights_served}")

    @property
    def paused(self) -> bool:
        return not self._gate.is_set()

    def resume(self, policy_version: int | None = None, *,
               trainer_run: str | None = None) -> None:
        """Let calls go again, stamping `policy_version` (if given: the weights of
        `trainer_run`, None for an unnamed run) from now on."""
        if policy_version is not None:
            self.policy_version = policy_version
            self.trainer_run = trainer_run
            self._weights_served += 1
            if policy_version > self._announced:
                # Staleness weighs in its priorities, as in the simulator (a new run
                # starting again from version 0 is not an update it can see).
                self._announced = policy_version
                self.tell(PolicyUpdated(policy_version))
        self._gate.set()
        for follower in self._followers:
            follower.released()

    def sampled_tokens(self, traj_id: str) -> int:
        """Tokens the engines returned to a running trajectory so far (0 once it
        has ended): what restarting it discards."""
        runner = self._runners.get(traj_id)
        return runner.sampled if runner is not None else 0

    # -- what a runner may ask (contract.RunnerHost) ---------------------------------

    def tell(self, event: Event) -> None:
        self._decisions.tell(event)
        self._hold_while_no_engine()  # a turn about to wait, perhaps for no engine

    async def calls_allowed(self) -> None:
        while not self._gate.is_set():  # a pause right after a resume: wait again
            await self._gate.wait()

    def admitted_engine(self, engine_id: str) -> EngineSlot | None:
        return self.pool.get(engine_id)

    def call_started(self, slot: EngineSlot) -> None:
        self.pool.call_started(slot)

    def call_ended(self, slot: EngineSlot) -> None:
        self.pool.call_ended(slot)

    async def call_failed(self, slot: EngineSlot,
                          error: EngineError) -> Literal["failed", "retry"]:
        return await self.pool.call_failed(slot, error)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def trajectory_done(self, runner: Runner) -> None:
        self._runners.pop(runner.traj_id, None)
        self.scheduler.forget(runner.traj_id)

    # -- what the pool tells it (pool.PoolOwner) ---------------------------------------

    def engine_event(self, event: Event) -> None:
        for follower in self._followers:
            follower.engines_changed()
        self._decisions.tell(event)
        if isinstance(event, EngineFailed):
            for runner in list(self._runners.values()):
                runner.engine_lost(event.engine_id)

    def capacity_changed(self) -> None:
        if self.pool.live():
            self._lost_at = None
            if self._grace is not None:
                self._grace.cancel()
                self._grace = None
            return
        if self._lost_at is None:
            self._lost_at = self.clock.now()
        self._grace_poke.set()
        self._hold_while_no_engine()

    def holds_admission(self, engine_id: str) -> bool:
        return any(r.admitted_to == engine_id for r in self._runners.values())

    async def prepare(self, launched: LaunchedEngine) -> None:
        """A launched engine loads the weights of the last update before it joins."""
        loaded: tuple[str, int] | None = None
        while self._weights != loaded:  # an update may start while it loads
            loaded = self._weights
            assert loaded is not None
            if not launched.engine.capabilities.weight_updates:
                raise EngineStartError(f"{launched.label} cannot load the weights of "
                                       f"policy version {loaded[1]}")
            try:
                await launched.engine.update_weights(*loaded)
            except Exception as e:
                raise EngineStartError(f"{launched.label} did not load the weights of "
                                       f"policy version {loaded[1]}: {e}") from e

    # -- internals ------------------------------------------------------------------------

    def _apply(self, d: Decision) -> None:
        if isinstance(d, Admit):
            runner = self._runners.get(d.traj_id)
            if runner is not None:
                runner.admit(d.engine_id, d.priority)
        elif isinstance(d, Preempt):
            runner = self._runners.get(d.traj_id)
            if runner is not None:
                runner.preempt(d.engine_id)
        elif isinstance(d, Migrate):
            pass  # live, a move is the next Admit naming the new engine (re-prefill)
        elif isinstance(d, AddEngine):
            if self.launcher is None:
                log.warning("the scheduler asked for a TP-%d engine, but the runtime has "
                            "no launcher", d.tp)
            else:
                self.spawn(self.pool.launch_or_log(d.tp))
        elif isinstance(d, DrainEngine):
            self.pool.drain_decided(d.engine_id)

    def _hold_while_no_engine(self) -> None:
        if self._lost_at is not None and self._grace is None and not self._closed:
            self._grace = asyncio.get_running_loop().create_task(self._fail_after_grace())

    async def _fail_after_grace(self) -> None:
        """While no engine is live: fail each waiting turn once its grace is over,
        unless an engine is starting (then look again when that start ends)."""
        while True:
            lost = self._lost_at
            assert lost is not None
            now = self.clock.now()
            deadlines = [(max(lost, since) + self.engine_wait_s, r)
                         for r in self._runners.values()
                         if (since := r.waiting_since) is not None]
            due = [r for deadline, r in deadlines if deadline <= now]
            if due and not self.pool.starting:
                error = self.pool.no_engine_error()
                for runner in due:
                    runner.fail(error)
                continue
            self._grace_poke.clear()
            if due:
                await self._grace_poke.wait()
                continue
            # With no turn waiting, any that starts waiting is due after this.
            wake = min((d for d, _ in deadlines), default=now + self.engine_wait_s)
            try:
                async with self.clock.timeout(wake - now):
                    await self._grace_poke.wait()
            except TimeoutError:
                pass
