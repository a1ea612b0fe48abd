"""The remote backend's servers changing while sandboxes run (what a fleet that
follows demand does, `runtime.ray_sandboxes`): a server added takes starts at once,
a retired one takes none while its open sandboxes carry on, and it is forgotten
only once they have closed. Real servers on 127.0.0.1, in threads of this process."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from sandbox_helpers import SMALL, run

from treadle.errors import SandboxStartError
from treadle.sandbox import LocalBackend
from treadle.sandbox.remote import RemoteBackend, RemoteSandbox
from treadle.sandbox.server import serve_in_thread
from treadle.sandbox.wire import Health

pytestmark = pytest.mark.integration

TOKEN = "test-token-" + "y" * 20


def _where(sandboxes: list[object]) -> set[str]:
    return {sb.server for sb in sandboxes if isinstance(sb, RemoteSandbox)}


def test_servers_added_and_retired_while_sandboxes_run(work_root: str) -> None:
    async def body(a: str, b: str) -> None:
        backend = RemoteBackend([], TOKEN)
        with pytest.raises(SandboxStartError, match="no sandbox server takes"):
            await backend.start(SMALL)
        backend.add_server(a)
        with pytest.raises(ValueError, match="already"):
            backend.add_server(a + "/")
        on_a = await backend.start(SMALL)
        backend.add_server(b)
        spread = [await backend.start(SMALL) for _ in range(3)]
        assert backend.outstanding() == {a: 2, b: 2}
        assert backend.retire_server(a) == 2  # two still open there
        later = [await backend.start(SMALL) for _ in range(2)]
        assert _where(later) == {b}  # nothing new on a retiring server
        result = await on_a.exec(["python3", "-c", "print('still here')"], timeout_s=30)
        assert result.stdout.strip() == "still here"  # its open sandboxes carry on
        with pytest.raises(ValueError, match="close"):
            backend.remove_server(a)
        await asyncio.gather(on_a.close(), *(sb.close() for sb in spread))
        backend.remove_server(a)
        assert backend.outstanding() == {b: 2}
        with pytest.raises(KeyError):
            backend.retire_server(a)
        await asyncio.gather(*(sb.close() for sb in later))
        backend.retire_server(b)
        with pytest.raises(SandboxStartError, match="all retiring"):
            await backend.start(SMALL)

    root_b = os.path.join(work_root, "b")
    os.mkdir(root_b)
    with serve_in_thread(LocalBackend(work_root=work_root), TOKEN) as a, \
            serve_in_thread(LocalBackend(work_root=root_b), TOKEN) as b:
        run(body(a.url, b.url))


def test_a_drained_server_refuses_new_sandboxes_and_keeps_its_open_ones(
        work_root: str, caplog: pytest.LogCaptureFixture) -> None:
    """What a fleet retiring a server relies on (`RaySandboxFleet`): after `POST
    /v1/drain` the server itself refuses every client's new sandboxes, so its `live`
    count (the drain's answer, then `/healthz`) only falls; a client that still
    places there (a copy of the backend not told yet) starts on its other server."""
    async def body(a: str, b: str) -> None:
        first = RemoteBackend([a], TOKEN)
        open_there = await first.start(SMALL)
        async with httpx.AsyncClient(base_url=a, trust_env=False) as client:
            assert (await client.post("/v1/drain")).status_code == 401  # the token's
            auth = {"authorization": f"Bearer {TOKEN}"}
            drained = Health.model_validate_json(
                (await client.post("/v1/drain", headers=auth)).content)
            assert (drained.status, drained.live) == ("draining", 1)
            with pytest.raises(SandboxStartError, match="draining"):
                await first.start(SMALL)
            result = await open_there.exec(["python3", "-c", "print(6 * 7)"], timeout_s=30)
            assert result.stdout.strip() == "42"  # what was open there carries on
            both = RemoteBackend([a, b], TOKEN)
            elsewhere = [await both.start(SMALL) for _ in range(2)]
            assert _where(elsewhere) == {b}
            # A probe finds it draining: retired in this client, not marked down.
            assert await both.health() == {a: False, b: True}
            assert both.accepting() == (b,)
            assert "unreachable" not in caplog.text  # a refusal, not a server down
            await open_there.close()
            health = Health.model_validate_json((await client.get("/healthz")).content)
            assert (health.status, health.live) == ("draining", 0)
            again = Health.model_validate_json(
                (await client.post("/v1/drain", headers=auth)).content)
            assert (again.status, again.live) == ("draining", 0)  # idempotent
        await asyncio.gather(*(sb.close() for sb in elsewhere))

    root_b = os.path.join(work_root, "b")
    os.mkdir(root_b)
    with serve_in_thread(LocalBackend(work_root=work_root), TOKEN) as a, \
            serve_in_thread(LocalBackend(work_root=root_b), TOKEN) as b:
        run(body(a.url, b.url))
