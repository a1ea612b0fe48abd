"""The remote backend against real sandbox servers on 127.0.0.1: the wire, auth, limits,
reaping, shutdown and placement.

Servers run in threads of this process (`serve_in_thread`) with the local backend
behind them unless a test needs bwrap; the containment battery through a server
is test_sandbox_remote_security.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest
from sandbox_helpers import SMALL, ended, marker, run, sleepers, wait_until, workdirs

from treadle.errors import (
    SandboxClosed,
    SandboxError,
    SandboxFileError,
    SandboxFileTooLarge,
    SandboxStartError,
    SandboxUnavailable,
)
from treadle.runtime.launcher import free_port
from treadle.sandbox import Limits, LocalBackend, Sandbox
from treadle.sandbox.cli import main as sandbox_main
from treadle.sandbox.remote import RemoteBackend, RemoteSandbox, RemoteSandboxError
from treadle.sandbox.server import RunningServer, serve_in_thread

pytestmark = pytest.mark.integration

TOKEN = "test-token-" + "x" * 20
BODY_LIMIT = 256 * 1024
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def local_server(root: str, *, idle_ttl_s: float = 60.0,
                 max_live: int = 64) -> Iterator[RunningServer]:
    with serve_in_thread(LocalBackend(work_root=root), TOKEN, idle_ttl_s=idle_ttl_s,
                         max_live=max_live, max_body_bytes=BODY_LIMIT) as server:
        yield server


@pytest.fixture
def server(work_root: str) -> Iterator[RunningServer]:
    with local_server(work_root) as running:
        yield running
    assert running.host.ids() == []


def api(server: RunningServer, token: str | None = TOKEN) -> httpx.Client:
    """A raw HTTP client: requests the RemoteBackend would never send."""
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.Client(base_url=server.url, headers=headers, trust_env=False, timeout=10)


# -- auth ---------------------------------------------------------------------------


ENDPOINTS = [
    ("GET", "/v1/sandboxes"),
    ("POST", "/v1/sandboxes"),
    ("POST", "/v1/sandboxes/AAAAAAAAAAAAAAAAAAAA/exec"),
    ("DELETE", "/v1/sandboxes/AAAAAAAAAAAAAAAAAAAA/execs/BBBBBBBBBBBBBBBB"),
    ("PUT", "/v1/sandboxes/AAAAAAAAAAAAAAAAAAAA/files?path=x"),
    ("GET", "/v1/sandboxes/AAAAAAAAAAAAAAAAAAAA/files?path=x"),
    ("POST", "/v1/sandboxes/AAAAAAAAAAAAAAAAAAAA/keepalive"),
    ("DELETE", "/v1/sandboxes/AAAAAAAAAAAAAAAAAAAA"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/no/such/route"),
]


def test_health_needs_no_token_and_everything_else_does(server: RunningServer) -> None:
    with api(server, token=None) as anonymous:
        health = anonymous.get("/healthz")
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "backend": "local", "live": 0, "max_live": 64}
        for method, path in ENDPOINTS:
            response = anonymous.request(method, path, content=b"{}")
            assert response.status_code == 401, (method, path)
            assert response.json()["error"]["type"] == "Unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"
    for bad in ("x", TOKEN[:-1], TOKEN + "x", TOKEN.upper()):
        with api(server, token=bad) as client:
            assert client.get("/v1/sandboxes").status_code == 401, bad
    with httpx.Client(base_url=server.url, trust_env=False,
                      headers={"authorization": f"Basic {TOKEN}"}) as basic:
        assert basic.get("/v1/sandboxes").status_code == 401
    with api(server) as client:  # and the right token does get in
        assert client.get("/v1/sandboxes").json() == {"ids": []}


def test_a_wrong_token_is_unavailable_not_retryable(server: RunningServer) -> None:
    backend = RemoteBackend([server.url], "wrong-" + TOKEN)
    with pytest.raises(SandboxUnavailable, match="bearer token"):
        run(backend.start(SMALL))
    assert server.host.ids() == [] and backend.outstanding() == {server.url: 0}


# -- the wire carries the contract --------------------------------------------------------


def test_exec_and_files_round_trip_like_a_local_sandbox(server: RunningServer,
                                                        work_root: str) -> None:
    script = ("cat >in.bin; printf 'out\\377'; echo err >&2; echo \"$EXTRA $HOME\"; "
              "mkdir -p d; echo made > d/f.txt; exit 3")
    stdin = bytes(range(256))

    async def run_in(sb: Sandbox) -> tuple[object, ...]:
        await sb.put_file("given.txt", b"payload\x00\xff")
        result = await sb.exec(["sh", "-c", script], timeout_s=5, stdin=stdin,
                               env={"EXTRA": "yes"})
        return (result.exit_code, result.stdout.replace(sb.workdir, "W"), result.stderr,
                result.killed, result.timed_out, result.truncated,
                await sb.get_file("in.bin"), await sb.get_file("d/f.txt"),
                await sb.get_file("given.txt"))

    async def body() -> None:
        async with await LocalBackend(work_root=work_root).start(SMALL) as direct:
            expected = await run_in(direct)
        backend = RemoteBackend([server.url], TOKEN)
        async with await backend.start(SMALL) as remote:
            assert isinstance(remote, RemoteSandbox) and remote.server == server.url
            assert server.host.ids() == [remote.id]
            assert await run_in(remote) == expected
        assert expected[0] == 3 and expected[6] == stdin
        assert server.host.ids() == []

    run(body())


def test_limits_travel_with_the_sandbox(server: RunningServer) -> None:
    async def body() -> None:
        backend = RemoteBackend([server.url], TOKEN)
        limits = Limits(cpu_s=1, memory_mb=128, max_output_bytes=1000, wall_timeout_s=1)
        async with await backend.start(limits) as sb:
            capped = await sb.exec(["yes"], timeout_s=5)
            assert capped.truncated and capped.killed == "output_limit"
            assert len(capped.stdout) == 1000
            slow = await sb.exec(["sleep", marker()], timeout_s=30)  # clamped to 1 s
            assert slow.timed_out and slow.killed == "timeout" and slow.exit_code is None

    run(body())


def test_failures_map_to_the_exception_tree(server: RunningServer) -> None:
    async def body() -> None:
        backend = RemoteBackend([server.url], TOKEN)
        async with await backend.start(SMALL) as sb:
            assert isinstance(sb, RemoteSandbox)
            with pytest.raises(SandboxFileError, match="no such file"):
                await sb.get_file("missing.txt")
            await sb.put_file("big.txt", b"x" * 100)
            with pytest.raises(SandboxFileTooLarge):
                await sb.get_file("big.txt", max_bytes=10)
            with pytest.raises(SandboxFileTooLarge):  # refused before it is sent
                await sb.put_file("huge.bin", b"x" * (BODY_LIMIT + 1))
            with pytest.raises(ValueError):
                await sb.exec([], timeout_s=5)
            with pytest.raises(ValueError):
                await sb.exec(["true"], timeout_s=5, env={"BAD=NAME": "x"})
            # Deleted behind the client's back (or reaped): SandboxClosed, not HTTP 404.
            with api(server) as client:
                assert client.delete(f"/v1/sandboxes/{sb.id}").status_code == 204
            with pytest.raises(SandboxClosed, match="no sandbox"):
                await sb.exec(["true"], timeout_s=5)
        with pytest.raises(SandboxClosed):
            await sb.exec(["true"], timeout_s=5)

    run(body())


def test_a_dead_server_is_a_sandbox_error_not_an_http_error(work_root: str) -> None:
    async def body(stack: contextlib.ExitStack) -> None:
        running = stack.enter_context(local_server(work_root))
        backend = RemoteBackend([running.url], TOKEN)
        sb = await backend.start(SMALL)
        await asyncio.to_thread(stack.close)  # the server goes away under the sandbox
        with pytest.raises(RemoteSandboxError):
            await sb.exec(["true"], timeout_s=5)
        with pytest.raises(SandboxError):
            await sb.get_file("x")
        await sb.close()  # logs, does not raise: the sandbox is gone with its server
        with pytest.raises(SandboxStartError):
            await backend.start(SMALL)

    with contextlib.ExitStack() as stack:
        run(body(stack))
    assert not workdirs(work_root)


# -- the files API refuses escapes ----------------------------------------------------------


def create_raw(client: httpx.Client, limits: Limits = SMALL) -> str:
    """A sandbox made over raw HTTP (no RemoteSandbox, so no event loop is involved)."""
    sandbox_id = "raw-" + os.urandom(12).hex()
    fields = {name: getattr(limits, name) for name in Limits.__slots__}
    response = client.post("/v1/sandboxes", json={"id": sandbox_id, "limits": fields})
    assert response.status_code == 201, response.text
    return sandbox_id


def test_files_api_refuses_traversal_sent_raw(server: RunningServer, work_root: str) -> None:
    with open("/etc/passwd", "rb") as f:
        passwd = f.read()
    with api(server) as client:
        sandbox_id = create_raw(client)
        planted = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={
            "exec_id": "plant-" + "x" * 10, "timeout_s": 5,
            "argv": ["sh", "-c", "ln -s / root; ln -s /etc/passwd leak; mkfifo fifo"]})
        assert planted.json()["exit_code"] == 0, planted.text
        files = f"/v1/sandboxes/{sandbox_id}/files"
        escapes = ["../escape.txt", "../../escape.txt", "a/../../escape.txt", "/tmp/escape.txt",
                   f"{work_root}/escape.txt", "root/tmp/escape.txt", "root/etc/passwd",
                   "with\x00nul", ".", "/"]
        for path in escapes:
            put = client.put(files, params={"path": path}, content=b"pwned")
            get = client.get(files, params={"path": path})
            for response in (put, get):
                assert response.status_code == 400, (path, response.text)
                assert response.json()["error"]["type"] == "SandboxPathError", path
        leak = client.get(files, params={"path": "leak"})  # a planted link is not followed
        assert leak.json()["error"]["type"] == "SandboxPathError"
        # Writing to it replaces the link inside the work dir, never its target.
        assert client.put(files, params={"path": "leak"}, content=b"pwned").status_code == 204
        fifo = client.get(files, params={"path": "fifo"})  # must not hang the server
        assert fifo.json()["error"]["type"] == "SandboxFileError"
        for bad_id in ("..%2F..%2Fetc", "short", "x" * 65):  # ids are checked too
            assert client.get(f"/v1/sandboxes/{bad_id}/files", params={"path": "a"}
                              ).status_code in (400, 404)
        assert client.get(files, params={"path": "leak", "max_bytes": "-1"}).status_code == 400
        assert client.delete(f"/v1/sandboxes/{sandbox_id}").status_code == 204
    with open("/etc/passwd", "rb") as f:
        assert f.read() == passwd
    assert not os.path.exists("/tmp/escape.txt")
    assert os.listdir(work_root) == []  # nothing escaped next to the (removed) work dir


# -- size limits ----------------------------------------------------------------------------


def test_oversized_requests_are_refused_before_they_are_read(server: RunningServer) -> None:
    def chunks(total: int) -> Iterator[bytes]:  # no Content-Length: counted as it streams
        for _ in range(total // 4096):
            yield b"x" * 4096

    with api(server) as client:
        sandbox_id = create_raw(client)
        files = f"/v1/sandboxes/{sandbox_id}/files"
        declared = client.put(files, params={"path": "big"}, content=b"x" * (BODY_LIMIT + 1))
        streamed = client.put(files, params={"path": "big"}, content=chunks(BODY_LIMIT * 4))
        exec_body = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={
            "exec_id": "e" * 16, "argv": ["cat"], "timeout_s": 5,
            "stdin_b64": "eHh4" * (BODY_LIMIT // 3)})
        for response in (declared, streamed, exec_body):
            assert response.status_code == 413, response.text
            assert "exceeds" in response.json()["error"]["message"]
        ok = client.put(files, params={"path": "fits"}, content=b"y" * BODY_LIMIT)
        assert ok.status_code == 204  # the limit is exact, and the server still serves
        assert client.get(files, params={"path": "fits"}).content == b"y" * BODY_LIMIT
        assert client.get(files, params={"path": "big"}).status_code == 422  # never written
        assert client.delete(f"/v1/sandboxes/{sandbox_id}").status_code == 204


def test_malformed_requests_are_400_not_500(server: RunningServer) -> None:
    with api(server) as client:
        for body in (b"not json", b"{}", json.dumps({"id": "a" * 20, "limits": {}}).encode(),
                     json.dumps({"id": "a" * 20, "limits": {"cpu_s": "10"}}).encode()):
            response = client.post("/v1/sandboxes", content=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["type"] == "ValueError"
        limits = {"cpu_s": 0, "memory_mb": 1, "address_space_mb": None, "max_processes": 1,
                  "max_file_mb": 1, "max_open_files": 1, "max_output_bytes": 1,
                  "wall_timeout_s": 1.0}
        response = client.post("/v1/sandboxes", json={"id": "a" * 20, "limits": limits})
        assert response.status_code == 400 and "cpu_s" in response.text
    assert server.host.ids() == []


# -- reaping and shutdown -------------------------------------------------------------------

_VANISHING_CLIENT = """
import asyncio, sys
from treadle.sandbox import Limits
from treadle.sandbox.remote import RemoteBackend

async def main():
    backend = RemoteBackend([sys.argv[1]], sys.argv[2])
    idle = await backend.start(Limits())
    # Past pytest's timeout: a kill that never comes fails the test, not its timeout.
    busy = await backend.start(Limits(wall_timeout_s=3600))
    await idle.put_file("state.txt", b"x")
    running = asyncio.ensure_future(busy.exec(["sleep", sys.argv[3]], timeout_s=3600))
    print(idle.id, busy.id, flush=True)
    await running

asyncio.run(main())
"""


def test_a_vanished_clients_sandboxes_are_killed_and_reaped(work_root: str) -> None:
    tag = marker()
    with local_server(work_root, idle_ttl_s=1.0) as running:
        client = subprocess.Popen([sys.executable, "-c", _VANISHING_CLIENT, running.url, TOKEN,
                                   tag], stdout=subprocess.PIPE, text=True)
        try:
            assert client.stdout is not None
            ids = client.stdout.readline().split()
            assert len(ids) == 2 and sorted(ids) == running.host.ids()
            wait_until(lambda: sleepers(tag))
            client.send_signal(signal.SIGKILL)  # no close, no goodbye
        finally:
            client.kill()
            client.wait()
        # The running exec dies with the connection, not at its timeout (an hour)...
        ended(lambda: sleepers(tag))
        # ...and both sandboxes go once idle for the TTL, work dirs and all.
        wait_until(lambda: running.host.ids() == [] and not workdirs(work_root))


def test_keepalives_hold_an_idle_sandbox_past_the_ttl(work_root: str) -> None:
    async def body(url: str) -> None:
        async with await RemoteBackend([url], TOKEN).start(SMALL) as sb:
            await sb.put_file("kept.txt", b"still here")
            await asyncio.sleep(1.5)  # three TTLs of the model "thinking"
            assert await sb.get_file("kept.txt") == b"still here"

    with local_server(work_root, idle_ttl_s=0.5) as running:
        run(body(running.url))


def test_shutdown_closes_every_sandbox_even_mid_exec(work_root: str) -> None:
    tag = marker()

    async def body(stack: contextlib.ExitStack, url: str) -> None:
        backend = RemoteBackend([url], TOKEN)
        idle, busy = await backend.start(SMALL), await backend.start(SMALL)
        running = asyncio.ensure_future(busy.exec(["sleep", tag], timeout_s=60))
        await asyncio.to_thread(wait_until, lambda: sleepers(tag))
        await asyncio.to_thread(stack.close)  # like SIGTERM
        assert not sleepers(tag) and not workdirs(work_root)
        # Answered, not dropped: the sandboxes were closed before the server drained.
        with pytest.raises(SandboxClosed):
            await running
        await asyncio.gather(idle.close(), busy.close())

    with contextlib.ExitStack() as stack:
        running_server = stack.enter_context(local_server(work_root))
        run(body(stack, running_server.url))


def test_cancelling_an_exec_kills_its_tree_before_returning(server: RunningServer) -> None:
    tag = marker()

    async def body() -> None:
        async with await RemoteBackend([server.url], TOKEN).start(SMALL) as sb:
            task = asyncio.ensure_future(sb.exec(["sh", "-c", f"sleep {tag} & wait"],
                                                 timeout_s=10))
            await asyncio.to_thread(wait_until, lambda: sleepers(tag))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert sleepers(tag) == []  # gone before CancelledError reached us
            assert (await sb.exec(["echo", "next"], timeout_s=5)).stdout == "next\n"

    run(body())


# -- placement ------------------------------------------------------------------------------


def test_starts_spread_by_load_and_skip_dead_servers(work_root: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    async def body(a: str, b: str) -> None:
        backend = RemoteBackend([a, b], TOKEN)
        first = [await backend.start(SMALL) for _ in range(4)]
        assert backend.outstanding() == {a: 2, b: 2}
        await first[0].close()
        await first[1].close()
        assert sorted(backend.outstanding().values()) == [1, 1]
        refill = await backend.start(SMALL)  # goes where load is least
        assert sorted(backend.outstanding().values()) == [1, 2]
        await asyncio.gather(*(sb.close() for sb in [*first, refill]))

        with_dead = RemoteBackend([dead, a], TOKEN)
        placed = [await with_dead.start(SMALL) for _ in range(3)]
        assert {sb.server for sb in placed if isinstance(sb, RemoteSandbox)} == {a}
        assert await with_dead.health() == {dead: False, a: True}
        await asyncio.gather(*(sb.close() for sb in placed))
        with pytest.raises(SandboxStartError, match=r"health check|ConnectError"):
            await RemoteBackend([dead], TOKEN).start(SMALL)

    root_b = os.path.join(work_root, "b")
    os.mkdir(root_b)
    with local_server(work_root) as a, local_server(root_b) as b:
        run(body(a.url, b.url))


def test_a_full_server_sends_starts_elsewhere(work_root: str) -> None:
    async def body(small: str, big: str) -> None:
        only_small = RemoteBackend([small], TOKEN)
        held = await only_small.start(SMALL)
        with pytest.raises(SandboxStartError, match="full"):
            await only_small.start(SMALL)
        both = RemoteBackend([small, big], TOKEN)
        extra = [await both.start(SMALL) for _ in range(2)]
        assert {sb.server for sb in extra if isinstance(sb, RemoteSandbox)} == {big}
        await asyncio.gather(held.close(), *(sb.close() for sb in extra))

    root_b = os.path.join(work_root, "b")
    os.mkdir(root_b)
    with local_server(work_root, max_live=1) as small, local_server(root_b) as big:
        run(body(small.url, big.url))


def test_a_start_cancelled_midway_leaves_nothing_on_the_server(work_root: str) -> None:
    armed, inside, go_on = threading.Event(), threading.Event(), threading.Event()

    class HeldLocal(LocalBackend):
        """Once armed, a start that waits inside until the client has given up on it."""

        async def start(self, limits: Limits) -> Sandbox:
            if armed.is_set():
                inside.set()
                await asyncio.to_thread(go_on.wait, 60)
            return await super().start(limits)

    async def body(url: str) -> None:
        armed.set()
        task = asyncio.ensure_future(RemoteBackend([url], TOKEN).start(SMALL))
        assert await asyncio.to_thread(inside.wait, 60)  # the server is inside the start
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go_on.set()

    with serve_in_thread(HeldLocal(work_root=work_root), TOKEN) as running:
        run(body(running.url))
        wait_until(lambda: running.host.live == 0 and not workdirs(work_root))


# -- command line ---------------------------------------------------------------------------


def test_cli_exec_runs_on_a_server(server: RunningServer,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert sandbox_main(["sandbox", "exec", "--backend", "remote", "--server", server.url,
                         "--token", TOKEN, "--", "sh", "-c", "echo via-server; exit 4"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["stdout"] == "via-server\n" and payload["exit_code"] == 4
    for argv in (["--backend", "remote", "--token", TOKEN, "--", "true"],  # no server
                 ["--backend", "remote", "--server", server.url, "--token", "wrong-token",
                  "--", "true"]):
        assert sandbox_main(["sandbox", "exec", *argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1


def test_cli_server_refuses_a_weak_token(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREADLE_SANDBOX_TOKEN", raising=False)
    assert sandbox_main(["sandbox-server", "--port", "1", "--token", "short"]) == 2
    assert "at least 16" in capsys.readouterr().err


def test_cli_server_process_serves_and_cleans_up_on_sigterm(work_root: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TREADLE_SANDBOX_TOKEN": TOKEN, "PYTHONPATH": os.path.join(REPO, "src")}
    proc = subprocess.Popen([sys.executable, "-m", "treadle.sandbox.cli", "sandbox-server",
                             "--port", str(port), "--backend", "local", "--work-root", work_root],
                            env=env, stderr=subprocess.PIPE, text=True)
    tag = marker()

    def healthy() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/healthz", trust_env=False).status_code == 200
        return False

    async def body() -> None:
        sb = await RemoteBackend([url], TOKEN).start(SMALL)
        running = asyncio.ensure_future(sb.exec(["sleep", tag], timeout_s=30))
        await asyncio.to_thread(wait_until, lambda: sleepers(tag))
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(SandboxError):
            await running
        await sb.close()

    try:
        wait_until(healthy)
        run(body())
        # uvicorn re-raises the signal once it has shut down cleanly.
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert not sleepers(tag) and not workdirs(work_root), err
