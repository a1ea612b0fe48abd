"""The zygote of the resident executor (`agent`): an interpreter started
once per sandbox, kept idle, that forks each `python3 -u -` call.

Started by the agent as `python3 -s -u -c <this file> FD ENV_JSON` with the call's
environment but no PYTHONPATH (standard library only: the source is passed in, as
treadle's checkout is hidden inside the sandbox). FD is its channel to the agent.
Each call is a fresh forked process that takes the call's exact environment, then
`python3 -`'s path (``''``, PYTHONPATH, the user site with its .pth files and
usercustomize) and runs stdin as ``__main__``; nothing it sets survives it. What
this process itself imports, it imports before any path a call can write to is on
``sys.path``.

Started with a third argument, ``session``, it is the kernel of a Python session
(`Sandbox.run_cell`): a call runs its cell in the session's one ``__main__`` (the
path set up by the first cell), and a cell that ends, by finishing, an uncaught
exception or ``sys.exit``, does not exit: its process hands the output pipes back
(fds 0-2 to /dev/null), becomes non-dumpable and serves the next calls as the new
kernel, announcing itself with ``kept:STATUS next:STANDBY``; the agent then kills
the old kernel. A cell that is killed, exits its process or leaves a thread running
ends as a process, which leaves the old kernel, and so the session as it was before
that cell. Each cell is still a fresh fork (its CPU time starts at zero); a kernel
has one thread, and the agent kills every other process after each call.
"""

from __future__ import annotations

import sys

# Run (not imported, as treadle's tests import every module): started with -s and
# without PYTHONPATH, its sys.path[0] ('') dropped before any import, so nothing a
# call can write (the work dir, HOME's user site, a PYTHONPATH dir) runs in this
# long-lived process. The call's own path is set up after the fork.
if __name__ == "__main__" and not sys.flags.safe_path:
    del sys.path[0]
# After the path is made safe, hence not at the top.
import atexit
import ctypes
import json
import os
import resource
import site
import socket
import types
from typing import Any, NoReturn

_ENV: dict[str, str] = {}  # the call's env, exactly (PYTHONPATH too): argv[2]
_SESSION: list[types.ModuleType] = []  # a session's __main__, once its first cell made it
_KERNEL = [False]  # started with "session": calls are cells of one session


def _as_python_dash() -> None:
    # What `python3 -u -` has that this process lacks: '' first, PYTHONPATH's entries
    # next, the user site (with its .pth files and usercustomize) before the system site.
    if dict(os.environ) != _ENV:
        for key in list(os.environ):
            del os.environ[key]
        os.environ.update(_ENV)  # also the order `env` lists them in
    extra = [p for p in _ENV.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:0] = [*([] if sys.flags.safe_path else [""]),
                     *[os.path.abspath(p) for p in extra]]
    if not _ENV.get("PYTHONNOUSERSITE") and os.getuid() == os.geteuid() \
            and os.getgid() == os.getegid():
        site.ENABLE_USER_SITE = True
        before = len(sys.path)
        site.addusersitepackages(None)  # type: ignore[arg-type]  # None: look them up
        added = sys.path[before:]
        del sys.path[before:]
        systems = set(site.getsitepackages())
        at = next((i for i, p in enumerate(sys.path) if p in systems), len(sys.path))
        sys.path[at:at] = added
        if "sitecustomize" not in sys.modules and extra:
            site.execsitecustomize()
        site.execusercustomize()
    elif "sitecustomize" not in sys.modules and extra:
        site.execsitecustomize()


def _call(chan: socket.socket) -> int:
    """Run one call in this forked standby and exit; a kept cell returns its status."""
    msg, fds, _, _ = socket.recv_fds(chan, 16, 3)
    if msg != b"run" or len(fds) != 3:
        os._exit(0)
    me = os.getpid()
    chan.send(b"pid:%d" % me)
    if not _KERNEL[0]:
        chan.close()
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # a call is as dumpable as any process
    if not _SESSION:
        try:
            _as_python_dash()
        except BaseException as e:  # a broken .pth or usercustomize: reported as python does
            sys.excepthook(type(e), e, e.__traceback__)
    chunks = []
    while chunk := os.read(0, 1 << 20):
        chunks.append(chunk)
    main = _SESSION[0] if _SESSION else types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    if _KERNEL[0]:
        _SESSION[:] = [main]
    sys.argv[:] = ["-"]
    try:
        try:
            exec(compile(b"".join(chunks), "<stdin>", "exec"), main.__dict__)
        except BaseException as e:
            if isinstance(e, SystemExit):
                raise
            tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
            # From the code's own frames on, as `python3 -` prints it.
            sys.excepthook(type(e), e.with_traceback(tb), tb)
            raise SystemExit(1) from None
        raise SystemExit(0)
    except SystemExit as e:
        status = _exit_status(e.code)
    if _KERNEL[0] and os.getpid() == me:  # (a process the cell forked only exits)
        return _keep(status)
    _finish(main, status)


_THREADS_LEFT = ("[treadle: this cell left threads running, which a Python session "
                 "cannot keep (each cell runs in a fork of the session, and a fork has "
                 "one thread); the session is as it was before this cell]\n")


def _keep(status: int) -> int:
    # The cell's process becomes the session's kernel: its output flushed and the
    # host's pipes closed (the host reads them to EOF), our memory unreachable to
    # later cells again; `_serve` then runs it as a kernel, whose first word is `kept:`.
    # A kernel runs nothing of its own between calls: a cell that leaves a thread
    # alive (which would run beside later calls, graders' included) is not kept.
    threading = sys.modules.get("threading")
    if threading is not None and threading.active_count() > 1:
        _write_all(2, _THREADS_LEFT.encode())
        os._exit(status)
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except BaseException:
        status = status or 120
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    os.close(null)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    return status


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass  # the host stopped reading: nothing to tell


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:  # noqa: SIM105 (contextlib would be one more import at the zygote's start)
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def _finish(main: types.ModuleType, status: int) -> NoReturn:
    # What the interpreter's exit does that a program can notice, in its order:
    # non-daemon threads joined, atexit handlers, objects of __main__ (open files:
    # flushed and closed) released, the standard streams flushed. Not the module
    # teardown and final collection, which cost 10-50 ms of a call: an object only a
    # reference cycle holds is not finalised (a file opened in one is not flushed).
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
        main.__dict__.clear()  # (a full gc.collect() would cost more than the call)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except BaseException as e:
        try:  # noqa: SIM105 (as above)
            sys.excepthook(type(e), e, e.__traceback__)
        except BaseException:
            pass
        status = status or 120  # what the interpreter exits with when flushing fails
    os._exit(status)


def _serve(chan: socket.socket) -> None:
    kept: int | None = None
    while True:  # the first kernel, then (a session) each cell that kept its process
        kept = _kernel(chan, kept)


def _kernel(chan: socket.socket, kept: int | None) -> int:
    """Serve calls until a forked call returns: then, in that child, its kept status."""
    # A standby is forked ahead of each call (the fork's cost is then off the call's
    # path); it takes the next `run` from the resident itself. The zygote only
    # reaps and reports: "ready:STANDBY", then "status:S next:STANDBY" per call.
    # A finished call is reaped only after its status is sent: if the call killed
    # this process in between, the call is a zombie the resident (init) inherits
    # and reaps with its exact status, never a status lost with the zygote.
    limit = resource.getrlimit(resource.RLIMIT_CPU)[0]  # imported above, before any path
    spent = sum(os.times()[:2])  # a kept cell's own work is not the kernel's
    status: int | None = None
    finished: int | None = None  # the last call, ended and not reaped yet
    while True:
        if status is not None and limit > 0 and sum(os.times()[:2]) - spent > (
                limit - spent) / 2:
            chan.send(b"status:%d next:0" % status)
            os._exit(0)  # half of what RLIMIT_CPU left spent on forks: the resident starts anew
        standby = os.fork()
        if standby == 0:
            return _call(chan)
        if kept is not None:
            try:
                chan.send(b"kept:%d next:%d" % (kept, standby))
            except OSError:  # the agent dropped this session (its kernel died): a plain end
                os._exit(kept)
            kept = None
        else:
            chan.send(b"ready:%d" % standby if status is None
                      else b"status:%d next:%d" % (status, standby))
        if finished is not None:
            os.waitpid(finished, 0)
        while True:  # reap anything that became our child too (clone with CLONE_PARENT)
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            if info is not None and info.si_pid == standby:
                break
            if info is not None:
                os.waitpid(info.si_pid, 0)
        status = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        finished = standby

if __name__ == "__main__":
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: calls cannot open our memory
    _ENV.update(json.loads(sys.argv[2]))
    _KERNEL[0] = sys.argv[3:] == ["session"]
    _serve(socket.socket(fileno=int(sys.argv[1])))
