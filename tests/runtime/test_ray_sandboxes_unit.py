"""The sandbox fleet's handling of servers that do not answer, without a cluster: a
`FleetServer` whose actor is a named test double (`FakeHostActor`) and whose URL no
server listens on."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from treadle.runtime.ray_sandboxes import (
    DRAIN_GIVE_UP,
    FleetServer,
    RaySandboxFleet,
    SandboxServers,
)
from treadle.sandbox.autoscale import Scaling
from treadle.sandbox.remote import RemoteBackend
from treadle.testing import FakeClock

TOKEN = "sandbox-fleet-token-0123456789"


class _Method:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls = 0

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        self.calls += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if isinstance(self.answer, BaseException):
            future.set_exception(self.answer)
        elif self.answer is not _HANG:
            future.set_result(self.answer)
        return future  # _HANG: never answers


_HANG = object()


class FakeHostActor:
    """Test double of a server's host actor: `exit_code` answers `exit_code` (None:
    running; an exception: the actor is gone; `_HANG`: never), `stop` answers at once."""

    def __init__(self, exit_code: Any) -> None:
        self.exit_code = _Method(exit_code)
        self.stop = _Method(None)


def _closed_url() -> str:
    """An http URL on 127.0.0.1 that refuses connections (a port bound, not listening)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _CLOSED.append(sock)  # kept bound for the test's life: nothing else takes the port
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


_CLOSED: list[socket.socket] = []


def _fleet(server: FleetServer) -> tuple[RaySandboxFleet, RemoteBackend]:
    backend = RemoteBackend([server.url], TOKEN)
    fleet = RaySandboxFleet(backend, TOKEN, SandboxServers(max_live=2),
                            Scaling(min_servers=0, max_servers=1), clock=FakeClock(),
                            actor_timeout_s=0.01)
    fleet._servers[server.url] = server  # as `_start` registers one it started
    return fleet, backend


def test_a_server_whose_actor_is_slow_to_answer_is_kept_and_one_gone_is_stopped() -> None:
    async def scenario() -> None:
        slow = FleetServer(_closed_url(), "node", "127.0.0.1", FakeHostActor(_HANG))
        fleet, backend = _fleet(slow)
        await fleet.rebalance()
        # Not answering in time is a busy cluster, not a lost node: nothing is done.
        assert fleet.servers() == [slow] and not slow.retiring
        assert backend.accepting() == (slow.url,)
        gone = FleetServer(_closed_url(), "node", "127.0.0.1",
                           FakeHostActor(RuntimeError("the actor died")))
        fleet, backend = _fleet(gone)
        await fleet.rebalance()
        # Its actor gone: stopped at once, and forgotten (nothing of it was open here).
        assert fleet.servers() == [] and backend.outstanding() == {}
        assert gone.actor.stop.calls == 1

    asyncio.run(scenario())


def test_a_retiring_server_whose_drain_goes_unanswered_is_given_up_after_a_while() -> None:
    async def scenario() -> None:
        mute = FleetServer(_closed_url(), "node", "127.0.0.1", FakeHostActor(None),
                           retiring=True)
        fleet, backend = _fleet(mute)
        backend.retire_server(mute.url)
        for round_ in range(1, DRAIN_GIVE_UP):
            await fleet.rebalance()
            assert fleet.servers() == [mute] and mute.unanswered == round_
        await fleet.rebalance()
        assert fleet.servers() == [] and backend.outstanding() == {}
        assert mute.actor.stop.calls == 1

    asyncio.run(scenario())
