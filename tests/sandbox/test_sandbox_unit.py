"""Unit tests: limits, result classification, paths and host-side file I/O, token bucket."""

from __future__ import annotations

import os
import signal

import pytest
from sandbox_helpers import run

from treadle.errors import (
    SandboxError,
    SandboxFileError,
    SandboxFileTooLarge,
    SandboxPathError,
    SandboxSupervisorError,
    TreadleError,
)
from treadle.sandbox import (
    ExecResult,
    Limits,
    TokenBucket,
    _files,
    _process,
    _seccomp,
    get_backend,
)
from treadle.sandbox._cgroup import _unescape
from treadle.sandbox.base import MIB, classify
from treadle.sandbox.inside import reaper
from treadle.testing import FakeClock


def test_limits_validate_and_map_to_rlimits() -> None:
    limits = Limits(cpu_s=3, memory_mb=100, max_processes=7, max_file_mb=2, max_open_files=9)
    table = {name: (soft, hard) for name, soft, hard in limits.rlimits()}
    assert table["CPU"] == (3, 4)  # hard = SIGKILL one second after SIGXCPU
    assert table["AS"] == (100 * MIB, 100 * MIB)
    assert table["NPROC"] == (7, 7) and table["NOFILE"] == (9, 9)
    assert table["FSIZE"] == (2 * MIB, 2 * MIB) and table["CORE"] == (0, 0)
    assert "AS" not in {n for n, _, _ in Limits(address_space_mb=0).rlimits()}
    assert Limits(memory_mb=64, address_space_mb=512).address_space_bytes == 512 * MIB
    for bad in ({"cpu_s": 0}, {"memory_mb": -1}, {"max_output_bytes": 0},
                {"wall_timeout_s": 0}, {"address_space_mb": -5}):
        with pytest.raises(ValueError):
            Limits(**bad)


def test_reaper_spec_round_trips() -> None:
    spec = reaper.format_spec(Limits(cpu_s=2).rlimits())
    parsed = reaper.parse_spec(spec)
    import resource

    assert (resource.RLIMIT_CPU, 2, 3) in parsed


@pytest.mark.parametrize(
    ("returncode", "by_status", "own", "oom", "expected"),
    [
        (0, True, None, False, (0, None)),
        (3, True, None, False, (3, None)),
        (-signal.SIGKILL, False, None, True, (None, "memory")),
        (128 + signal.SIGKILL, True, None, True, (None, "memory")),
        (128 + signal.SIGKILL, True, None, False, (None, "signal:9")),
        (128 + signal.SIGKILL, False, None, False, (137, None)),  # local: a real exit 137
        (-signal.SIGXCPU, False, None, False, (None, "cpu")),
        (128 + signal.SIGXFSZ, True, None, False, (None, "file_size")),
        (-signal.SIGKILL, False, "timeout", False, (None, "timeout")),
        (0, True, None, True, (0, "memory")),  # a child was OOM-killed, the command went on
        (3, False, None, True, (3, "memory")),
        (-signal.SIGKILL, False, "output_limit", True, (None, "output_limit")),
    ],
)
def test_classify(returncode: int, by_status: bool, own: str | None, oom: bool,
                  expected: tuple[int | None, str | None]) -> None:
    assert classify(returncode=returncode, signalled_by_status=by_status, own_kill=own,
                    oom_killed=oom) == expected


def test_exec_result_ok() -> None:
    assert ExecResult(0, "", "", False, None, 0.1).ok
    assert not ExecResult(None, "", "", True, "timeout", 0.1).ok
    assert not ExecResult(1, "", "", False, None, 0.1).ok


def test_error_tree() -> None:
    assert issubclass(SandboxPathError, SandboxError) and issubclass(SandboxPathError, ValueError)
    assert issubclass(SandboxSupervisorError, SandboxError)
    assert issubclass(SandboxFileTooLarge, SandboxFileError)
    assert issubclass(SandboxError, TreadleError)


@pytest.mark.parametrize("path", ["", "../x", "a/../../x", "/etc/passwd", "/work", "/workx/a",
                                  "a\x00b", ".", "/work/"])
def test_split_path_refuses_escapes(path: str) -> None:
    with pytest.raises(SandboxPathError):
        _files.split_path(path, "/work")


def test_split_path_accepts_inside_paths() -> None:
    assert _files.split_path("a/./b//c.txt", "/work") == ["a", "b", "c.txt"]
    assert _files.split_path("/work/a/b", "/work") == ["a", "b"]


def test_host_file_io_never_follows_sandbox_planted_links(tmp_path: os.PathLike[str]) -> None:
    work = os.fspath(tmp_path)
    secret = os.path.join(work, "..", "secret-outside")
    with open(secret, "w") as f:
        f.write("host secret")
    _files.write_file(work, ["d", "f.txt"], b"data", None)
    assert _files.read_file(work, ["d", "f.txt"], 100) == b"data"
    os.symlink(os.path.abspath(secret), os.path.join(work, "link"))
    os.symlink("/", os.path.join(work, "rootlink"))
    os.mkfifo(os.path.join(work, "fifo"))
    with pytest.raises(SandboxPathError):
        _files.read_file(work, ["link"], 100)
    with pytest.raises(SandboxPathError):
        _files.read_file(work, ["rootlink", "etc", "hostname"], 100)
    with pytest.raises(SandboxPathError):
        _files.write_file(work, ["rootlink", "tmp", "pwned"], b"x", None)
    with pytest.raises(SandboxFileError):
        _files.read_file(work, ["fifo"], 100)  # must not block
    with pytest.raises(SandboxFileError):
        _files.read_file(work, ["missing"], 100)
    with pytest.raises(SandboxFileTooLarge):
        _files.read_file(work, ["d", "f.txt"], 3)
    # Writing over a planted symlink replaces the link; the target is untouched.
    _files.write_file(work, ["link"], b"replaced", None)
    with open(secret) as f:
        assert f.read() == "host secret"
    assert not os.path.islink(os.path.join(work, "link"))


def test_mountinfo_unescape() -> None:
    assert _unescape("/sys/fs/cgroup/a\\040b") == "/sys/fs/cgroup/a b"


def test_token_bucket_spaces_out_creations() -> None:
    async def body() -> list[float]:
        clock = FakeClock(autojump=True)
        bucket = TokenBucket(rate_per_s=20.0, burst=2, clock=clock)
        stamps = []
        for _ in range(6):
            await bucket.take()
            stamps.append(clock.now())
        return stamps

    # The burst is immediate; the other four wait 50 ms each.
    assert run(body()) == pytest.approx([0.0, 0.0, 0.05, 0.1, 0.15, 0.2])
    with pytest.raises(ValueError):
        TokenBucket(0, 1)


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(KeyError, match="bwrap, local"):
        get_backend("docker")


def test_usable_backend_name_is_bwrap_where_it_runs_else_local(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox_helpers import require_bwrap

    from treadle.errors import SandboxUnavailable
    from treadle.sandbox import registry
    from treadle.sandbox.bwrap import BwrapBackend

    require_bwrap()
    assert registry.usable_backend_name() == "bwrap"  # a real sandbox ran python3

    async def refused(self: BwrapBackend, limits: Limits) -> None:
        raise SandboxUnavailable("user namespaces are off")

    monkeypatch.setattr(BwrapBackend, "start", refused)
    assert registry.usable_backend_name() == "local"


def test_the_gate_sets_the_outer_limits_in_the_units_of_ulimit() -> None:
    import resource
    import subprocess

    limits = Limits(cpu_s=3, memory_mb=100, max_file_mb=2, max_open_files=9)
    outer = tuple((getattr(resource, f"RLIMIT_{name}"), soft, hard)
                  for name, soft, hard in limits.rlimits() if name != "NPROC")
    script = _process.gate_script(outer)
    shown = subprocess.run(["/bin/sh", "-c", script, "gate", "cat", "/proc/self/limits"],
                           input=b"go\n", capture_output=True, check=True).stdout.decode()
    rows = {line[:26].strip(): line[26:68].split() for line in shown.splitlines()[1:]}
    assert rows["Max cpu time"] == ["3", "4"]
    assert rows["Max file size"] == [str(2 * MIB)] * 2
    assert rows["Max open files"] == ["9", "9"]
    assert rows["Max address space"] == [str(100 * MIB)] * 2
    assert rows["Max core file size"] == ["0", "0"]
    refused = subprocess.run(["/bin/sh", "-c", script, "gate", "true"], input=b"stop\n",
                             check=False)
    assert refused.returncode == 125  # no go-ahead, no exec
    with pytest.raises(ValueError):
        _process.gate_script(((resource.RLIMIT_FSIZE, 1000, 1000),))  # not whole blocks


def test_the_reported_exit_code_is_read_from_bwraps_status_documents() -> None:
    read, write = os.pipe2(os.O_NONBLOCK)
    try:
        os.write(write, b'{\n    "child-pid": 12,\n    "ipc-namespace": 4026\n}\n'
                        b'{ "exit-code": 3 }\n')
        assert _process._reported_exit(read) == 3
        os.write(write, b'{\n    "child-pid": 12\n}\n')  # setup failed: no exit-code
        assert _process._reported_exit(read) is None
        assert _process._reported_exit(read) is None  # nothing at all
    finally:
        os.close(read)
        os.close(write)


def test_the_syscall_filter_denies_the_documented_calls() -> None:
    found = _seccomp.syscall_filter()
    if found is None:
        pytest.skip("libseccomp is not installed")
    assert len(found.program) % 8 == 0 and found.arch != "unknown"
    for name in ("ptrace", "process_vm_readv", "process_vm_writev", "keyctl", "add_key",
                 "request_key", "bpf", "perf_event_open", "userfaultfd", "kexec_load",
                 "init_module", "mount", "umount2", "unshare", "setns", "io_uring_setup"):
        assert name in found.denied, name
    assert set(found.denied) | set(found.unknown) == set(_seccomp.DENIED)
    fd = found.open_fd()
    try:
        assert os.read(fd, len(found.program) + 1) == found.program  # each fd starts at 0
    finally:
        os.close(fd)
