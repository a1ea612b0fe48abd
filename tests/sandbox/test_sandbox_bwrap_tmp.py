"""Host paths under /tmp that a sandbox is given (`expose`), with real bwrap.

Inside, /tmp is a private tmpfs; a host path under the host's /tmp that a task
needs (an interpreter's virtualenv, a dataset) must still show at its place, and
nothing else of the host's /tmp may. Both executors, the Python session and a
sandbox server run the same mounts. The interpreter here is a virtualenv made
under /tmp from the system's python3 (which the sandbox uid can run), as a
checkout or a virtualenv under /tmp is on a fresh machine.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from sandbox_helpers import SMALL, require_bwrap, run

from treadle.sandbox import BwrapBackend, ExecResult
from treadle.sandbox._resident import SESSION_RESTARTED
from treadle.sandbox.remote import RemoteBackend
from treadle.sandbox.server import serve_in_thread

pytestmark = pytest.mark.integration

SYSTEM_PYTHON = "/usr/bin/python3"
PREFIX = "import sys; print(sys.prefix)"


@dataclass(frozen=True)
class TmpVenv:
    top: str  # a directory of the host's /tmp
    venv: str  # a virtualenv in it
    secret: str  # a world-readable file beside it, that no sandbox may read
    token: str  # the secret's content

    @property
    def python(self) -> str:
        return f"{self.venv}/bin/python"


@pytest.fixture(scope="module")
def tmp_venv() -> Iterator[TmpVenv]:
    require_bwrap()
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.fail(f"no {SYSTEM_PYTHON}: the sandbox runs the system's interpreter")
    top = tempfile.mkdtemp(prefix="treadle-test-venv-", dir="/tmp")
    try:
        os.chmod(top, 0o755)  # the sandbox uid must be able to reach the venv
        venv = os.path.join(top, "venv")
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", venv], check=True,
                       timeout=60)
        token = "tmp-secret-" + secrets.token_hex(8)
        secret = os.path.join(top, "secret.txt")
        with open(secret, "w") as f:
            f.write(token)
        os.chmod(secret, 0o644)  # world-readable on purpose: only the sandbox stops it
        yield TmpVenv(top=top, venv=venv, secret=secret, token=token)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def backend(work_root: str, venv: TmpVenv, executor: str = "resident") -> BwrapBackend:
    return BwrapBackend(work_root=work_root, expose=[venv.venv], executor=executor)


LOOK = ("ls -A /tmp; ls -A {top}; cat {secret} || echo SECRET-UNREADABLE; "
        "echo scratch > /tmp/scratch-file && echo SCRATCH-WRITABLE")


def check_view(result: ExecResult, venv: TmpVenv) -> None:
    """The exposed venv and the dirs leading to it, nothing else of the host's /tmp."""
    assert result.exit_code == 0, result
    lines = result.stdout.split()
    assert venv.token not in result.stdout + result.stderr
    assert "SECRET-UNREADABLE" in lines and "SCRATCH-WRITABLE" in lines, result
    assert lines[:2] == [os.path.basename(venv.top), "venv"], result  # /tmp, then top


@pytest.mark.parametrize("executor", ["resident", "per-call"])
def test_an_exposed_interpreter_under_tmp_runs_and_the_rest_of_tmp_stays_hidden(
        work_root: str, tmp_venv: TmpVenv, executor: str) -> None:
    async def body() -> list[ExecResult]:
        async with await backend(work_root, tmp_venv, executor).start(SMALL) as sb:
            return [
                await sb.exec([tmp_venv.python, "-I", "-c", PREFIX], timeout_s=10),
                await sb.exec(["sh", "-c", LOOK.format(top=tmp_venv.top,
                                                       secret=tmp_venv.secret)],
                              timeout_s=10),
                # python3 -u - (the python tool's command): the zygote's path.
                await sb.exec([tmp_venv.python, "-u", "-"], timeout_s=10,
                              stdin=PREFIX.encode()),
                await sb.exec(["sh", "-c", "ls -A /tmp"], timeout_s=10),
            ]

    prefix, look, zygote, after = run(body())
    assert (prefix.exit_code, prefix.stdout) == (0, tmp_venv.venv + "\n"), prefix
    check_view(look, tmp_venv)
    assert (zygote.exit_code, zygote.stdout) == (0, tmp_venv.venv + "\n"), zygote
    # Between calls /tmp is emptied around the exposed path, which stays.
    assert after.stdout.split() == [os.path.basename(tmp_venv.top)], after


def test_a_python_session_keeps_going_on_an_interpreter_under_tmp(
        work_root: str, tmp_venv: TmpVenv) -> None:
    """Each cell's clean-up empties /tmp around the exposed venv and the session is
    kept: a clean-up that failed on the mount would replace the executor each call."""
    async def body() -> list[ExecResult]:
        async with await backend(work_root, tmp_venv).start(SMALL) as sb:
            assert sb.keeps_python_session
            return [await sb.run_cell(code, timeout_s=10, python=tmp_venv.python)
                    for code in (b"import sys\nx = 41\nopen('/tmp/left', 'w').write('x')",
                                 b"import os\nprint(sys.prefix, x + 1, os.listdir('/tmp'))")]

    first, second = run(body())
    assert first.ok, first
    assert SESSION_RESTARTED not in second.stderr, second
    top = os.path.basename(tmp_venv.top)
    assert (second.exit_code, second.stdout) == (0, f"{tmp_venv.venv} 42 ['{top}']\n"), second


def test_a_sandbox_server_runs_an_exposed_interpreter_under_tmp(
        work_root: str, tmp_venv: TmpVenv) -> None:
    token = secrets.token_urlsafe(24)
    with serve_in_thread(backend(work_root, tmp_venv), token, idle_ttl_s=60) as server:
        async def body() -> list[ExecResult]:
            async with await RemoteBackend([server.url], token).start(SMALL) as sb:
                return [await sb.exec([tmp_venv.python, "-I", "-c", PREFIX], timeout_s=10),
                        await sb.exec(["sh", "-c", LOOK.format(top=tmp_venv.top,
                                                               secret=tmp_venv.secret)],
                                      timeout_s=10)]

        prefix, look = run(body())
    assert (prefix.exit_code, prefix.stdout) == (0, tmp_venv.venv + "\n"), prefix
    check_view(look, tmp_venv)


@pytest.mark.parametrize("path", ["/tmp", "/dev", "/dev/shm", "/proc", "/proc/1", "/work",
                                  "/work/data"])
def test_expose_refuses_what_the_sandbox_mounts_itself(work_root: str, path: str) -> None:
    with pytest.raises(ValueError, match="expose"):
        BwrapBackend(work_root=work_root, expose=[path])
