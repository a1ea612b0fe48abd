"""Sandbox servers under seeded faults: killed -9 and restarted, stopped and continued,
while clients of a `RemoteBackend` over both start sandboxes, write files and run
commands in them.

What must hold whatever lands when: every call ends (a bounded wait, never a hang);
a call either does what it should (the command's output is right) or raises a
`SandboxError` — an infrastructure failure is never an `ExecResult` a trainer would
score (`killed="signal:9"` from a server's death would be); after the run no
sandboxed process is left on the host, and a server stopped cleanly leaves no work
dir behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from treadle.errors import SandboxError
from treadle.runtime.launcher import free_port
from treadle.sandbox import Limits
from treadle.sandbox.remote import RemoteBackend

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "chaos-sandbox-token-" + "x" * 16
REPO = Path(__file__).resolve().parents[2]
TAG = "treadle-chaos-sb"  # in every command, to find what is left on the host


class Server:
    """A `treadle sandbox-server` process on a fixed port, restartable."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        env = {**os.environ, "TREADLE_SANDBOX_TOKEN": TOKEN,
               "PYTHONPATH": str(REPO / "src")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treadle.sandbox.cli", "sandbox-server", "--port",
             str(self.port), "--backend", "bwrap", "--work-root", str(self.root)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        self.starts += 1
        while True:  # up, or ended: no deadline decides
            assert self.proc.poll() is None, "the sandbox server ended before it was up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)


def _left_on_host() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            if TAG.encode() in argv and b"pytest" not in argv:
                found.append(int(pid))
    return found


def test_clients_of_killed_and_stopped_servers_get_results_or_sandbox_errors(
        tmp_path: Path) -> None:
    rng = random.Random(0)
    servers = [Server(tmp_path / f"s{i}") for i in range(2)]
    for s in servers:
        s.root.mkdir()
        s.start()
    backend = RemoteBackend([s.url for s in servers], TOKEN, connect_timeout_s=2.0)
    outcomes: dict[str, int] = {"ok": 0, "sandbox_error": 0}
    wrong: list[str] = []

    schedule_done = threading.Event()

    async def client(n: int) -> None:
        i = 0
        while not schedule_done.is_set() or i < 4:  # busy while every fault lands
            i += 1
            try:
                sb = await backend.start(Limits(wall_timeout_s=20))
                try:
                    await sb.put_file("in.txt", f"{n}-{i}".encode())
                    result = await sb.exec(
                        ["sh", "-c", f": {TAG}; sleep 0.2; cat in.txt"],
                        timeout_s=10)
                    if result.ok and result.stdout == f"{n}-{i}":
                        outcomes["ok"] += 1
                    else:  # whatever a fault did, it is never a result to score
                        wrong.append(f"{n}-{i}: {result}")
                finally:
                    with contextlib.suppress(SandboxError):
                        await sb.close()
            except SandboxError:
                outcomes["sandbox_error"] += 1

    def faults() -> dict[str, int]:
        done = {"kill": 0, "stop": 0}
        try:
            _inject(done)
        finally:
            schedule_done.set()
        return done

    def _inject(done: dict[str, int]) -> None:
        for _ in range(6):
            time.sleep(rng.uniform(0.3, 1.0))  # the schedule's spacing
            server = rng.choice(servers)
            if rng.random() < 0.5:
                server.kill()
                time.sleep(rng.uniform(0.0, 0.5))
                server.start()
                done["kill"] += 1
            else:
                assert server.proc is not None
                os.kill(server.proc.pid, signal.SIGSTOP)
                time.sleep(rng.uniform(0.5, 2.0))
                os.kill(server.proc.pid, signal.SIGCONT)
                done["stop"] += 1

    async def main() -> dict[str, int]:
        injector = asyncio.ensure_future(asyncio.to_thread(faults))
        await asyncio.wait_for(asyncio.gather(*(client(n) for n in range(6))), 600)
        return await injector

    try:
        done = asyncio.run(main())
    finally:
        for s in servers:
            s.terminate()
    assert wrong == [], wrong[:5]
    # The faults met calls in flight, and calls went on working around them.
    assert outcomes["sandbox_error"] > 0 and outcomes["ok"] > outcomes["sandbox_error"]
    assert done["kill"] + done["stop"] == 6
    # Nothing of the sandboxes is left: a killed server's trees died with it, a
    # stopped one's finished, and the clean shutdowns removed every work dir.
    # (A process left would hang the test: pytest-timeout's, no deadline here.)
    while _left_on_host():
        time.sleep(0.05)
    assert [p for s in servers for p in s.root.iterdir()] == []
