"""The resident executor (bwrap's default): what one long-lived namespace per sandbox must keep.

Every exec of the battery (test_sandbox_bwrap_security.py and the others) already
runs through it; these tests check what only a long-lived executor could get
wrong: state leaking from one call to the next, the executor dying between or
during calls, concurrent calls, the python zygote, and the per-call fallback.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import sandbox_probes as probes
from sandbox_helpers import SMALL, marker, run, sleepers, wait_until

from treadle.errors import SandboxSupervisorError
from treadle.sandbox import BwrapBackend, ExecResult

pytestmark = pytest.mark.integration

PY = ["python3", "-u", "-"]


def test_calls_share_one_executor_but_nothing_of_each_other(bwrap: BwrapBackend) -> None:
    tag = marker()

    async def body() -> list[ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            return [
                await sb.exec(["sh", "-c", f"readlink /proc/self/ns/pid; sleep {tag} & "
                                           "echo x > /tmp/t; "
                                           "echo y > /dev/shm/s; mkdir -m 0 /tmp/locked"],
                              timeout_s=5),
                await sb.exec(["sh", "-c", "readlink /proc/self/ns/pid; ls -A /dev/shm /tmp; env"],
                              timeout_s=5,
                              env={"ONLY_HERE": "1"}),
                await sb.exec(["sh", "-c", "env"], timeout_s=5),
            ]

    first, second, third = run(body())
    assert first.ok and second.ok and third.ok, (first, second, third)
    assert first.stdout.split()[0] == second.stdout.split()[0]  # one namespace for both
    assert "/dev/shm:\n\n/tmp:\nHOME" in second.stdout, second  # emptied between calls
    assert "ONLY_HERE=1" in second.stdout and "ONLY_HERE" not in third.stdout
    assert not sleepers(tag)  # the background sleep died with its call


def test_python_calls_are_fresh_processes_with_python_semantics(bwrap: BwrapBackend) -> None:
    scripts = [
        b"import sys\nx = 41\nopen('kept.txt', 'w').write('file')\nprint(sys.argv, x + 1)",
        b"print('x' in globals(), open('kept.txt').read())",
        b"import atexit\natexit.register(print, 'bye')\nf = open('unclosed', 'w')\n"
        b"f.write('flushed')\nraise SystemExit(3)",
        b"print(open('unclosed').read()); 1/0",
        b"raise SystemExit('a message')",
        b"def broken(:",
    ]

    async def body() -> list[ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            return [await sb.exec(PY, timeout_s=10, stdin=code) for code in scripts]

    first, second, third, fourth, fifth, sixth = run(body())
    assert (first.exit_code, first.stdout) == (0, "['-'] 42\n"), first
    assert (second.exit_code, second.stdout) == (0, "False file\n"), second
    assert (third.exit_code, third.stdout) == (3, "bye\n"), third
    assert fourth.exit_code == 1 and fourth.stdout == "flushed\n", fourth
    assert fourth.stderr.startswith('Traceback (most recent call last):\n  File "<stdin>"')
    assert "ZeroDivisionError" in fourth.stderr
    assert (fifth.exit_code, fifth.stderr) == (1, "a message\n"), fifth
    assert sixth.exit_code == 1 and "SyntaxError" in sixth.stderr, sixth


def test_python_call_limits_hold(bwrap: BwrapBackend) -> None:
    async def body() -> list[ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            return [await sb.exec(PY, timeout_s=timeout, stdin=code) for code, timeout in [
                (b"while True: pass", 8), (b"import signal; signal.pause()", 1),
                (b"print('y' * 10**6)", 5), (b"print('after')", 5)]]

    cpu, slow, loud, after = run(body())
    assert cpu.killed == "cpu", cpu
    assert slow.killed == "timeout" and slow.timed_out, slow
    assert loud.killed == "output_limit" and loud.truncated, loud
    assert after.ok and after.stdout == "after\n", after


def test_a_call_killing_the_zygote_gets_its_own_result(bwrap: BwrapBackend) -> None:
    code = b"import os, signal; os.kill(os.getppid(), signal.SIGKILL); print('alive')"

    async def body() -> list[ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            return [await sb.exec(PY, timeout_s=10, stdin=code),
                    await sb.exec(PY, timeout_s=10, stdin=b"print('next')")]

    killer, after = run(body())
    assert killer.ok and killer.stdout == "alive\n", killer
    assert after.ok and after.stdout == "next\n", after


def test_left_ipc_objects_make_a_fresh_executor(bwrap: BwrapBackend) -> None:
    async def body() -> tuple[ExecResult, ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            made = await sb.exec(["ipcmk", "-M", "65536"], timeout_s=5)
            return made, await sb.exec(["ipcs", "-m"], timeout_s=5)

    made, listed = run(body())
    assert made.ok, made
    assert "0x" not in listed.stdout, listed


def test_concurrent_calls_on_one_sandbox_both_run(bwrap: BwrapBackend) -> None:
    tag = marker()

    async def body() -> tuple[ExecResult, ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            slow = asyncio.ensure_future(sb.exec(["sh", "-c", f"sleep {tag} & wait"],
                                                 timeout_s=1))
            await asyncio.to_thread(wait_until, lambda: sleepers(tag))
            quick = await sb.exec(["echo", "meanwhile"], timeout_s=5)  # a per-call launch
            return await slow, quick

    slow, quick = run(body())
    assert slow.killed == "timeout" and quick.ok and quick.stdout == "meanwhile\n"


def test_an_executor_killed_during_a_call_is_replaced(bwrap: BwrapBackend) -> None:
    tag = marker()

    async def body() -> ExecResult:
        async with await bwrap.start(SMALL) as sb:
            probe = asyncio.ensure_future(sb.exec(["sleep", tag], timeout_s=10))
            await asyncio.to_thread(wait_until, lambda: sleepers(tag))
            outer = probes.parent_of(probes.parent_of(sleepers(tag)[0]))
            assert "bwrap" in probes.cmdline_of(outer)
            os.kill(outer, signal.SIGKILL)
            with pytest.raises(SandboxSupervisorError):
                await probe
            return await sb.exec(["echo", "fresh"], timeout_s=5)

    assert run(body()).stdout == "fresh\n"


def test_per_call_fallback_runs_the_same_commands(work_root: str) -> None:
    backend = BwrapBackend(work_root=work_root, executor="per-call")

    async def body() -> list[ExecResult]:
        async with await backend.start(SMALL) as sb:
            return [await sb.exec(["readlink", "/proc/self/ns/pid"], timeout_s=5),
                    await sb.exec(["readlink", "/proc/self/ns/pid"], timeout_s=5),
                    await sb.exec(PY, timeout_s=5, stdin=b"print(2 + 2)")]

    first, second, python = run(body())
    assert first.ok and second.ok and first.stdout != second.stdout  # a namespace per exec
    assert python.ok and python.stdout == "4\n"
    with pytest.raises(ValueError):
        BwrapBackend(work_root=work_root, executor="forking")


def test_planted_modules_run_only_in_the_call_not_in_the_zygote(bwrap: BwrapBackend) -> None:
    # The zygote outlives calls: a module of the work dir or HOME's user site that it
    # imported would run code that persists. `python3 -` runs usercustomize itself.
    site = "/work/.local/lib/python3.11/site-packages"
    resource = "open('/work/log', 'a').write('res\\n')\n"
    usercustomize = "import os; open('/work/log', 'a').write(f'uc {os.getpid()}\\n')\n"
    plant = (f"import os\nos.makedirs({site!r}, exist_ok=True)\n"
             f"open('/work/resource.py', 'w').write({resource!r})\n"
             f"open({site!r} + '/usercustomize.py', 'w').write({usercustomize!r})\n")

    async def body() -> list[ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            return [await sb.exec(["python3", "-c", plant], timeout_s=10),
                    await sb.exec(PY, timeout_s=10, stdin=b"import os; print(os.getpid())"),
                    await sb.exec(["sh", "-c", "rm -r resource.py .local; cat log"], timeout_s=10),
                    await sb.exec(PY, timeout_s=10, stdin=b"print(open('log').read())")]

    planted, called, logged, again = run(body())
    assert planted.ok and called.ok and logged.ok and again.ok, (planted, called, logged, again)
    assert logged.stdout == f"uc {called.stdout.strip()}\n", (called, logged)
    assert again.stdout == logged.stdout + "\n", again


def test_a_stopped_zygote_does_not_stall_later_calls(bwrap: BwrapBackend) -> None:
    stop = ("import os, signal\nfor p in os.listdir('/proc'):\n"
            " if p.isdigit() and int(p) != os.getpid():\n"
            "  try: c = open(f'/proc/{p}/cmdline', 'rb').read()\n"
            "  except OSError: continue\n"
            "  if b'_serve' in c: os.kill(int(p), signal.SIGSTOP); print('stopped', p)")

    async def body() -> list[ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            return [await sb.exec(PY, timeout_s=10, stdin=b"print('up')"),
                    await sb.exec(["python3", "-c", stop], timeout_s=10),
                    await sb.exec(PY, timeout_s=5, stdin=b"print('ran')"),
                    await sb.exec(PY, timeout_s=5, stdin=b"import os, signal\n"
                                  b"os.kill(os.getppid(), signal.SIGSTOP); print('own')"),
                    await sb.exec(PY, timeout_s=5, stdin=b"print('after')")]

    up, stopped, ran, own, after = run(body())
    assert up.ok and "stopped" in stopped.stdout, (up, stopped)
    assert ran.ok and ran.stdout == "ran\n", ran
    assert own.ok and own.stdout == "own\n", own
    assert after.ok and after.stdout == "after\n", after


def test_a_call_cannot_change_pid_1s_limits_or_priority(bwrap: BwrapBackend) -> None:
    tamper = ("prlimit --pid 1 --fsize=0:0; prlimit --pid 1 --nofile=32:32; renice -n 19 -p 1; "
              "renice -n 19 -u $(id -u); python3 -c 'import os; "
              "os.sched_setaffinity(1, [min(os.sched_getaffinity(0))])'; true")
    probe = "echo nice=$(nice); ulimit -n; ulimit -f; nproc; echo data > f && echo written"

    async def body() -> list[ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            return [await sb.exec(["sh", "-c", probe], timeout_s=10),
                    await sb.exec(["sh", "-c", tamper], timeout_s=10),
                    await sb.exec(["sh", "-c", probe], timeout_s=10)]

    before, tampered, after = run(body())
    assert before.ok and tampered.ok, (before, tampered)
    assert after.ok and after.stdout == before.stdout, (before, tampered, after)
    # The sandbox inherits treadle's priority (a suite run under `nice` is niced too).
    assert f"nice={os.nice(0)}\n" in after.stdout and "written" in after.stdout, after


def test_a_call_whose_clean_up_is_costly_keeps_its_result(bwrap: BwrapBackend) -> None:
    # Emptying /tmp costs the agent CPU time (RLIMIT_CPU): 100k+ hard links must not
    # kill it before it reports the call's status.
    code = ("import os, sys, time\nd = '/tmp/d' + sys.argv[1]\nos.makedirs(d)\n"
            "open(d + '.base', 'w').close()\ni = 0\n"
            "while time.process_time() < 0.85:\n"
            "    for _ in range(1000):\n"
            "        os.link(d + '.base', '%s/%d' % (d, i)); i += 1\n")
    three = "; ".join(f"python3 mk.py {n} &" for n in (1, 2, 3)) + " wait; echo created"

    async def body() -> list[ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            await sb.exec(["python3", "-c", f"open('mk.py', 'w').write({code!r})"], timeout_s=10)
            return [await sb.exec(["sh", "-c", three.replace("&;", "&")], timeout_s=30),
                    await sb.exec(["sh", "-c", "ls -A /tmp; echo next"], timeout_s=10)]

    made, after = run(body())
    assert made.ok and made.stdout == "created\n", made
    assert after.ok and after.stdout == "next\n", after


def test_posix_message_queues_do_not_outlive_their_call(bwrap: BwrapBackend) -> None:
    make = ("import ctypes, os; l = ctypes.CDLL(None, use_errno=True); "
            "fd = l.mq_open(b'/leak', os.O_CREAT | os.O_RDWR, 0o600, None); "
            "print(fd >= 0, l.mq_send(fd, b'secret', 6, 0))")
    read = ("import ctypes, os; l = ctypes.CDLL(None, use_errno=True); "
            "print(l.mq_open(b'/leak', os.O_RDWR, 0, None))")

    async def body() -> list[ExecResult]:
        async with await bwrap.start(SMALL) as sb:
            return [await sb.exec(["python3", "-c", make], timeout_s=10),
                    await sb.exec(["python3", "-c", read], timeout_s=10)]

    made, read_back = run(body())
    assert made.ok and made.stdout == "True 0\n", made
    assert read_back.ok and read_back.stdout == "-1\n", read_back
