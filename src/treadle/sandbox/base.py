"""The sandbox interface: limits, results, and the two abstract classes.

A `Sandbox` is one isolated workspace: a work dir that persists between calls and
an `exec` that runs one command in it under `Limits`. A `SandboxBackend` makes
sandboxes. Everything is async: commands run in child processes and the event loop
only waits on pipes, so a slow tool never blocks other trajectories.

Contracts every backend keeps:

- `exec` never raises for what the command does. Non-zero exits, signals, timeouts,
  memory/CPU kills and oversized output all come back as an `ExecResult`.
  Exceptions (the `SandboxError` tree in `treadle.errors`) mean the infrastructure
  failed.
- Processes do not outlive their `exec` call: when the command exits (or is
  killed), everything it started, background and daemonised processes included,
  is killed before `exec` returns. Only files in the work dir persist.
- `close` is idempotent, kills whatever is still running and removes the work dir.
- The one exception to "only files persist": `run_cell`, a Python session (globals
  kept from call to call, as in a notebook), where `keeps_python_session` says the
  backend has one (bwrap's resident executor); elsewhere it raises
  `SandboxUnsupported`.
- Paths given to `put_file`/`get_file` are relative to the work dir, or absolute
  under `Sandbox.workdir`; anything that resolves outside is a `SandboxPathError`.

The interface is deliberately transport-neutral (bytes in, dataclasses out) so that
a remote backend (an HTTP sandbox server) can implement it later unchanged.
"""

from __future__ import annotations

import re
import signal
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from treadle.errors import SandboxClosed, SandboxUnsupported

MIB = 1024 * 1024
DEFAULT_MAX_GET_BYTES = 16 * MIB


@dataclass(frozen=True, slots=True)
class Limits:
    """Resource limits of one sandbox; every exec in it runs under them.

    Each limit is enforced per exec, not summed over a sandbox's lifetime. Which
    mechanism enforces which limit is in docs/sandbox.md; in short, rlimits bound
    each process, and a cgroup (when the host offers a writable cgroup, v1 or v2)
    bounds the exec's whole process tree.
    """

    # CPU seconds per process (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL one
    # second later. Reported as killed="cpu". Bounds spinning, not sleeping.
    cpu_s: int = 10
    # Memory of the exec's whole process tree, MiB (cgroup memory+swap limit; the
    # kernel OOM-kills inside it, reported as killed="memory"). Also the default for
    # address_space_mb, which applies even without cgroups.
    memory_mb: int = 512
    # Virtual address space per process, MiB (RLIMIT_AS): allocations beyond it
    # fail (MemoryError, ENOMEM) rather than kill. None = memory_mb. 0 = no limit,
    # for runtimes that reserve large virtual ranges (JVM, Go, Node, ASan), which
    # leaves only the cgroup to bound memory.
    address_space_mb: int | None = None
    # Processes/threads of the exec's tree (cgroup pids.max) and per user inside
    # the sandbox (RLIMIT_NPROC, which the kernel ignores for host root).
    max_processes: int = 64
    # Largest file any process may write, MiB (RLIMIT_FSIZE; SIGXFSZ / EFBIG).
    max_file_mb: int = 64
    # All files of the work dir together, MiB, and how many files, directories and
    # links it may hold (ENOSPC past either). Enforced where the work dir is a tmpfs
    # of its own (bwrap with bounded_workdirs=True and treadle as root); it then
    # lives in memory.
    workdir_mb: int = 512
    workdir_files: int = 32768
    # Open file descriptors per process (RLIMIT_NOFILE).
    max_open_files: int = 256
    # Bytes of stdout+stderr kept per exec; past it the tree is killed and the
    # result is marked truncated (killed="output_limit").
    max_output_bytes: int = 1 * MIB
    # Ceiling on one exec's wall time, seconds; an exec's own timeout_s is
    # clamped to it. The whole tree is killed at the deadline (killed="timeout").
    wall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_mb", "max_processes", "max_file_mb", "workdir_mb",
                     "workdir_files", "max_open_files", "max_output_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")
        if self.address_space_mb is not None and self.address_space_mb < 0:
            raise ValueError("Limits.address_space_mb must be None, 0 (off) or positive")
        if not self.wall_timeout_s > 0:
            raise ValueError(f"Limits.wall_timeout_s must be > 0, got {self.wall_timeout_s!r}")

    @property
    def address_space_bytes(self) -> int | None:
        """RLIMIT_AS in bytes, or None when disabled."""
        mb = self.memory_mb if self.address_space_mb is None else self.address_space_mb
        return mb * MIB if mb else None

    def rlimits(self) -> list[tuple[str, int, int]]:
        """(resource name, soft, hard) for every rlimit, names as in `resource.RLIMIT_*`.

        Core dumps are disabled: a crashing agent should not write 100 MB files.
        """
        out = [
            ("CPU", self.cpu_s, self.cpu_s + 1),  # hard limit = SIGKILL for SIGXCPU ignorers
            ("NPROC", self.max_processes, self.max_processes),
            ("FSIZE", self.max_file_mb * MIB, self.max_file_mb * MIB),
            ("NOFILE", self.max_open_files, self.max_open_files),
            ("CORE", 0, 0),
        ]
        address_space = self.address_space_bytes
        if address_space is not None:
            out.append(("AS", address_space, address_space))
        return out


@dataclass(frozen=True, slots=True)
class ExecResult:
    """What one command did. Built by the backend; never raised."""

    exit_code: int | None  # the command's exit status; None if it died by a signal or a kill
    stdout: str  # UTF-8 (invalid bytes replaced), at most the kept bytes
    stderr: str  # same for stderr; the cap counts both streams together
    timed_out: bool  # the wall deadline was hit (then killed == "timeout")
    killed: str | None  # why it was stopped: "timeout", "output_limit", "memory",
    #   "cpu", "file_size" or "signal:N"; None when it exited on its own. "memory"
    #   whenever the memory limit killed any process of the tree, even if the
    #   command itself then exited (exit_code is then its status)
    duration_s: float  # wall seconds from start to the tree being gone
    truncated: bool = False  # output was cut at Limits.max_output_bytes

    @property
    def ok(self) -> bool:
        """Exited on its own with status 0."""
        return self.exit_code == 0 and self.killed is None


def classify(
    *,
    returncode: int,
    signalled_by_status: bool,
    own_kill: str | None,
    oom_killed: bool,
) -> tuple[int | None, str | None]:
    """(exit_code, killed) from a wait status.

    `returncode` is asyncio's: negative = killed by that signal. With
    `signalled_by_status` a status of 128+N (how bwrap and shells report a child
    killed by signal N) is read as that signal too; a command that itself exits
    with 128+N is then misread, a limit of the bwrap backend.
    `own_kill` is the reason we killed the tree ourselves, which wins.
    `oom_killed` (the memory limit killed some process of the tree) is reported as
    "memory" whatever the command's own status was.
    """
    signum: int | None = None
    if returncode < 0:
        signum = -returncode
    elif signalled_by_status and 128 < returncode < 128 + 65:
        signum = returncode - 128
    if own_kill is not None:
        return None, own_kill
    if oom_killed:
        return (returncode if signum is None else None), "memory"
    if signum is None:
        return returncode, None
    if signum == signal.SIGXCPU:
        return None, "cpu"
    if signum == signal.SIGXFSZ:
        return None, "file_size"
    return None, f"signal:{signum}"


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of `env`, or ValueError for names or values a process cannot receive."""
    out: dict[str, str] = {}
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ValueError(f"invalid environment variable name {key!r}")
        if not isinstance(value, str) or "\x00" in value:
            raise ValueError(f"invalid value for environment variable {key}")
        out[key] = value
    return out


def check_argv(argv: Sequence[str]) -> list[str]:
    if isinstance(argv, str | bytes):
        raise ValueError("argv must be a sequence of strings, not one string (no shell is used)")
    out = list(argv)
    if not out:
        raise ValueError("argv is empty")
    for arg in out:
        if not isinstance(arg, str) or "\x00" in arg:
            raise ValueError(f"invalid argument {arg!r}")
    return out


class Sandbox(ABC):
    """One isolated workspace. See the module docstring for the contracts."""

    @property
    @abstractmethod
    def workdir(self) -> str:
        """The work dir as commands inside see it (also their cwd and HOME)."""

    @property
    @abstractmethod
    def limits(self) -> Limits:
        """The limits every exec runs under."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once `close` has started."""

    def _check_open(self) -> None:
        """For implementations: SandboxClosed once `close` has started."""
        if self.closed:
            raise SandboxClosed("sandbox is closed")

    def _checked_exec(self, argv: Sequence[str], timeout_s: float,
                      env: Mapping[str, str] | None) -> tuple[list[str], dict[str, str], float]:
        """For implementations: an exec's argv, extra environment and timeout (clamped
        to the limits' wall timeout), or what `exec` raises for them (SandboxClosed,
        ValueError)."""
        self._check_open()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        return check_argv(argv), check_env(env), min(timeout_s, self.limits.wall_timeout_s)

    @abstractmethod
    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run `argv` (no shell) in the work dir; wait for it and its whole tree.

        `timeout_s` is clamped to `limits.wall_timeout_s`. `env` is added to a
        minimal environment (PATH, HOME, LANG); nothing of the caller's leaks in.
        Everything the command does is reported in the result. Raises
        SandboxClosed if the sandbox is (or gets) closed, ValueError for an empty
        argv or a bad env. Cancelling the caller kills the tree first, then
        re-raises CancelledError.
        """

    @property
    def keeps_python_session(self) -> bool:
        """Whether `run_cell` keeps a Python session here (False: it raises)."""
        return False

    async def run_cell(self, code: bytes, *, timeout_s: float, python: str = "python3",
                       env: Mapping[str, str] | None = None) -> ExecResult:
        """Run `code` in this sandbox's Python session, as `python -u -` would run it
        but in one `__main__` whose globals (and imports) stay for the next cell.

        The result is the cell's: status 0, 1 for an uncaught exception (traceback on
        stderr), or what `sys.exit` gave; either way the session keeps what the cell
        did. A cell that is killed (timeout, memory, CPU, output cap), ends its
        process (`os._exit`, a signal) or leaves a thread running (its stderr says
        so) leaves the session as it was before the cell; one that had already ended
        when its limit struck may be reported as killed and keep what it did.
        Cells run one at a time, under the same limits as an `exec`; processes a
        cell starts do not carry over. Another `python` or `env` starts a new
        session; so does a sandbox that had to replace its executor (a cell that
        left System V IPC objects, an executor past half its CPU budget) or its
        session's process (killed from another call), and that cell's stderr then
        begins with a line saying the session restarted. Raises SandboxUnsupported
        where `keeps_python_session` is False, SandboxSupervisorError if the
        executor cannot start, otherwise as `exec`.
        """
        raise SandboxUnsupported(f"{type(self).__name__} keeps no Python session; "
                                 "run_cell needs the bwrap backend's resident executor")

    @abstractmethod
    async def put_file(self, path: str, data: bytes) -> None:
        """Write `data` to `path` (parents created), replacing any file there."""

    @abstractmethod
    async def get_file(self, path: str, max_bytes: int = DEFAULT_MAX_GET_BYTES) -> bytes:
        """Read a regular file; SandboxFileTooLarge past max_bytes, SandboxFileError if absent."""

    @abstractmethod
    async def close(self) -> None:
        """Kill every process of this sandbox and remove its work dir. Idempotent."""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class SandboxBackend(ABC):
    """Makes sandboxes of one kind (bwrap, local; remote later)."""

    name: str = ""  # registry name, e.g. "bwrap"
    image: str | None = None  # the environment image its sandboxes run on; None: the host's

    def with_image(self, image: str | None) -> SandboxBackend:
        """A backend like this one whose sandboxes run on `image` (a ref of
        `treadle.sandbox.images`; None: the host's dirs). SandboxUnsupported where
        this kind of backend runs no images."""
        if image is None:
            return self
        raise SandboxUnsupported(f"the {self.name} backend runs no environment images "
                                 "(bwrap does, and remote on a server started with --images)")

    async def prepare(self) -> None:
        """Do now what this backend's first start does once (open its image, unpacking
        it if need be; check the host), so that its first sandbox starts at once.
        Raises what that start would; the default does nothing."""
        return None  # (a backend with nothing to open: its first start is as quick)

    @abstractmethod
    async def start(self, limits: Limits) -> Sandbox:
        """Create one sandbox. Raises SandboxStartError (SandboxUnavailable if never possible).

        Cancellation-safe: if cancelled, nothing it created is left behind.
        """
