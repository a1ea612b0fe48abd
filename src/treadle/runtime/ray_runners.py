"""Trajectory runners on Ray: the data plane in many processes, the scheduler in one.

    runners = RayRunners(runtime, RunnerActors(count=4))   # connect_ray() first
    await runners.start()                                   # the actors, up
    traj = await runners.replay(spec, traj_id="j/q/0", key=GroupKey("j/q", 0))
    await runners.close()

A workload replay (`runtime.rollout.replay_task`: its engine calls and tool gaps) or
a suite task (`run_task`: its sandbox, agent loop, tools and reward; `task`) runs in
one of `count` runner actors (`runtime.runner_actor.RunnerWorker`, one
process each, placed by Ray), not in the service. The runtime and its scheduler stay
in the service and see each remote trajectory through a proxy (`RemoteTrajectory`,
a `contract.Runner` adopted by the runtime): the scheduler's decisions about it go
to its actor, the events its runner tells come back and are given to the scheduler.
Both ways they travel in batches (`runtime.runner_wire`), per actor on one
`exchange` in flight at a time (`runtime.runner_channel`): it carries every decision
made since the last and brings back everything the actor's trajectories did since
the last; a side `push` carries the decisions that an idle actor's exchange (a long
poll) would keep waiting. The fleet follows the runtime (`contract.RuntimeFollower`):
the actors mirror its engines, its weights and its gate, and a hold (a weight
update's pause) returns once every actor holds its calls and the pool knows of
every call they had started.

A trajectory goes to the actor with the fewest running (ties: the first). Losing an
actor (its process or its node gone: an exchange or a push fails with Ray's actor
error; a call failing otherwise counts as a loss too, and the actor is killed, so
that nothing it still runs is heard of twice) ends its trajectories for the
scheduler (`TrajectoryEnded`), releases their
calls from the pool, and raises `RunnerLost` from each `replay` or `task` waiting on
one, so
that the caller runs it again as a new attempt or records it as failed
(`service.attempts`): none is lost, none finishes twice. A new actor replaces the
lost one (with `replace`), and trajectories go to the others meanwhile.

Engines must be treadle's HTTP clients (every engine a service holds is): an actor
makes its own client of each from its address; others are logged and not mirrored.
Suite tasks need the service's tokenizer and sandbox backend (`RunnerKit`), copied
into each actor when it is made; each actor keeps its own sandbox pools over that
backend (a local backend's sandboxes run on the actor's node; a remote backend's
copy follows the servers a sandbox fleet accepts, `sandbox_servers`), and
`sandbox_waiting` sums the starts waiting in them (the fleet's demand). A gateway
session's conversation stays in the service and its turns run in an actor (`turns`,
a `RemoteTurns`). Ray is the `ray` extra, imported inside the functions that use it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from treadle.agent.journal import Resume, ResumeFrom
from treadle.agent.loop import AgentLimits
from treadle.agent.runner import Sampling, TurnRunner
from treadle.agent.tokenizer import Tokenizer
from treadle.clock import Clock, ScaledClock
from treadle.envs.base import Suite
from treadle.envs.worktree import WorkTreeCapture
from treadle.runtime.driver import Runtime
from treadle.runtime.ray_launcher import require_ray
from treadle.runtime.remote_trajectory import (
    BodyJournal,
    RemoteTrajectory,
    RemoteTurns,
    RunnerLost,
)
from treadle.runtime.runner_channel import RunnerChannel
from treadle.runtime.runner_wire import (
    Cancel,
    DropSuite,
    EngineAddress,
    Engines,
    KeepSuite,
    OpenTurns,
    SandboxFleet,
    StartReplay,
    StartTask,
    ToRunner,
    Weights,
    engine_address,
)
from treadle.sandbox.base import SandboxBackend
from treadle.sandbox.pool import PoolSettings
from treadle.types import GroupKey, KVAcrossUpdates, Task, Trajectory
from treadle.workloads import TrajectorySpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunnerActors:
    """How many runner actors, and what each asks of a Ray node."""

    count: int = 1
    num_cpus: float = 1.0  # Ray CPUs each holds (its process runs its trajectories)
    # What each asks for besides its CPUs, e.g. (("runner", 1),): a custom resource
    # the nodes meant for runners declare.
    resources: tuple[tuple[str, float], ...] = ()
    replace: bool = True  # start a new actor for each one lost
    ready_timeout_s: float = 120.0  # real seconds an actor may take to be placed and answer
    # Real seconds between a runner's exchanges' answers while its trajectories keep
    # saying something, and between its side pushes' starts (none after a quiet
    # spell); also how long a message waits for the exchange in flight before a side
    # push takes it: a Ray call costs the service far more CPU than a message
    # (`runtime.call_pacer`, `runtime.runner_channel`, `bench service --runners`).
    call_gap_s: float = 0.03

    def __post_init__(self) -> None:
        if self.count < 1 or self.num_cpus < 0:
            raise ValueError("runner actors: count >= 1, num_cpus >= 0")


@dataclass(frozen=True, slots=True)
class RunnerKit:
    """What suite tasks need in an actor besides its engines: the service's
    tokenizer (None: the actors run replays only), sandbox backend (None: suites
    that need no sandbox only) and pool settings."""

    tokenizer: Tokenizer | None = None
    sandbox: SandboxBackend | None = None
    pools: PoolSettings = field(default_factory=PoolSettings)


_SUITES_SENT = 64  # suites the actors keep (those of the latest tasks); see KeepSuite


@functools.cache
def _worker_class() -> Any:
    import ray

    from treadle.runtime.runner_actor import RunnerWorker

    return ray.remote(RunnerWorker)


class RayRunners:
    """The runner actors of one runtime (module docstring)."""

    def __init__(self, runtime: Runtime, actors: RunnerActors,
                 kit: RunnerKit | None = None) -> None:
        require_ray()
        if not isinstance(runtime.clock, ScaledClock):
            raise ValueError("runner actors need the runtime on a real clock (ScaledClock)")
        self.runtime = runtime
        self.actors = actors
        self.kit = kit or RunnerKit()
        # Suites sent to actors, by identity, most recently used last: (key, suite),
        # the suite held so that its id is not reused while it has a key.
        self._suites: collections.OrderedDict[int, tuple[str, Suite]] = (
            collections.OrderedDict())
        self.channels: list[RunnerChannel] = []  # the live ones, starting ones too
        self.lost_runners: list[str] = []  # names of the actors lost, oldest first
        self._made = 0
        self._made_suites = 0
        self._sandbox_servers: tuple[str, ...] | None = None  # a fleet's, followed
        self._holds = 0
        self._engines: dict[str, EngineAddress] = {}  # mirrored now
        self._engines_dirty = False
        self._replacing: set[asyncio.Task[None]] = set()
        self._ready = asyncio.Event()  # wakes replays waiting for a runner (they look again)
        self._closed = False

    async def start(self) -> None:
        """Start the actors and wait until each answers; then follow the runtime."""
        self._mirror_engines()
        await asyncio.gather(*(self._start_one() for _ in range(self.actors.count)))
        self.runtime.follow(self)
        self._mirror_engines()  # what changed while they started
        for runner in self.channels:
            runner.send(self._weights())

    @property
    def runs_tasks(self) -> bool:
        """Whether suite tasks may run in the actors (`task`): the kit has a tokenizer."""
        return self.kit.tokenizer is not None

    @property
    def runners(self) -> list[RunnerChannel]:
        """The live runners that answered."""
        return [r for r in self.channels if r.ready]

    async def replay(self, spec: TrajectorySpec, *, traj_id: str, key: GroupKey,
                     task_id: str = "", attempt: int = 0,
                     kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE,
                     journal: BodyJournal | None = None, resume: Resume | None = None,
                     max_staleness: int | None = None) -> Trajectory:
        """`runtime.rollout.replay_task` in a runner actor; RunnerLost if its actor is
        lost first. Cancelled, the actor's run is cancelled too."""
        start = StartReplay(traj_id, key.group_id, key.repetition, spec, task_id, attempt, kv,
                            resume, max_staleness, journaled=journal is not None)
        return await self._run(traj_id, kv, journal, None, lambda _: start)

    async def task(self, suite: Suite, task: Task, *, traj_id: str, key: GroupKey,
                   sampling: Sampling, limits: AgentLimits, chat_format: str,
                   attempt: int = 0, kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE,
                   journal: BodyJournal | None = None, resume: ResumeFrom | None = None,
                   capture: WorkTreeCapture | None = None,
                   max_staleness: int | None = None) -> Trajectory:
        """`runtime.rollout.run_task` in a runner actor, with the kit's tokenizer and
        the actor's sandbox pools; a restarted attempt plans its resume there from
        `resume` (its point comes back to `journal.resumed`), and `capture` gets the
        work tree it read. RunnerLost if its actor is lost first; cancelled, the
        actor's run is cancelled too."""
        if self.kit.tokenizer is None:
            raise ValueError("the runner actors have no tokenizer: they run replays only")
        suite_key = self._suite_key(suite)

        def start(runner: RunnerChannel) -> StartTask:
            if suite_key not in runner.suites:
                runner.suites.add(suite_key)
                runner.send(KeepSuite(suite_key, suite))
            return StartTask(traj_id, key.group_id, key.repetition, suite_key, task, sampling,
                             limits, chat_format, attempt, kv, resume, max_staleness,
                             journaled=journal is not None,
                             capture=None if capture is None else WorkTreeCapture(
                                 max_files=capture.max_files,
                                 max_file_bytes=capture.max_file_bytes))
        return await self._run(traj_id, kv, journal, capture, start)

    async def _run(self, traj_id: str, kv: KVAcrossUpdates, journal: BodyJournal | None,
                   capture: WorkTreeCapture | None,
                   start: Callable[[RunnerChannel], ToRunner]) -> Trajectory:
        """A trajectory in the actor with the fewest running (`_place`), started by
        `start`'s message."""
        while not self.runners:
            if self._closed:
                raise RunnerLost("the runner actors are closed")
            if not self.channels and not self._replacing:
                raise RunnerLost("no runner actor is left, and none is starting")
            self._ready.clear()  # (no runner is ready: set again by one, or by a loss)
            await self._ready.wait()
        runner, traj = self._place(traj_id, kv, journal, capture)
        runner.send(start(runner))
        try:
            result = await asyncio.shield(traj.result)
        except asyncio.CancelledError:
            runner.send(Cancel(traj_id))
            raise
        if isinstance(result, str):  # cancelled there, not from here (a raise: RunnerFailure)
            raise RunnerLost(f"trajectory {traj_id}: {result}")
        return result

    def turns(self, traj_id: str, group_id: str,
              kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE, *, judge: bool = False,
              max_staleness: int | None = None) -> TurnRunner:
        """The runner of a trajectory whose conversation stays here (a gateway
        session's: `contract.TrajectoryHost.turns`), its turns run in the actor with
        the fewest running (`RemoteTurns`); with no actor ready, the runtime's own
        (the session runs as before, not waiting for one)."""
        if not self.runners:
            return self.runtime.turns(traj_id, group_id, kv, judge=judge,
                                      max_staleness=max_staleness)
        runner, traj = self._place(traj_id, kv, None, None, driven=True)
        runner.send(OpenTurns(traj_id, group_id, kv, max_staleness))
        return RemoteTurns(traj, runner.send, self.runtime)

    def _place(self, traj_id: str, kv: KVAcrossUpdates, journal: BodyJournal | None,
               capture: WorkTreeCapture | None, *, driven: bool = False
               ) -> tuple[RunnerChannel, RemoteTrajectory]:
        """A trajectory's proxy, adopted by the runtime, on the ready actor with the
        fewest running (ties: the first); there must be one."""
        runner = min(self.runners, key=lambda r: len(r.trajectories))
        traj = RemoteTrajectory(runner.send, self.runtime, traj_id, kv, journal, capture,
                                driven=driven)
        self.runtime.adopt(traj)
        runner.trajectories[traj_id] = traj
        return runner, traj

    @property
    def clock(self) -> Clock:
        """The runtime's (`contract.TrajectoryHost`)."""
        return self.runtime.clock

    def _suite_key(self, suite: Suite) -> str:
        """The key the actors know `suite` by (sent with the first task of it each
        actor runs); the least recently used past `_SUITES_SENT` is dropped."""
        kept = self._suites.get(id(suite))
        if kept is not None:
            self._suites.move_to_end(id(suite))
            return kept[0]
        self._made_suites += 1
        key = f"{suite.name}#{self._made_suites}"
        self._suites[id(suite)] = (key, suite)
        if len(self._suites) > _SUITES_SENT:
            _, (old, _) = self._suites.popitem(last=False)
            for runner in self.channels:
                if old in runner.suites:
                    runner.suites.discard(old)
                    runner.send(DropSuite(old))
        return key

    def sandbox_servers(self, accepting: tuple[str, ...]) -> None:
        """The sandbox servers a fleet accepts sandboxes on now: the actors' copies of
        its backend follow them (`RaySandboxFleet`'s `servers_changed`)."""
        self._sandbox_servers = accepting
        for runner in self.channels:
            runner.send(SandboxFleet(accepting))

    async def sandbox_waiting(self) -> int:
        """Starts waiting for a sandbox in the ready actors' pools now (an actor that
        does not answer counts none): with the service's own, a fleet's demand."""
        counts = await asyncio.gather(*(r.actor.sandbox_waiting.remote() for r in self.runners),
                                      return_exceptions=True)
        return sum(c for c in counts if isinstance(c, int))

    def where(self) -> dict[str, tuple[int, str]]:
        """Each live runner's (process id, Ray node id), by name."""
        return {r.name: (r.pid, r.node_id) for r in self.runners}

    def ran(self) -> dict[str, int]:
        """Trajectories each live runner finished, by name."""
        return {r.name: r.ran for r in self.runners}

    async def close(self) -> None:
        """Lose every actor (their trajectories raise RunnerLost) and kill them."""
        import ray

        self._closed = True
        for task in self._replacing:
            task.cancel()
        await asyncio.gather(*self._replacing, return_exceptions=True)
        runners, self.channels = self.channels, []
        for runner in runners:
            tasks = runner.close()
            for traj in list(runner.trajectories.values()):
                traj.lost("the service is closing")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runner.actor.close.remote(), 10)
            with contextlib.suppress(Exception):
                ray.kill(runner.actor)
            await asyncio.gather(*tasks, return_exceptions=True)
        self._ready.set()  # waiters see the fleet closed

    # -- contract.RuntimeFollower ----------------------------------------------------------

    async def hold(self) -> None:
        """Every ready actor holds its calls. One still starting runs no trajectory:
        it is told (the hold goes before anything it is given) but not waited for,
        so a pause never waits on an actor that may take minutes to be placed."""
        self._holds += 1
        held = [r.hold(self._holds) for r in self.channels]
        await asyncio.gather(*(f for r, f in zip(self.channels, held, strict=True)
                               if r.ready))

    def released(self) -> None:
        for runner in self.channels:
            runner.send(self._weights())

    def engines_changed(self) -> None:
        if not self._engines_dirty:
            self._engines_dirty = True
            # After the burst: the pool's slots are up to date by the next callback.
            asyncio.get_running_loop().call_soon(self._mirror_engines)

    # -- internals -------------------------------------------------------------------------

    def lost(self, runner: RunnerChannel, why: str, *, replace: bool = True) -> None:
        """`runner`'s actor is gone (module docstring); another is started for it
        (`replace`: not for one that never started, which would start them in a loop)."""
        if runner not in self.channels:
            return
        log.error("%s; its %d trajectories end here and run again", why,
                  len(runner.trajectories))
        self.channels.remove(runner)
        self.lost_runners.append(runner.name)
        runner.close()
        with contextlib.suppress(Exception):  # gone, or alive and about to be: no twins
            import ray

            ray.kill(runner.actor)
        for traj in list(runner.trajectories.values()):
            traj.lost(why)
        runner.trajectories.clear()
        if replace and self.actors.replace and not self._closed:
            task = asyncio.get_running_loop().create_task(self._replace())
            self._replacing.add(task)
            task.add_done_callback(self._replacing.discard)
            task.add_done_callback(lambda _: self._ready.set())  # waiting replays look again
        self._ready.set()  # waiting replays look again: a runner left, or none

    async def _replace(self) -> None:
        try:
            await self._start_one()
        except Exception as e:  # the cluster has no room now: the others carry on
            log.error("no runner actor replaced the lost one: %s: %s", type(e).__name__, e)

    async def _start_one(self) -> None:
        self._made += 1
        name = f"treadle-runner-{self._made}"
        clock = self.runtime.clock
        assert isinstance(clock, ScaledClock)
        # An asyncio actor: its trajectories are coroutines started by a batch (an
        # exchange's or a push's), beside which only the exchange in flight, a push
        # and a few short calls run.
        actor = _worker_class().options(
            name=f"{name}-{id(self):x}", num_cpus=self.actors.num_cpus, max_concurrency=8,
            resources=dict(self.actors.resources), scheduling_strategy="SPREAD",
        ).remote(clock.scale, clock.now(), request_timeout_s=self.runtime.request_timeout_s,
                 turn_retries=self.runtime.turn_retries,
                 call_gap_s=self.actors.call_gap_s, tokenizer=self.kit.tokenizer,
                 sandbox=self.kit.sandbox, pools=self.kit.pools)
        runner = RunnerChannel(name, actor, self.runtime,
                               call_gap_s=self.actors.call_gap_s, lost=self.lost)
        runner.send(Engines(tuple(self._engines.values())))  # later changes follow it
        runner.send(self._weights())
        if self._sandbox_servers is not None:  # as they are now, not when the kit was made
            runner.send(SandboxFleet(self._sandbox_servers))
        self.channels.append(runner)
        try:
            await asyncio.wait_for(runner.open(), self.actors.ready_timeout_s)
        except BaseException:
            self.lost(runner, f"runner {name} did not start", replace=False)
            with contextlib.suppress(Exception):
                import ray

                ray.kill(actor)
            raise
        if runner.alive:
            self._ready.set()

    def _weights(self) -> Weights:
        rt = self.runtime
        return Weights(rt.policy_version, rt.cache_salt, open=not rt.paused)

    def _mirror_engines(self) -> None:
        self._engines_dirty = False
        now: dict[str, EngineAddress] = {}
        for s in self.runtime.pool.slots():
            address = self._engines.get(s.engine_id) or engine_address(
                s.engine_id, s.engine, tp=s.tp, max_batch=s.max_batch,
                kv_capacity_tokens=s.kv_capacity_tokens, label=s.label)
            if address is None:
                log.warning("engine %s is not an HTTP client treadle knows: runner actors "
                            "cannot call it", s.label)
            else:
                now[s.engine_id] = address
        added = tuple(a for e, a in now.items() if e not in self._engines)
        removed = tuple(e for e in self._engines if e not in now)
        self._engines = now
        if added or removed:
            for runner in self.channels:
                runner.send(Engines(added, removed))


__all__ = ["RayRunners", "RemoteTrajectory", "RunnerActors", "RunnerKit", "RunnerLost"]
