"""`treadle bench sandbox`: what a tool call costs on each sandbox backend.

    treadle bench sandbox --json --out benchmarks/sandbox.json

Per backend (`bwrap`: calls served by each sandbox's resident executor;
`bwrap-per-call`: the same backend with `executor="per-call"`, one bwrap launch per
exec, so that one run compares both paths; `local`; and `remote`: the HTTP client
over loopback to a `treadle sandbox-server` process with bwrap behind it):

- `cold_call`: `samples` sequential start + exec(["true"]) + close; p50/p99/mean
  of each one's wall time. What a trajectory pays for a fresh sandbox per call.
- `warm_call`: `samples` sequential exec(["true"]) in one sandbox started (and
  called once) beforehand: one call alone, no contention.
- `python_call`: the same with the python tool's command, `python3 -u -` running
  `pass` from stdin: a python tool call that imports nothing.
- `python_cell`: the same `pass` as a cell of the sandbox's Python session
  (`Sandbox.run_cell`, `PythonTool(session=True)`), where the backend keeps one.
- `pooled`: `concurrency` workers, each holding one sandbox started beforehand,
  run `echo ok` back to back for `duration_s`; tool calls/s (overall, and the
  median of per-second counts after the first completion), latency p50/p99.
- `fresh`: the same, but every call is start + exec + close.

With `--image REF`, one more entry, `bwrap-image`: the resident bwrap backend on
that environment image (treadle.sandbox.images), unpacked into a fresh temporary
image cache, so that its `image.cold_start_s` is the first start + exec(true) +
close including the unpack (`image.unpack_s`); every phase above then measures the
cached image, side by side with `bwrap` on the host's system dirs.

Bounded in time: a phase stops starting calls at its deadline and then waits for
the calls in flight (each bounded by `EXEC_TIMEOUT_S` and the backend's start);
the cold phase also stops after `max(10, 3 * duration_s)` seconds. Client and
server of `remote` share this host's cores, so `remote` shows the cost of the
extra hop and of the server's CPU, not what a dedicated server node sustains.
Numbers are noisy on small shared machines: compare runs on one host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from treadle.errors import SandboxError
from treadle.reports import log, write_report
from treadle.sandbox.base import Limits, Sandbox, SandboxBackend

BACKEND_CHOICES = ("bwrap", "bwrap-per-call", "local", "remote")
IMAGE_BACKEND = "bwrap-image"  # measured in addition when an image is given
EXEC_TIMEOUT_S = 10.0
# Small limits: 64 live sandboxes must fit a small host.
BENCH_LIMITS = Limits(cpu_s=5, memory_mb=256, max_processes=32, max_output_bytes=64 * 1024,
                      wall_timeout_s=EXEC_TIMEOUT_S)
_ECHO = ["echo", "ok"]
_PYTHON = ["python3", "-u", "-"]  # the python tool's command


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def _latency(seconds: Sequence[float]) -> dict[str, float | None]:
    if not seconds:
        return {"p50_ms": None, "p99_ms": None, "mean_ms": None}
    return {"p50_ms": round(percentile(seconds, 50) * 1000, 2),
            "p99_ms": round(percentile(seconds, 99) * 1000, 2),
            "mean_ms": round(statistics.fmean(seconds) * 1000, 2)}


async def _one_call(backend: SandboxBackend, argv: list[str], expect: str) -> bool:
    async with await backend.start(BENCH_LIMITS) as sb:
        result = await sb.exec(argv, timeout_s=EXEC_TIMEOUT_S)
    return result.ok and result.stdout == expect


async def _sequential(call: Callable[[], Awaitable[bool]], samples: int,
                      budget_s: float) -> dict[str, Any]:
    """`call` run back to back, at most `samples` times or `budget_s` seconds: the
    latency of the ones that succeeded, and how many did not."""
    times: list[float] = []
    errors = 0
    deadline = time.monotonic() + budget_s
    for _ in range(samples):
        if time.monotonic() > deadline:
            break
        started = time.perf_counter()
        try:
            ok = await call()
        except SandboxError:
            ok = False
        if ok:
            times.append(time.perf_counter() - started)
        else:
            errors += 1
    return {"samples": len(times), "errors": errors, **_latency(times)}


async def cold_call(backend: SandboxBackend, samples: int, budget_s: float) -> dict[str, Any]:
    """Sequential start + exec(true) + close, at most `samples` or `budget_s` seconds."""
    return await _sequential(lambda: _one_call(backend, ["true"], ""), samples, budget_s)


async def warm_call(backend: SandboxBackend, samples: int, budget_s: float, argv: list[str],
                    stdin: bytes | None) -> dict[str, Any]:
    """Sequential execs of `argv` in one sandbox (its first call not counted)."""
    async with await backend.start(BENCH_LIMITS) as sb:
        await sb.exec(argv, timeout_s=EXEC_TIMEOUT_S, stdin=stdin)  # starts any executor

        async def call() -> bool:
            return (await sb.exec(argv, timeout_s=EXEC_TIMEOUT_S, stdin=stdin)).ok

        return await _sequential(call, samples, budget_s)


async def session_cell(backend: SandboxBackend, samples: int,
                       budget_s: float) -> dict[str, Any] | None:
    """Sequential `pass` cells in one sandbox's Python session; None without one."""
    async with await backend.start(BENCH_LIMITS) as sb:
        if not sb.keeps_python_session:
            return None
        await sb.run_cell(b"pass\n", timeout_s=EXEC_TIMEOUT_S)  # starts the session

        async def call() -> bool:
            return (await sb.run_cell(b"pass\n", timeout_s=EXEC_TIMEOUT_S)).ok

        return await _sequential(call, samples, budget_s)


async def throughput(backend: SandboxBackend, concurrency: int, duration_s: float, *,
                     fresh: bool) -> dict[str, Any]:
    """Tool calls/s of `concurrency` workers for `duration_s` (see the module docstring)."""
    setup_started = time.perf_counter()
    pool: list[Sandbox] = []
    if not fresh:
        pool = list(await asyncio.gather(*(backend.start(BENCH_LIMITS)
                                           for _ in range(concurrency))))
    setup_s = time.perf_counter() - setup_started
    latencies: list[float] = []
    finished: list[float] = []  # monotonic completion times, for per-second rates
    errors = 0
    began = time.monotonic()
    stop_at = began + duration_s

    async def worker(sb: Sandbox | None) -> None:
        nonlocal errors
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                if sb is None:
                    ok = await _one_call(backend, _ECHO, "ok\n")
                else:
                    result = await sb.exec(_ECHO, timeout_s=EXEC_TIMEOUT_S)
                    ok = result.ok and result.stdout == "ok\n"
            except SandboxError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
                finished.append(time.monotonic())
            else:
                errors += 1

    slots: list[Sandbox | None] = [*pool] if pool else [None] * concurrency
    try:
        await asyncio.gather(*(worker(sb) for sb in slots))
    finally:
        await asyncio.gather(*(sb.close() for sb in pool), return_exceptions=True)
    elapsed = time.monotonic() - began
    # Completions per whole second from the first one on: the ramp-up (every worker's
    # first call starting at once) is left out, and the median resists bursts.
    first = finished[0] if finished else stop_at
    per_second = [0] * max(1, int(stop_at - first))
    for stamp in finished:
        if int(stamp - first) < len(per_second):
            per_second[int(stamp - first)] += 1
    return {
        "concurrency": concurrency,
        "calls": len(latencies),
        "errors": errors,
        "elapsed_s": round(elapsed, 3),
        "calls_per_s": round(len(latencies) / elapsed, 1),
        "calls_per_s_median_of_seconds": statistics.median(per_second),
        "pool_setup_s": None if fresh else round(setup_s, 3),
        **_latency(latencies),
    }


@contextlib.contextmanager
def _backend(name: str, concurrency: int, image: str | None = None) -> Iterator[SandboxBackend]:
    """The backend to measure; for `remote`, a loopback server process hosting bwrap;
    for `bwrap-image`, bwrap on `image` with a temporary image cache (removed after)."""
    from treadle.sandbox.registry import get_backend

    if name == IMAGE_BACKEND:
        from treadle.sandbox import _workdir
        from treadle.sandbox.images import ImageCache

        root = tempfile.mkdtemp(prefix="treadle-bench-images-", dir="/tmp")
        try:
            os.chmod(root, 0o711)  # the sandbox uid traverses it to the image
            yield get_backend("bwrap", image=image,
                              image_cache=ImageCache(os.path.join(root, "cache")))
        finally:
            _workdir.remove_workdir(root)
        return
    if name == "bwrap-per-call":
        yield get_backend("bwrap", executor="per-call")
        return
    if name != "remote":
        yield get_backend(name)
        return
    from treadle.sandbox.remote import RemoteBackend

    with _server_process(max_live=2 * concurrency + 4) as (url, token):
        yield RemoteBackend([url], token)


@contextlib.contextmanager
def _server_process(max_live: int) -> Iterator[tuple[str, str]]:
    """`treadle sandbox-server --backend bwrap` on a free 127.0.0.1 port; (url, token).

    A process, not a thread of this one: in one process the client's and the
    server's event loops contend for the GIL, which adds tens of ms to every call.
    Stopped with SIGTERM (it closes its sandboxes); RuntimeError if it does not
    come up within 60 s.
    """
    import treadle

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = secrets.token_urlsafe(24)
    src = str(Path(treadle.__file__).resolve().parents[1])
    env = {**os.environ, "TREADLE_SANDBOX_TOKEN": token,
           "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "treadle.sandbox.cli", "sandbox-server", "--port", str(port),
             "--backend", "bwrap", "--max-live", str(max_live)],
            env=env, stdout=subprocess.DEVNULL, stderr=log_file)
        try:
            deadline = time.monotonic() + 60
            while not _healthy(url):
                if server.poll() is not None or time.monotonic() > deadline:
                    log_file.seek(0)
                    raise RuntimeError(f"sandbox server did not start: {log_file.read()[-500:]}")
                time.sleep(0.1)
            yield url, token
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _healthy(url: str) -> bool:
    import httpx  # the `server` extra, needed only for `remote`

    try:
        return bool(httpx.get(f"{url}/healthz", timeout=2, trust_env=False).status_code == 200)
    except httpx.HTTPError:
        return False


async def _measure(backend: SandboxBackend, samples: int, concurrency: int, duration_s: float,
                   log: Callable[[str], None], name: str) -> dict[str, Any]:
    log(f"sandbox bench: {name}: cold start+exec+close x{samples}")
    cold = await cold_call(backend, samples, max(10.0, 3 * duration_s))
    log(f"sandbox bench: {name}: one call alone (true, then python3 -u -) x{samples}")
    warm = await warm_call(backend, samples, max(10.0, 3 * duration_s), ["true"], None)
    python = await warm_call(backend, samples, max(10.0, 3 * duration_s), _PYTHON, b"pass\n")
    cell = await session_cell(backend, samples, max(10.0, 3 * duration_s))
    log(f"sandbox bench: {name}: pooled echo at concurrency {concurrency} for {duration_s:g}s")
    pooled = await throughput(backend, concurrency, duration_s, fresh=False)
    log(f"sandbox bench: {name}: fresh sandbox per call at concurrency {concurrency}")
    fresh = await throughput(backend, concurrency, duration_s, fresh=True)
    return {"cold_call": cold, "warm_call": warm, "python_call": python,
            **({"python_cell": cell} if cell is not None else {}), "pooled": pooled,
            "fresh": fresh}


async def _image_cold_start(backend: SandboxBackend) -> dict[str, Any]:
    """The first start + exec(true) + close on an image not yet unpacked, and the image."""
    started = time.perf_counter()
    async with await backend.start(BENCH_LIMITS) as sb:
        result = await sb.exec(["true"], timeout_s=EXEC_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    image = getattr(backend, "cached_image", None)
    return {"cold_start_s": round(elapsed, 3), "ok": result.ok,
            "ref": getattr(image, "ref", None), "kind": getattr(image, "kind", None),
            "digest": getattr(image, "digest", None),
            "unpack_s": None if image is None or image.unpacked_s is None
            else round(image.unpacked_s, 3)}


def run_sandbox_bench(backends: Sequence[str], samples: int, concurrency: int,
                      duration_s: float, log: Callable[[str], None],
                      image: str | None = None) -> dict[str, Any]:
    """Measure each backend (see the module docstring); the JSON-ready report.

    A backend that cannot run here is reported as {"error": ...}, not raised.
    ValueError for an unknown backend or non-positive sizes.
    """
    unknown = [b for b in backends if b not in BACKEND_CHOICES]
    if unknown or not backends:
        raise ValueError(f"backends must be some of {', '.join(BACKEND_CHOICES)}, "
                         f"got {list(backends)}")
    if samples < 1 or concurrency < 1 or not duration_s > 0:
        raise ValueError("samples and concurrency must be >= 1 and duration_s > 0")
    began = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "sandbox",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": {"samples": samples, "concurrency": concurrency, "duration_s": duration_s,
                   "limits": {name: getattr(BENCH_LIMITS, name)
                              for name in BENCH_LIMITS.__slots__},
                   "cold_command": ["true"], "call_command": _ECHO,
                   "python_command": [*_PYTHON, "<<< pass"],
                   "remote": "sandbox-server process on 127.0.0.1, bwrap behind it"},
        "backends": {},
    }
    if image is not None:
        report["config"]["image"] = image
    for name in [*backends, *([IMAGE_BACKEND] if image is not None else [])]:
        try:
            with _backend(name, concurrency, image) as backend:
                result: dict[str, Any] = {}
                if name == IMAGE_BACKEND:
                    log(f"sandbox bench: {name}: first start on {image} (unpack included)")
                    result["image"] = asyncio.run(_image_cold_start(backend))
                result.update(asyncio.run(_measure(backend, samples, concurrency, duration_s,
                                                   log, name)))
                isolation = getattr(backend, "isolation", None)
                if isolation is not None:
                    result["isolation"] = isolation
                executor = getattr(backend, "executor", None)
                if executor is not None:
                    result["executor"] = executor
        except (SandboxError, RuntimeError) as e:
            log(f"sandbox bench: {name}: cannot run here: {e}")
            result = {"error": str(e)}
        report["backends"][name] = result
    report["duration_s"] = round(time.monotonic() - began, 1)
    return report


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPUs, memory, kernel, Python, bwrap, cgroups, load."""
    from treadle.sandbox._cgroup import detect_cgroups

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "uid": os.geteuid(),
    }
    with contextlib.suppress(OSError, ValueError):
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        info["memory_gib"] = round(int(meminfo[0].split()[1]) / 2**20, 1)
    bwrap = shutil.which("bwrap")
    if bwrap is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            info["bwrap"] = subprocess.run([bwrap, "--version"], capture_output=True, text=True,
                                           timeout=10, check=False).stdout.strip()
    cgroups = detect_cgroups()
    info["cgroup_v1_controllers"] = sorted(cgroups.controllers) if cgroups is not None else []
    return info


def add_bench_parser(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `bench sandbox` on the `treadle bench` subparsers; handler in `args.func`."""
    p = bench_subparsers.add_parser("sandbox", help="sandbox start latency and tool calls/s")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", default="out/sandbox.json",
                   help="where to write the report (default out/sandbox.json; the committed "
                        "one is benchmarks/sandbox.json)")
    p.add_argument("--backends", default=",".join(BACKEND_CHOICES),
                   help=f"comma-separated, some of {','.join(BACKEND_CHOICES)} "
                        "(remote = loopback server with bwrap behind it)")
    p.add_argument("--image", default=None, metavar="REF",
                   help="also measure bwrap on this environment image (rootfs dir, OCI "
                        "layout, OCI/docker-save tar, SIF file): cold start with the unpack, then "
                        "every phase on the cached image")
    p.add_argument("--samples", type=int, default=100,
                   help="sequential cold calls per backend (default 100)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="concurrent workers in the throughput phases (default 64)")
    p.add_argument("--duration", type=float, default=10.0, metavar="S",
                   help="seconds per throughput phase (default 10)")
    p.set_defaults(func=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    """Handler of `bench sandbox`: writes --out (and prints with --json); 2 for bad input."""
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    try:
        report = run_sandbox_bench(backends, args.samples, args.concurrency, args.duration,
                                   log=log, image=args.image)
    except ValueError as e:
        print(f"treadle bench sandbox: {e}", file=sys.stderr)
        return 2
    write_report(report, args.out, name="sandbox bench", echo=args.json)
    return 0

