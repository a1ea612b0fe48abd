"""The bwrap security battery, run again through a real sandbox server.

Every test of test_sandbox_bwrap_security.py is imported here unchanged. They take
a fixture named `bwrap`; this module defines its own `bwrap`, which is a
`RemoteBackend` talking over loopback HTTP to a server (in a thread of this
process) that hosts bwrap sandboxes. So each attack is played from inside a
remote sandbox, the host checks run on the server's host (this one), and the
results must come back as clean `ExecResult`s through the wire. After each test
the server must hold no sandbox and no work dir.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from sandbox_helpers import require_bwrap, run, workdirs
from test_sandbox_bwrap_security import (  # noqa: F401  (collected here: run through remote)
    listener,
    test_big_files_are_capped,
    test_cpu_spin_is_killed_by_the_cpu_limit,
    test_file_api_refuses_escapes_planted_from_inside,
    test_fork_bomb_is_contained,
    test_fork_bomb_respects_the_process_limit,
    test_host_files_are_unreadable,
    test_host_loopback_is_unreachable,
    test_host_processes_are_invisible,
    test_huge_output_is_capped,
    test_killing_the_parent_or_everything_does_not_reach_the_host,
    test_memory_bomb_fails_its_allocation,
    test_memory_bomb_is_oom_killed_by_the_cgroup,
    test_no_network_interfaces_dns_or_egress,
    test_nothing_survives_the_exec_or_close,
    test_only_system_dirs_are_visible,
    test_parent_environment_is_invisible,
    test_sleeping_forever_is_killed_by_the_timeout,
    test_writes_outside_the_work_dir_fail_and_host_is_unchanged,
)

from treadle.sandbox import BwrapBackend, Limits
from treadle.sandbox.remote import RemoteBackend
from treadle.sandbox.server import RunningServer, serve_in_thread

pytestmark = pytest.mark.integration

TOKEN = secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def bwrap_server() -> Iterator[tuple[RunningServer, str]]:
    """One server for the module (starting one per test would double the battery's time)."""
    require_bwrap()
    root = tempfile.mkdtemp(prefix="treadle-test-remote-", dir="/tmp")
    os.chmod(root, 0o711)  # the sandbox uid must be able to traverse it
    try:
        with serve_in_thread(BwrapBackend(work_root=root), TOKEN, idle_ttl_s=60) as server:
            yield server, root
        assert not workdirs(root), "the server left work dirs behind at shutdown"
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def bwrap(bwrap_server: tuple[RunningServer, str], work_root: str) -> Iterator[RemoteBackend]:
    """Overrides conftest's `bwrap` for the imported battery: the same tests, over HTTP.

    Depends on `work_root` for its check that no child process is left behind
    (the server's sandboxes are children of this process).
    """
    server, root = bwrap_server
    backend = RemoteBackend([server.url], TOKEN)

    async def probe() -> None:  # fail here, not in the test, if the server cannot serve
        async with await backend.start(Limits()):
            pass

    run(probe())
    yield backend
    assert backend.outstanding() == {server.url: 0}
    assert server.host.ids() == [], "sandboxes left open on the server"
    assert not workdirs(root), "work dirs left behind on the server"
