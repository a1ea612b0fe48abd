"""Sandbox servers on a Ray cluster, as many as the rollouts need: `RaySandboxFleet`.

    connect_ray("ray://head:10001")
    backend = RemoteBackend([], token)                  # the service's sandbox backend
    # waiting: an async function, the starts waiting for a sandbox now
    fleet = RaySandboxFleet(backend, token, SandboxServers(resources=(("sandbox", 1),)),
                            Scaling(min_servers=1, max_servers=16), demand=waiting,
                            servers_changed=runners.sandbox_servers)
    await fleet.rebalance()                             # the first servers
    task = asyncio.create_task(fleet.run(interval_s=5))  # then follow demand
    ...
    await fleet.close()

Each server is one `treadle sandbox-server` process owned by one Ray actor (the same
process host as `RayLauncher`'s engines; named `treadle-sandbox-server-…`), on a
node that has the spec's `resources` (a custom resource the CPU nodes declare
chooses where; no GPU), bound to
the node's address with a port free there, the token in its environment, not its
command line. Once it answers `/healthz` it joins the backend's placement
(`RemoteBackend.add_server`).

Demand follows `sandbox.autoscale.decide`: the sandboxes live on the fleet's
servers plus `await demand()` (starts waiting for a sandbox: the service passes its
pools' waiting callers, its runner actors' included). What is live on a server is
what its `/healthz` says (every client's sandboxes: the service's backend and the
copies of it in runner actors), or what this backend has open there when it does
not answer. A server to retire takes no new sandbox from this backend at once
(`retire_server`), is drained (`drain_server`: the server itself refuses new
sandboxes, every client's) and is stopped when its drain answers that nothing is
live there, never before: a sandbox stays on its server.
Each time the servers new sandboxes may go to change, `servers_changed` is told them
(copies of the backend elsewhere `follow` them).

Contracts: `rebalance` acts on one decision and returns it; a server that does not
come up within `ready_timeout_s` (no node with the resources, or its process exits)
is stopped and logged, and the next decision tries again, so a full cluster costs
a retry, not a hang. A node lost takes its servers with it: the backend skips an
unreachable server (its sandboxes fail as infrastructure, `remote`'s contract), and
the fleet drops a server whose actor is gone and starts another where demand asks.
`close` stops every server; it is idempotent and never raises.

Ray is the `ray` extra, imported inside the functions that use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from secrets import token_hex
from typing import Any

import httpx
from pydantic import ValidationError

from treadle.clock import MONOTONIC, Clock
from treadle.errors import SandboxError
from treadle.runtime.ray_launcher import host_actor, require_ray
from treadle.sandbox.autoscale import ScaleDecision, Scaling, ServerLoad, decide
from treadle.sandbox.remote import RemoteBackend
from treadle.sandbox.wire import Health

log = logging.getLogger(__name__)
# Rounds in a row a retiring server's drain may go unanswered (its process alive, its
# HTTP not) before it is taken for lost: with rounds 5 s apart, about a minute.
DRAIN_GIVE_UP = 12
TOKEN_ENV = "TREADLE_SANDBOX_TOKEN"  # what `treadle sandbox-server` reads its token from


async def _no_demand() -> int:
    return 0


@dataclass(frozen=True, slots=True)
class SandboxServers:
    """How each server of a fleet is started."""

    backend: str = "bwrap"  # the local backend each server runs sandboxes with
    max_live: int = 32  # sandboxes a server hosts at most
    idle_ttl_s: float = 120.0  # a server reaps a sandbox idle this long
    num_cpus: float = 1.0  # Ray CPUs each server's actor holds
    # What each server's actor asks for besides its CPUs, e.g. (("sandbox", 1),): a
    # custom resource the nodes meant for sandboxes declare.
    resources: tuple[tuple[str, float], ...] = ()
    python: str = sys.executable  # the interpreter with treadle, on every node
    # `--images DIR` of each server (bwrap): the environment images under DIR, at that
    # path on every node that hosts servers, that clients may name; None: no images.
    images: str | None = None


@dataclass(slots=True)
class FleetServer:
    """One running server of the fleet."""

    url: str
    node_id: str
    node_ip: str
    actor: Any = field(repr=False)
    idle_since: float | None = None  # when it last had nothing open
    retiring: bool = False  # takes no new sandboxes; drained, and stopped once empty
    unanswered: int = 0  # drains in a row it did not answer


class RaySandboxFleet:
    """Sandbox servers on the connected Ray cluster (`connect_ray` first), registered
    with `backend`; see the module docstring."""

    def __init__(self, backend: RemoteBackend, token: str, spec: SandboxServers,
                 scaling: Scaling, *, demand: Callable[[], Awaitable[int]] = _no_demand,
                 servers_changed: Callable[[tuple[str, ...]], None] = lambda _: None,
                 clock: Clock = MONOTONIC, ready_timeout_s: float = 60.0,
                 stop_timeout_s: float = 10.0, actor_timeout_s: float = 10.0) -> None:
        require_ray()
        self._backend = backend
        self._token = token
        self.spec = spec
        self.scaling = scaling
        self._demand = demand
        self._servers_changed = servers_changed
        self._told: tuple[str, ...] | None = None  # what servers_changed was told last
        self._clock = clock
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.actor_timeout_s = actor_timeout_s  # a server's actor asked whether it runs
        self._servers: dict[str, FleetServer] = {}
        self._lock = asyncio.Lock()  # one decision acted on at a time

    @property
    def backend(self) -> RemoteBackend:
        """The backend its servers are registered with (sandboxes start through it)."""
        return self._backend

    def servers(self) -> list[FleetServer]:
        """The running servers, retiring ones included."""
        return list(self._servers.values())

    async def rebalance(self) -> ScaleDecision:
        """Stop the servers found lost, read the load (one `/healthz` a server), decide
        (`autoscale.decide`), act: retire one, start servers; then drain every retiring
        server and stop those the drain finds empty. Returns the decision.

        A retired server is stopped only once its drain (`POST /v1/drain`) answers that
        nothing is live there: from the drain on the server refuses new sandboxes
        itself, so a start from a copy of the backend not told yet (a runner actor's)
        is refused there and goes to another server, and one already under way counts
        as live. A server whose drain does not answer is kept (what runs there is not
        known) until it answers, is found lost, or has left `DRAIN_GIVE_UP` drains in a
        row unanswered (its sandboxes unreachable too)."""
        async with self._lock:
            for server in await self._drop_lost():
                await self._stop(server)
            self._forget_closed()
            now = self._clock.now()
            open_ = await self._live()
            loads = []
            for server in self._servers.values():
                n = open_.get(server.url, 0)
                if n:
                    server.idle_since = None
                elif server.idle_since is None:
                    server.idle_since = now
                loads.append(ServerLoad(server.url, n, self.spec.max_live, server.idle_since,
                                        server.retiring))
            decision = decide(loads, waiting=await self._demand(), scaling=self.scaling,
                              now=now, server_max_live=self.spec.max_live)
            for url in decision.retire:
                self._servers[url].retiring = True
                self._backend.retire_server(url)
            if decision.retire:
                self._tell()  # the runner actors' copies: before the drain refuses them
            started = await asyncio.gather(*(self._start() for _ in range(decision.start)),
                                           return_exceptions=True)
            for result in started:
                if isinstance(result, BaseException):
                    log.warning("a sandbox server did not start on Ray: %s", result)
            retiring = [s for s in self._servers.values() if s.retiring]
            for server, live in zip(retiring, await asyncio.gather(
                    *(self._drain(s) for s in retiring)), strict=True):
                if live == 0 or server.unanswered >= DRAIN_GIVE_UP:
                    await self._stop(server)
            self._tell()
            return decision

    async def run(self, interval_s: float = 5.0) -> None:
        """`rebalance` every `interval_s` of the clock until cancelled (an error in one
        round is logged, the next round runs)."""
        while True:
            try:
                await self.rebalance()
            except Exception:
                log.exception("sandbox fleet: a rebalance failed")
            await self._clock.sleep(interval_s)

    async def close(self) -> None:
        """Stop every server (their sandboxes end with them)."""
        async with self._lock:
            for server in list(self._servers.values()):
                await self._stop(server)
            self._tell()

    def _tell(self) -> None:
        accepting = self._backend.accepting()
        if accepting != self._told:
            self._told = accepting
            self._servers_changed(accepting)

    async def _live(self) -> dict[str, int]:
        """Sandboxes live on each server: its `/healthz` count (every client's), or,
        where it does not answer, what this backend has open there."""
        open_ = self._backend.outstanding()
        async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
            answers = await asyncio.gather(*(client.get(f"{url}/healthz") for url in open_),
                                           return_exceptions=True)
        for url, answer in zip(list(open_), answers, strict=True):
            if isinstance(answer, httpx.Response) and answer.status_code == 200:
                with contextlib.suppress(ValidationError):  # not a sandbox server's
                    open_[url] = max(open_[url],
                                     Health.model_validate_json(answer.content).live)
        return open_

    async def _start(self) -> FleetServer:
        name = f"treadle-sandbox-server-{token_hex(4)}"  # as `ray list actors` shows it
        actor = host_actor().options(name=name, num_cpus=self.spec.num_cpus, num_gpus=0,
                                     resources=dict(self.spec.resources)).remote()
        try:
            # No node with the resources free: the actor waits unplaced, so bound it.
            node_id, node_ip, _gpus, port = await asyncio.wait_for(
                actor.place.remote(), self.ready_timeout_s)
            url = f"http://{node_ip}:{port}"
            argv = [self.spec.python, "-m", "treadle", "sandbox-server", "--host", node_ip,
                    "--port", str(port), "--backend", self.spec.backend,
                    "--max-live", str(self.spec.max_live),
                    "--idle-ttl", str(self.spec.idle_ttl_s),
                    *(["--images", self.spec.images] if self.spec.images else [])]
            await actor.start.remote(argv, {TOKEN_ENV: self._token}, f"{name}.log")
            await self._healthy(url, actor)
        except BaseException:
            await self._release(actor)
            raise
        server = FleetServer(url, node_id, node_ip, actor)
        self._servers[url] = server
        self._backend.add_server(url)
        log.info("sandbox server %s started on node %s", url, node_id[:8])
        return server

    async def _healthy(self, url: str, actor: Any) -> None:
        """Wait for `/healthz` to answer ok; RuntimeError if the process exits first
        or it is not up within `ready_timeout_s` real seconds (a process starting
        takes real time, whatever the clock)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout_s
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=5.0) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/healthz")).status_code == 200:
                        return
                if (code := await actor.exit_code.remote()) is not None:
                    raise RuntimeError(f"sandbox server {url} exited with {code}: "
                                       f"{await actor.log_tail.remote()}")
                if loop.time() > deadline:
                    raise RuntimeError(f"sandbox server {url} not healthy within "
                                       f"{self.ready_timeout_s:.0f}s")
                await asyncio.sleep(0.2)  # polling a server that is starting: no event

    async def _drop_lost(self) -> list[FleetServer]:
        """The servers whose process exited or whose actor is gone (their node lost),
        retired in the backend: nothing runs there any more, so they are stopped at
        once (their actors' resources freed for the servers demand starts instead);
        the backend forgets them once their sandboxes have failed and closed
        (`_forget_closed`)."""
        lost = []
        for server in self._servers.values():
            try:
                code = await asyncio.wait_for(server.actor.exit_code.remote(),
                                              self.actor_timeout_s)
            except TimeoutError:  # a busy cluster, not a lost node: asked again next round
                log.warning("sandbox server %s: its actor did not answer in %.0f s",
                            server.url, self.actor_timeout_s)
                continue
            except Exception:  # RayActorError, a node gone: the actor cannot answer
                code = "its actor is gone"
            if code is not None:
                log.warning("sandbox server %s lost (%s)", server.url, code)
                server.retiring = True
                self._backend.retire_server(server.url)
                lost.append(server)
        return lost

    def _forget_closed(self) -> None:
        """Have the backend forget the servers the fleet stopped that still had this
        backend's sandboxes open then (a lost server's), once those have closed."""
        for url, n in self._backend.outstanding().items():
            if url not in self._servers and not n:
                with contextlib.suppress(KeyError, ValueError):
                    self._backend.remove_server(url)

    async def _drain(self, server: FleetServer) -> int | None:
        """Drain the server (`RemoteBackend.drain_server`: it takes no new sandboxes
        from now on); the sandboxes live there as of the drain, None if it did not
        answer."""
        try:
            live = await self._backend.drain_server(server.url)
        except SandboxError as e:
            server.unanswered += 1
            log.warning("sandbox server %s did not answer its drain (%d in a row): %s",
                        server.url, server.unanswered, e)
            return None
        server.unanswered = 0
        return live

    async def _stop(self, server: FleetServer) -> None:
        self._servers.pop(server.url, None)
        with contextlib.suppress(KeyError, ValueError):
            self._backend.retire_server(server.url)
            self._backend.remove_server(server.url)
        await self._release(server.actor)
        log.info("sandbox server %s stopped", server.url)

    async def _release(self, actor: Any) -> None:
        """End the server's process and its actor; never raises."""
        import ray

        with contextlib.suppress(Exception):
            await asyncio.wait_for(actor.stop.remote(self.stop_timeout_s),
                                   self.stop_timeout_s + 5.0)
        # Not connected (closing after the cluster went): nothing to kill, and
        # `ray.kill` would start a local cluster to find that out.
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                ray.kill(actor)
