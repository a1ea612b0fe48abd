"""The runtime and the runners of its trajectories: what each may ask of the other.

`Runtime` (`runtime.driver`) holds the scheduler and the engines; the turns of each
trajectory run in a runner (`runtime.turns.ScheduledTurns`) that it makes. Each side
sees the other only through this module, as vLLM's engine core sees its scheduler
only through `SchedulerInterface`:

- `RunnerHost` is what a runner may ask of the runtime: tell the scheduler an event
  of its trajectory, wait while calls are held (a weight update), find the engine it
  was admitted to, account for a call in flight, report a failed call, run an abort
  in the background, and say that its trajectory is done;
- `Runner` is what the runtime tells a runner — the scheduler's decisions about its
  trajectory (`admit`, `preempt`), an engine lost, a pause's abort, and that no
  engine will come (`fail`) — and what it reads of one (`waiting_since`,
  `admitted_to`, `calling_on`).

`turns` imports only this module of the runtime; `driver` imports `turns` to make
runners and sees them as `Runner`s.

Runners may also live in other processes (`runtime.ray_runners`): there a host of
their own (`runtime.runner_actor`) mirrors the runtime for them, and a `Runner` proxy
in the service stands for each; the runtime tells such a fleet, a `RuntimeFollower`,
what its runners' hosts must mirror. `TrajectoryHost` is what a rollout
(`runtime.rollout`) needs of either host: a clock and a runner per trajectory.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Literal, Protocol

from treadle.agent.runner import TurnRunner
from treadle.clock import Clock
from treadle.core.events import Event
from treadle.engines.errors import EngineError
from treadle.runtime.pool import EngineSlot
from treadle.types import KVAcrossUpdates

__all__ = ["EngineSlot", "Runner", "RunnerHost", "RuntimeFollower", "TrajectoryHost"]


class RunnerHost(Protocol):
    """The runtime, as a runner sees it."""

    @property
    def clock(self) -> Clock:
        """The scheduler's clock: a turn's queued and generating seconds, tool latencies."""
        ...

    @property
    def policy_version(self) -> int:
        """The weights version to stamp on tokens sampled now."""
        ...

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of the weights served now (`GenerateRequest.cache_salt`)."""
        ...

    @property
    def request_timeout_s(self) -> float | None:
        """Real seconds an engine call may take (passed to the engine's client)."""
        ...

    @property
    def turn_retries(self) -> int:
        """Calls of one turn repeated on a live engine that failed them, at most."""
        ...

    def tell(self, event: Event) -> None:
        """Give the scheduler an event of the runner's trajectory (at the clock's now);
        its decisions follow within the same loop iteration."""
        ...

    async def calls_allowed(self) -> None:
        """Return once engine calls may be sent (at once unless a pause holds them)."""
        ...

    def admitted_engine(self, engine_id: str) -> EngineSlot | None:
        """The engine an admission names, or None if it has left the pool since."""
        ...

    def call_started(self, slot: EngineSlot) -> None:
        """A call is in flight on the engine (a drain or pause waits for it)."""
        ...

    def call_ended(self, slot: EngineSlot) -> None:
        """The call `call_started` announced is over, whatever its outcome."""
        ...

    async def call_failed(self, slot: EngineSlot,
                          error: EngineError) -> Literal["failed", "retry"]:
        """After a failed call: "failed" when the engine is dead (it is now failed and
        its turns re-routed), "retry" when it is healthy."""
        ...

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` in the background until it ends or the runtime closes."""
        ...

    def trajectory_done(self, runner: Runner) -> None:
        """The runner sends no more events; the runtime and the scheduler forget it."""
        ...


class Runner(Protocol):
    """A trajectory's runner, as the runtime sees it."""

    @property
    def traj_id(self) -> str: ...

    @property
    def sampled(self) -> int:
        """Tokens its engines returned so far, kept or not."""
        ...

    @property
    def waiting_since(self) -> float | None:
        """Clock time its turn began waiting for an admission; None when it is not
        waiting (running, held at the gate, in a tool, failed or done)."""
        ...

    @property
    def admitted_to(self) -> str | None:
        """The engine of an admission not yet sent there."""
        ...

    @property
    def calling_on(self) -> str | None:
        """The engine its call in flight is on; None with no call in flight."""
        ...

    @property
    def kv(self) -> KVAcrossUpdates:
        """What its trajectory does with cached KV across weight updates (a call frozen
        through a "keep" load included)."""
        ...

    def admit(self, engine_id: str, priority: float) -> None:
        """The scheduler admitted the waiting turn: send it there, with that priority."""
        ...

    def preempt(self, engine_id: str) -> None:
        """The scheduler paused the turn on the engine and queued it again."""
        ...

    def engine_lost(self, engine_id: str) -> None:
        """The engine failed or was removed; the scheduler re-routes the turn if it
        was there (a call in flight on it is dropped)."""
        ...

    def abort_for_pause(self) -> None:
        """A pause aborts calls in flight; the turn keeps its tokens and resumes."""
        ...

    def fail(self, error: EngineError) -> None:
        """No engine will run the trajectory: its waiting turn raises `error`; from
        now on `waiting_since` is None (until an `admit`)."""
        ...


class RuntimeFollower(Protocol):
    """Who mirrors the runtime for runners elsewhere, as the runtime sees it."""

    async def hold(self) -> None:
        """New engine calls are held: return once every runner's host holds them too,
        with every call started before known to the pool (`call_started`)."""
        ...

    def released(self) -> None:
        """Calls may go again; the policy version and cache salt may have changed."""
        ...

    def engines_changed(self) -> None:
        """An engine joined, began draining, failed or left the pool."""
        ...


class TrajectoryHost(Protocol):
    """Where a rollout's trajectory runs (the runtime, or a runner's host)."""

    @property
    def clock(self) -> Clock: ...

    def turns(self, traj_id: str, group_id: str,
              kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE, *,
              judge: bool = False, max_staleness: int | None = None) -> TurnRunner:
        """The runner of a new trajectory (`Runtime.turns`)."""
        ...
