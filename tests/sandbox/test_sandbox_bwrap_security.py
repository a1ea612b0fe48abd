"""The security battery against the real bwrap backend.

Each test plays one attack from inside a sandbox and checks three things: the
attack is contained, the host is unchanged, and the result is a clean ExecResult
(no exception). Fails, never skips, when bwrap is missing (see conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sandbox_probes as probes
from sandbox_helpers import (
    SMALL,
    ended,
    eventually,
    marker,
    processes_with,
    require_bwrap,
    run,
    sleepers,
    wait_until,
)

from treadle.errors import SandboxClosed, SandboxFileError, SandboxPathError
from treadle.sandbox import BwrapBackend, ExecResult, Limits, SandboxBackend, _workdir
from treadle.sandbox._cgroup import detect_cgroups
from treadle.sandbox.base import MIB

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def sandbox_exec(backend: BwrapBackend, argv: list[str], *, limits: Limits = SMALL,
                 timeout_s: float = 5.0, env: dict[str, str] | None = None) -> ExecResult:
    async def body() -> ExecResult:
        async with await backend.start(limits) as sb:
            return await sb.exec(argv, timeout_s=timeout_s, env=env)

    return run(body())


def sh(backend: BwrapBackend, script: str, **kwargs: object) -> ExecResult:
    return sandbox_exec(backend, ["sh", "-c", script], **kwargs)  # type: ignore[arg-type]


def host_can_fork() -> bool:
    return subprocess.run(["true"], check=False).returncode == 0


# Where treadle gets no memory cgroup (docs/sandbox.md, "When the host offers less").
NO_MEMORY_CGROUP = ("no writable memory cgroup on this host: a v1 memory hierarchy, or a "
                    "cgroup v2 group delegated to treadle with nothing else in it")


def memory_cgroup(backend: SandboxBackend) -> bool:
    """Whether the backend's execs get a memory cgroup (a remote one: this host's bwrap's)."""
    if isinstance(backend, BwrapBackend):
        return "memory" in backend.cgroup_controllers
    cgroups = detect_cgroups()
    return cgroups is not None and "memory" in cgroups.controllers


def skip_unless_mounting_is_refused(why: str) -> None:
    """Skip where this process may not mount (no tmpfs work dirs); fail where it may."""
    assert os.geteuid() != 0 or _workdir.tmpfs_refused(), "root, but no tmpfs work dir"
    pytest.skip(f"no tmpfs work dirs on this host: {why}")


def python(backend: SandboxBackend, code: str, *args: object) -> dict[str, str]:
    """Run a probe of sandbox_probes inside; its `<what> <outcome>` lines."""
    result = sandbox_exec(backend, ["python3", "-c", code, *map(str, args)],  # type: ignore[arg-type]
                          timeout_s=10)
    assert result.exit_code == 0 and result.killed is None, result
    return probes.outcomes(result.stdout)


@pytest.fixture
def listener() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP server on the host's 127.0.0.1 that records whatever connects."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    received: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                received.append(conn.recv(100) or b"<connected>")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], received
    stop.set()
    thread.join()
    server.close()


# -- network ------------------------------------------------------------------


def test_host_loopback_is_unreachable(bwrap: BwrapBackend,
                                      listener: tuple[int, list[bytes]]) -> None:
    port, received = listener
    # Sanity: the listener does accept connections from the host itself.
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"host")
    wait_until(lambda: received == [b"host"])
    # /dev/tcp is a bash feature (bash is essential on Debian).
    result = sandbox_exec(bwrap, ["bash", "-c", f"echo pwned >/dev/tcp/127.0.0.1/{port}"])
    assert result.exit_code not in (0, None), result
    assert "refused" in result.stderr.lower()
    assert received == [b"host"]  # nothing from inside arrived


def test_no_network_interfaces_dns_or_egress(bwrap: BwrapBackend) -> None:
    interfaces = sh(bwrap, "cat /proc/net/dev")
    names = {line.split(":")[0].strip() for line in interfaces.stdout.splitlines()[2:]}
    assert names == {"lo"}, interfaces
    dns = sandbox_exec(bwrap, ["getent", "hosts", "example.com"])
    assert dns.exit_code not in (0, None) and dns.stdout == ""
    egress = sandbox_exec(bwrap, ["bash", "-c", "echo x >/dev/tcp/1.1.1.1/53"])
    assert egress.exit_code not in (0, None)
    assert "unreachable" in egress.stderr.lower(), egress


# -- reading the host ---------------------------------------------------------


def test_parent_environment_is_invisible(bwrap: BwrapBackend,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "env-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("TREADLE_TEST_SECRET", secret)
    result = sh(bwrap, "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'",
                env={"VISIBLE": "yes"})
    assert result.exit_code == 0
    assert secret not in result.stdout and "TREADLE_TEST_SECRET" not in result.stdout
    assert "VISIBLE=yes" in result.stdout


@pytest.mark.parametrize("where", ["tmp", "repo"])
def test_host_files_are_unreadable(bwrap: BwrapBackend, where: str) -> None:
    secret = "file-secret-" + secrets.token_hex(8)
    directory = tempfile.gettempdir() if where == "tmp" else str(REPO / "tests" / "sandbox")
    fd, path = tempfile.mkstemp(prefix=".treadle-secret-", dir=directory)
    try:
        os.write(fd, secret.encode())
        os.close(fd)
        os.chmod(path, 0o644)  # world-readable on purpose: only the sandbox should stop it
        result = sh(bwrap, f"cat {path}; ls -la {directory}; grep -r {secret} / 2>/dev/null; "
                           "cat /etc/shadow /root/.bash_history")
        assert secret not in result.stdout + result.stderr, result
        assert result.exit_code != 0
    finally:
        os.unlink(path)


def test_only_system_dirs_are_visible(bwrap: BwrapBackend) -> None:
    result = sh(bwrap, "ls -A /")
    visible = set(result.stdout.split())
    assert visible <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt", "proc",
                       "sbin", "tmp", "usr", "work"}, visible
    assert {"home", "root", "run", "var", "sys"}.isdisjoint(visible)


# -- writing the host ---------------------------------------------------------


def test_writes_outside_the_work_dir_fail_and_host_is_unchanged(bwrap: BwrapBackend) -> None:
    name = "treadle-pwned-" + secrets.token_hex(6)
    targets = [f"/tmp/{name}", f"{REPO}/{name}", f"/etc/{name}", f"/usr/bin/{name}", f"/{name}"]
    script = "; ".join(f"echo x > {t} || echo FAILED {t}" for t in targets)
    etc_before = sorted(os.listdir("/etc"))
    result = sh(bwrap, script + "; echo inside > /work/ok.txt && echo WROTE-WORKDIR")
    assert result.exit_code == 0
    for target in targets[1:]:
        assert f"FAILED {target}" in result.stdout, result
        assert not os.path.exists(target)
    # /tmp inside is a private tmpfs: the write "works" there but never reaches the host.
    assert not os.path.exists(targets[0])
    assert "WROTE-WORKDIR" in result.stdout
    assert sorted(os.listdir("/etc")) == etc_before


# -- resource exhaustion --------------------------------------------------------


def test_fork_bomb_is_contained(bwrap: BwrapBackend) -> None:
    result = sh(bwrap, "bomb() { bomb | bomb & }; bomb; wait", timeout_s=2)
    # It dies out (forks refused) or its time runs out; either way it is over.
    assert (result.exit_code, result.killed) in ((0, None), (None, "timeout")), result
    assert result.duration_s < 10, result
    assert host_can_fork()
    ended(lambda: processes_with("bomb()"))


def test_fork_bomb_respects_the_process_limit(bwrap: BwrapBackend) -> None:
    """Fork until the kernel refuses; the count reached stays under max_processes."""
    script = "i=0; while :; do sleep 5 & i=$((i+1)); echo $i > forks; done"  # echo: no fork

    async def body() -> tuple[ExecResult, int]:
        async with await bwrap.start(SMALL) as sb:
            result = await sb.exec(["sh", "-c", script], timeout_s=4)
            return result, int(await sb.get_file("forks"))

    result, forks = run(body())
    assert result.exit_code not in (0, None) and "fork" in result.stderr.lower(), result
    assert 0 < forks < SMALL.max_processes
    assert host_can_fork()


def test_memory_bomb_fails_its_allocation(bwrap: BwrapBackend) -> None:
    result = sandbox_exec(bwrap, ["tail", "/dev/zero"], timeout_s=5)  # buffers forever
    assert result.exit_code not in (0, None) or result.killed == "memory", result
    assert not result.timed_out
    assert host_can_fork()


def test_memory_bomb_is_oom_killed_by_the_cgroup(bwrap: BwrapBackend) -> None:
    if not memory_cgroup(bwrap):
        # Without a cgroup nothing but RLIMIT_AS bounds memory; running the bomb
        # with address_space_mb=0 would then exhaust the host.
        pytest.skip(NO_MEMORY_CGROUP)
    limits = Limits(cpu_s=5, memory_mb=128, address_space_mb=0, max_processes=64)
    result = sandbox_exec(bwrap, ["tail", "/dev/zero"], limits=limits, timeout_s=8)
    assert result.killed == "memory" and result.exit_code is None, result


def test_cpu_spin_is_killed_by_the_cpu_limit(bwrap: BwrapBackend) -> None:
    result = sh(bwrap, "while :; do :; done", timeout_s=8)
    assert result.killed == "cpu" and result.exit_code is None and not result.timed_out
    assert result.duration_s < 6


def test_sleeping_forever_is_killed_by_the_timeout(bwrap: BwrapBackend) -> None:
    result = sandbox_exec(bwrap, ["sleep", marker()], timeout_s=1)
    assert result.timed_out and result.killed == "timeout" and 0.9 < result.duration_s < 4


def test_huge_output_is_capped(bwrap: BwrapBackend) -> None:
    result = sh(bwrap, "yes; echo never-printed", timeout_s=5)
    assert result.truncated and result.killed == "output_limit"
    assert len(result.stdout) + len(result.stderr) == SMALL.max_output_bytes
    assert "never-printed" not in result.stdout


def test_big_files_are_capped(bwrap: BwrapBackend) -> None:
    result = sh(bwrap, "head -c 64M /dev/zero > big; echo status=$?; wc -c < big", timeout_s=5)
    status, size = result.stdout.split()
    assert status == "status=153"  # 128 + SIGXFSZ
    assert int(size) == SMALL.max_file_mb * 1024 * 1024


# -- signals and processes ------------------------------------------------------


def test_killing_the_parent_or_everything_does_not_reach_the_host(bwrap: BwrapBackend) -> None:
    sentinel_kwargs: dict[str, object] = {}
    if os.geteuid() == 0:  # a host process with the sandbox's own uid: still unreachable
        sentinel_kwargs = {"user": 65534, "group": 65534, "extra_groups": []}
    tag = marker()
    sentinel = subprocess.Popen(["sleep", tag], **sentinel_kwargs)  # type: ignore[call-overload]
    try:
        me, sentinel_pid = os.getpid(), sentinel.pid
        result = sh(bwrap, f"kill -9 {me} {sentinel_pid} 1; kill -9 -1; echo survived",
                    timeout_s=5)
        assert sentinel.poll() is None, "a host process was killed from inside"
        # No such process for the host's pids and pid 1, none left for -1: the shell
        # goes on, and the sandbox with it.
        assert (result.exit_code, result.killed, result.stdout) == (0, None, "survived\n"), \
            result
    finally:
        sentinel.kill()
        sentinel.wait()


def test_host_processes_are_invisible(bwrap: BwrapBackend) -> None:
    result = sh(bwrap, "ls /proc | grep -c '^[0-9]'; ls -A /proc/1 | wc -l; "
                       "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    count, pid1_entries, cmdlines = result.stdout.split("\n", 2)
    assert int(count) <= 5  # init, sh, ls, grep (and maybe tr)
    assert int(pid1_entries) == 0  # bwrap's pid 1 is covered
    assert "sh -c" in cmdlines and "pytest" not in cmdlines


def test_nothing_survives_the_exec_or_close(bwrap: BwrapBackend) -> None:
    tags = [marker() for _ in range(4)]
    script = (f"sleep {tags[0]} & "
              f"setsid sleep {tags[1]} & "
              f"( ( setsid sh -c 'sleep {tags[2]}' & ) & ) ; "
              f"nohup sleep {tags[3]} >/dev/null 2>&1 & echo started")

    async def body() -> None:
        sb = await bwrap.start(SMALL)
        result = await sb.exec(["sh", "-c", script], timeout_s=5)
        assert result.ok and result.stdout == "started\n"
        for tag in tags:
            ended(lambda t=tag: sleepers(t))
        # One more, still running when close() comes.
        running = asyncio.ensure_future(sb.exec(["sh", "-c", f"sleep {tags[0]} & wait"],
                                                timeout_s=30))
        await eventually(lambda: sleepers(tags[0]))
        await sb.close()
        with pytest.raises(SandboxClosed):
            await running

    run(body())
    for tag in tags:
        assert not sleepers(tag), tag


# -- the file API -------------------------------------------------------------


def test_file_api_refuses_escapes_planted_from_inside(bwrap: BwrapBackend) -> None:
    async def body() -> None:
        async with await bwrap.start(SMALL) as sb:
            setup = await sb.exec(["sh", "-c", "ln -s /etc/passwd leak; ln -s / root; "
                                   "mkfifo fifo; mkdir sub"], timeout_s=5)
            assert setup.ok, setup
            for path in ("leak", "root/etc/passwd", "../../etc/passwd", "/etc/passwd"):
                with pytest.raises(SandboxPathError):
                    await sb.get_file(path)
            with pytest.raises(SandboxFileError):
                await sb.get_file("fifo")
            with pytest.raises(SandboxPathError):
                await sb.put_file("root/tmp/pwned", b"x")
            await sb.put_file("/work/sub/in.txt", b"payload")
            check = await sb.exec(["sh", "-c", "cat sub/in.txt && echo more >> sub/in.txt"],
                                  timeout_s=5)
            assert check.ok and check.stdout == "payload", check  # and writable by the sandbox
            assert await sb.get_file("sub/in.txt") == b"payloadmore\n"

    run(body())


# -- the sandbox's own processes, kernel keys and system calls ----------------------


def test_no_process_can_be_traced_or_written_into(bwrap: BwrapBackend) -> None:
    got = python(bwrap, probes.PTRACE, probes.nr("ptrace"), probes.nr("process_vm_readv"))
    assert got == {"seize-pid1": "EPERM", "attach-child": "EPERM", "traceme": "EPERM",
                   "vm-readv-pid1": "EPERM", "/proc/1/mem": "ENOENT",
                   "/proc/1/task/1/mem": "ENOENT"}


def test_pid1_and_the_whole_tree_hold_the_limits(bwrap: BwrapBackend) -> None:
    """bwrap's pid 1 and the outer bwrap have the exec's rlimits, not the host's."""
    tag = marker()

    async def body() -> dict[str, dict[str, tuple[str, str]]]:
        async with await bwrap.start(SMALL) as sb:
            task = asyncio.ensure_future(sb.exec(["sleep", tag], timeout_s=10))
            await asyncio.to_thread(wait_until, lambda: sleepers(tag))
            [command] = sleepers(tag)
            pid1 = probes.parent_of(command)
            outer = probes.parent_of(pid1)
            assert "bwrap" in probes.cmdline_of(pid1) and "bwrap" in probes.cmdline_of(outer)
            tree = {"command": probes.limits_of(command), "pid1": probes.limits_of(pid1),
                    "outer": probes.limits_of(outer)}
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return tree

    tree = run(body())
    file_size, address_space = str(SMALL.max_file_mb * MIB), str(SMALL.memory_mb * MIB)
    for who, limits in tree.items():
        assert limits["Max cpu time"] == (str(SMALL.cpu_s), str(SMALL.cpu_s + 1)), who
        assert limits["Max file size"] == (file_size, file_size), who
        assert limits["Max open files"] == (str(SMALL.max_open_files),) * 2, who
        assert limits["Max address space"] == (address_space, address_space), who
        assert limits["Max core file size"] == ("0", "0"), who
    assert tree["command"]["Max processes"] == (str(SMALL.max_processes),) * 2


def test_the_callers_session_keyring_is_out_of_reach(bwrap: BwrapBackend) -> None:
    probes.join_fresh_session_keyring()  # sandboxes started from this thread inherit it
    secret = "key-secret-" + secrets.token_hex(8)
    key = probes.add_session_key("treadle-probe", secret.encode())
    try:
        result = sandbox_exec(bwrap, ["python3", "-c", probes.KEYS, str(probes.nr("keyctl")),
                                      str(probes.nr("add_key")), str(key), "a"], timeout_s=10)
        assert secret not in result.stdout + result.stderr, result
        got = probes.outcomes(result.stdout)
        assert {got[k] for k in ("session-id", "read", "search", "add-session",
                                 "add-user")} == {"EPERM"}, got
        assert got["proc-keys"] != "ok"
        assert probes.session_key_payloads() == [secret.encode()]  # nothing was added
    finally:
        probes.invalidate_key(key)


def test_one_sandbox_cannot_leave_keys_for_another(bwrap: BwrapBackend) -> None:
    probes.join_fresh_session_keyring()
    tag = secrets.token_hex(6)
    keys = (str(probes.nr("keyctl")), str(probes.nr("add_key")), "0")
    first = sandbox_exec(bwrap, ["python3", "-c", probes.KEYS, *keys, "treadle-probe"])
    second = sandbox_exec(bwrap, ["python3", "-c", probes.KEYS, *keys, tag])
    assert probes.outcomes(first.stdout)["add-session"] == "EPERM", first
    assert "left-by-" not in second.stdout, second
    assert probes.session_key_payloads() == []


def test_system_calls_no_tool_needs_are_refused(bwrap: BwrapBackend) -> None:
    names = ("bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "unshare", "mount",
             "personality", "kcmp", "clone", "clone3")
    got = python(bwrap, probes.SYSCALLS, *map(probes.nr, names))
    assert got == {"bpf": "EPERM", "perf_event_open": "EPERM", "userfaultfd": "EPERM",
                   "io_uring_setup": "ENOSYS", "unshare": "EPERM", "mount": "EPERM",
                   "personality": "EPERM", "personality-plain": "ok", "kcmp": "EPERM",
                   "clone-newuser": "EPERM", "clone-newnet": "EPERM", "clone-plain": "ok",
                   "clone3": "ENOSYS", "vsock": "EAFNOSUPPORT"}


def test_dev_shm_is_sized_like_tmp_and_dev_is_read_only(bwrap: BwrapBackend) -> None:
    result = sh(bwrap, "stat -f -c '%b %S' /dev/shm /tmp; touch /dev/planted || echo refused")
    shm, tmp, verdict = result.stdout.splitlines()
    for line in (shm, tmp):
        blocks, block_size = map(int, line.split())
        assert blocks * block_size == SMALL.memory_mb * MIB, result
    assert verdict == "refused", result


def test_a_child_killed_by_the_memory_limit_is_reported(bwrap: BwrapBackend) -> None:
    if not memory_cgroup(bwrap):
        pytest.skip(NO_MEMORY_CGROUP)
    limits = Limits(cpu_s=5, memory_mb=64, address_space_mb=0, max_processes=16)
    result = sh(bwrap, "tail /dev/zero; echo survived", limits=limits, timeout_s=8)
    assert (result.killed, result.exit_code, result.stdout) == ("memory", 0, "survived\n"), result


def bounded(work_root: str) -> BwrapBackend:
    """A backend whose work dirs are tmpfs of their own (off by default: it costs)."""
    require_bwrap()
    return BwrapBackend(work_root=work_root, bounded_workdirs=True)


def test_mountinfo_names_no_host_path(work_root: str) -> None:
    bwrap = bounded(work_root)

    async def body() -> tuple[str, str]:
        async with await bwrap.start(SMALL) as sb:
            if not sb.workdir_bounded:  # type: ignore[attr-defined]
                skip_unless_mounting_is_refused("a plain work dir shows its host path")
            result = await sb.exec(["cat", "/proc/self/mountinfo"], timeout_s=5)
            return result.stdout, sb.host_dir  # type: ignore[attr-defined]

    mountinfo, host_dir = run(body())
    assert os.path.basename(host_dir) not in mountinfo
    assert os.path.realpath(bwrap.work_root) not in mountinfo
    assert f"-{os.getpid()}-" not in mountinfo  # the owner's pid, part of the dir's name


def test_the_work_dir_is_bounded_in_size_and_files(work_root: str) -> None:
    bwrap = bounded(work_root)
    limits = dataclasses.replace(SMALL, max_file_mb=4, workdir_mb=10, workdir_files=200)
    fill = ("for i in 1 2 3; do head -c 4M /dev/zero > f$i 2>/dev/null || echo full-f$i; done; "
            "mkdir d && i=0; while [ $i -lt 400 ]; do true 2>/dev/null > d/$i || "
            "{ echo no-inode-$i; break; }; i=$((i+1)); done")

    async def body() -> None:
        async with await bwrap.start(limits) as sb:
            if not sb.workdir_bounded:  # type: ignore[attr-defined]
                skip_unless_mounting_is_refused("plain work dirs are bounded by nothing")
            result = await sb.exec(["sh", "-c", fill], timeout_s=10)
            lines = result.stdout.split()
            assert lines[0] == "full-f3" and lines[1].startswith("no-inode-"), result
            assert int(lines[1].split("-")[-1]) < limits.workdir_files
            with pytest.raises(SandboxFileError):
                await sb.put_file("more.bin", b"x" * MIB)
            again = await sb.exec(["sh", "-c", "rm -r d f2 && wc -c < f1"], timeout_s=5)
            assert again.stdout.strip() == str(4 * MIB), again  # persists, and room again
            await sb.put_file("more.bin", b"x" * MIB)
            assert len(await sb.get_file("f1", max_bytes=4 * MIB)) == 4 * MIB

    run(body())
