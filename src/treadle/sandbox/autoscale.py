"""How many sandbox servers a fleet should run: a pure rule over the fleet's load.

    decision = decide(loads, waiting=12, scaling=Scaling(min_servers=1, max_servers=8),
                      now=clock.now())
    # start decision.start servers; retire the ones in decision.retire

A fleet (`runtime.ray_sandboxes.RaySandboxFleet`) asks after each change of load or
every few seconds; this module does no I/O and keeps no state: the servers' loads
and the time are its inputs, so one table says what it does.

Demand is the sandboxes open on the fleet's servers plus the starts waiting for one
(`waiting`: a pool's callers queued for a slot, `sandbox.pool.PoolStats.waiting`).
Capacity is the sum of the accepting servers' `max_live`.

The rule, first match wins:

1. fewer accepting servers than `min_servers`: start up to `min_servers`;
2. demand above `scale_up_at` × capacity: start enough servers to bring it under,
   at most up to `max_servers` accepting;
3. at most `min_servers` accepting: nothing;
4. a server empty for `idle_s` (the longest idle), and demand at or below
   `scale_down_at` × the capacity without it: retire it (one a decision);
5. otherwise nothing.

Retiring servers count neither towards the bounds nor towards capacity.

Starting never retires, and retiring waits for a server with nothing open: a
sandbox stays on its server until it closes (`remote` backend's contract), so a
retired server is stopped only once it is empty. Hysteresis comes from the two
thresholds (up at 80% full, down only if the rest would be at most 50% full) and
from `idle_s`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Scaling:
    """A fleet's bounds and thresholds."""

    min_servers: int = 1  # kept running however idle (0: none until the first demand)
    max_servers: int = 8  # never more, however much waits
    scale_up_at: float = 0.8  # demand over capacity above which servers start
    scale_down_at: float = 0.5  # demand over the capacity left, at or below which one retires
    idle_s: float = 60.0  # a server empty this long may retire

    def __post_init__(self) -> None:
        if not 0 <= self.min_servers <= self.max_servers or self.max_servers < 1:
            raise ValueError("0 <= min_servers <= max_servers, max_servers >= 1")
        if not 0 < self.scale_down_at < self.scale_up_at <= 1:
            raise ValueError("0 < scale_down_at < scale_up_at <= 1")
        if self.idle_s < 0:
            raise ValueError("idle_s must be >= 0")


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """One server of the fleet as the rule sees it."""

    url: str
    open: int  # sandboxes open there (or being created)
    max_live: int  # sandboxes it hosts at most
    idle_since: float | None  # when it last became empty (None: something is open)
    retiring: bool = False  # takes no new sandboxes; stopped once empty


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    start: int = 0  # servers to start
    retire: tuple[str, ...] = ()  # servers to take no new sandboxes, then stop


def decide(loads: Sequence[ServerLoad], *, waiting: int, scaling: Scaling,
           now: float, server_max_live: int) -> ScaleDecision:
    """What to do now (the module's table). `server_max_live`: a new server's
    `max_live`, to size a start."""
    accepting = [s for s in loads if not s.retiring]
    demand = sum(s.open for s in loads) + waiting
    capacity = sum(s.max_live for s in accepting)
    room = scaling.max_servers - len(accepting)
    if len(accepting) < scaling.min_servers:
        return ScaleDecision(start=min(room, scaling.min_servers - len(accepting)))
    if demand > scaling.scale_up_at * capacity and room > 0:
        # Servers enough that demand is at the threshold again: ceil of the shortfall.
        short = demand / scaling.scale_up_at - capacity
        return ScaleDecision(start=min(room, max(1, math.ceil(short / server_max_live))))
    if len(accepting) <= scaling.min_servers:
        return ScaleDecision()
    idle = [s for s in accepting
            if s.open == 0 and s.idle_since is not None and now - s.idle_since >= scaling.idle_s]
    if not idle:
        return ScaleDecision()
    longest = min(idle, key=lambda s: (s.idle_since, s.url))
    if demand <= scaling.scale_down_at * (capacity - longest.max_live):
        return ScaleDecision(retire=(longest.url,))
    return ScaleDecision()
