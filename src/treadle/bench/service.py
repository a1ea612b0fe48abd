"""`treadle bench service`: the rollout service under thousands of concurrent
trajectories, measured from a client over HTTP.

    treadle bench service --trajectories 2000 --jobs 3 --workload search --engines 8 \\
        --time-scale 0.1 --json --out benchmarks/service.json

`--engine-http httpx,wire` measures the engine clients' HTTP stacks side by side: a
service per stack (`TREADLE_ENGINE_HTTP`), their jobs alternating, one report each.

The service runs as its own process (`treadle serve --emulate N --time-scale X`, a
fresh SQLite file, a token), so its CPU and memory are its own; the emulated
engines are its children, counted apart. `--jobs` jobs of `--trajectories`
replayed workload trajectories run back to back (job k uses seed + k), all of a
job's trajectories submitted at once (one synchronous RL step). While each runs,
this process, as the service's client:

- follows the job's NDJSON stream (`follow=true`) to its end: the job's wall time
  and trajectories/s;
- polls `GET /v1/jobs/{id}` every `--status-interval` seconds (latency);
- every second submits a 16-trajectory job that waits for a policy version no
  update reaches (planned and stored, never run) and cancels it (latency of both);
- from the second job on, re-reads the whole stream of the previous (finished) job
  every few seconds (time to first byte, time to the last line).

Per job: the service's CPU (user + system seconds from /proc, and as % of one
core over the job's wall time) and the part of it its scheduler took (the
decisions' histogram in /metrics), the engines' CPU the same way, this client's CPU,
how busy the whole machine was, the service's resident memory after the job, and
the simulator's makespan for the same workload, policy and GPUs beside the live
one (modelled seconds: wall / time scale); a live/simulated ratio near 1 says the
service kept up with its engines. The service's peak RSS (VmHWM) closes the
report, and the same stream re-reads with the service idle.

Limits: Linux only (/proc). Client, service and engines share the machine; a busy
machine shows up as `machine_busy_pct` near 100 and latencies that include the
client's own waiting. Trajectories/s is set by the emulated engines' modelled
speed and the time scale; what the service adds is the live/simulated ratio, its
CPU per trajectory and its latencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from treadle.runtime.launcher import free_port, stop_process_group
from treadle.sandbox.inside.reaper import descendants

Log = Callable[[str], None]
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_TOKEN = "bench-token"
_NEVER = 1 << 40  # a policy version no update reaches: the probe jobs stay queued


@dataclass(slots=True)
class Latencies:
    """Request latencies of one kind, in seconds."""

    samples: list[float] = field(default_factory=list)
    failures: int = 0  # requests answered with an unexpected status or not at all

    def summary(self) -> dict[str, float | int]:
        s = sorted(self.samples)
        if not s:
            return {"n": 0, "failures": self.failures}
        def ms(q: float) -> float:
            return round(1000.0 * s[min(len(s) - 1, int(q * len(s)))], 2)
        return {"n": len(s), "failures": self.failures, "p50_ms": ms(0.5), "p99_ms": ms(0.99),
                "max_ms": ms(1.0)}


# -- /proc ---------------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()  # fields from the 3rd (state) on


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process (its threads included)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / _TICK


def _tree_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += _cpu_s(pid)
    return total


def _memory_mb(pid: int, key: str) -> float:
    """VmRSS (now) or VmHWM (peak) of the process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


# -- the service process -------------------------------------------------------------------


@contextlib.contextmanager
def serving(args: list[str], log_path: Path, env: dict[str, str] | None = None,
            ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`treadle serve` with `args` (and `env` added to this process's environment) on a
    free loopback port until the block exits."""
    port = free_port()
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "treadle", "serve", "--port", str(port), "--token", _TOKEN,
             "--sandbox", "none", "--log-level", "warning", *args],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the service did not start: {log_path.read_text()[-800:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1).json()["engines"] > 0:
                    break
            time.sleep(0.2)
        yield url, proc
    finally:
        stop_process_group(proc)


# -- one job under load --------------------------------------------------------------------


@dataclass(slots=True)
class _Probes:
    status: Latencies = field(default_factory=Latencies)
    submit: Latencies = field(default_factory=Latencies)
    cancel: Latencies = field(default_factory=Latencies)
    stream_first_byte: Latencies = field(default_factory=Latencies)
    stream_full: Latencies = field(default_factory=Latencies)


async def _timed(into: Latencies, request: Any, ok: int = 200) -> httpx.Response | None:
    started = time.perf_counter()
    try:
        response: httpx.Response = await request
    except httpx.HTTPError:
        into.failures += 1
        return None
    if response.status_code != ok:
        into.failures += 1
        return None
    into.samples.append(time.perf_counter() - started)
    return response


async def _every(seconds: float, probe: Callable[[], Any]) -> None:
    while True:
        started = time.perf_counter()
        await probe()
        await asyncio.sleep(max(0.0, seconds - (time.perf_counter() - started)))


async def reread(client: httpx.AsyncClient, job: str, probes: _Probes, lines: int) -> None:
    """Read a finished job's whole stream; time to the first byte and to the end."""
    started = time.perf_counter()
    first: float | None = None
    got = 0
    try:
        async with client.stream("GET", f"/v1/jobs/{job}/trajectories") as r:
            async for chunk in r.aiter_bytes():
                first = first if first is not None else time.perf_counter() - started
                got += chunk.count(b"\n")
    except httpx.HTTPError:
        probes.stream_full.failures += 1
        return
    if got != lines or first is None:
        probes.stream_full.failures += 1
        return
    probes.stream_first_byte.samples.append(first)
    probes.stream_full.samples.append(time.perf_counter() - started)


@contextlib.asynccontextmanager
async def _background(*coros: Any) -> AsyncIterator[None]:
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_job(client: httpx.AsyncClient, job: str, body: dict[str, Any], n: int, *,
                  previous: str | None, status_interval_s: float) -> dict[str, Any]:
    """Submit `body` as `job`, follow its stream to the end with the probes running."""
    probes = _Probes()
    counter = iter(range(1 << 30))

    async def probe_submit() -> None:
        k = next(counter)
        small = {"tasks": {"workload": "search", "trajectories": 16, "seed": k},
                 "min_policy_version": _NEVER, "job_id": f"{job}-probe-{k}"}
        if await _timed(probes.submit, client.post("/v1/jobs", json=small), 201):
            await _timed(probes.cancel, client.post(f"/v1/jobs/{job}-probe-{k}/cancel"))

    started = time.perf_counter()
    created = await _timed(Latencies(), client.post("/v1/jobs", json={**body, "job_id": job}),
                           201)
    if created is None:
        raise RuntimeError(f"the service refused job {job}")
    submit_s = time.perf_counter() - started
    background = [_every(status_interval_s,
                         lambda: _timed(probes.status, client.get(f"/v1/jobs/{job}"))),
                  _every(1.0, probe_submit)]
    if previous is not None:
        background.append(_every(3.0, lambda: reread(client, previous, probes, n)))
    lines = 0
    statuses: dict[str, int] = {}
    async with _background(*background):
        async with client.stream("GET", f"/v1/jobs/{job}/trajectories",
                                 params={"follow": "true"}, timeout=None) as stream:
            async for line in stream.aiter_lines():
                if line:
                    lines += 1
                    status = json.loads(line)["trajectory"]["status"]
                    statuses[status] = statuses.get(status, 0) + 1
        wall = time.perf_counter() - started
    return {"wall_s": wall, "submit_s": submit_s, "delivered": lines, "statuses": statuses,
            "status_route": probes.status.summary(), "submit_route": probes.submit.summary(),
            "cancel_route": probes.cancel.summary(),
            "stream_first_byte": probes.stream_first_byte.summary(),
            "stream_full": probes.stream_full.summary()}


_COUNTERS = {"treadle_scheduler_decision_seconds_sum": "scheduler_cpu_s",
             "treadle_journal_flush_seconds_sum": "journal_flush_s",
             "treadle_journal_turns_total": "journal_turns"}


async def _counters(client: httpx.AsyncClient) -> dict[str, float]:
    """So far: the scheduler's CPU seconds (its decisions' histogram in /metrics), the
    turn journal's seconds of writes in the store and its turns written."""
    found = dict.fromkeys(_COUNTERS.values(), 0.0)
    for line in (await client.get("/metrics")).text.splitlines():
        name, _, value = line.partition(" ")
        if name in _COUNTERS:
            found[_COUNTERS[name]] = float(value)
    return found


# -- the report ----------------------------------------------------------------------------


def _job_row(row: dict[str, Any], before: tuple[Any, ...], *, pid: int, engine_pids: list[int],
             counted: dict[str, float], sim_makespan_s: float, turns: int, trajectories: int,
             time_scale: float) -> dict[str, Any]:
    """`row` (from `run_job`) with the CPU, memory and simulator figures of the job."""
    wall = time.perf_counter() - before[0]
    busy, total = _machine_ticks()
    service_cpu = _cpu_s(pid) - before[1]
    engines_cpu = _tree_cpu_s(engine_pids) - before[2]
    row.update({
        "trajectories_per_s": trajectories / row["wall_s"],
        "live_makespan_s": row["wall_s"] / time_scale,
        "sim_makespan_s": sim_makespan_s,
        "live_over_sim": row["wall_s"] / time_scale / sim_makespan_s,
        "turns": turns,
        "service_cpu_s": service_cpu,
        "service_cpu_pct_of_core": 100.0 * service_cpu / wall,
        "service_cpu_ms_per_turn": 1000.0 * service_cpu / turns,
        "scheduler_cpu_s": counted["scheduler_cpu_s"],
        # The turn journal's writes: the store's SQLite time (off the trajectories' path).
        "journal_turns": int(counted["journal_turns"]),
        "journal_ms_per_turn": 1000.0 * counted["journal_flush_s"]
        / max(1.0, counted["journal_turns"]),
        "engines_cpu_s": engines_cpu,
        "engines_cpu_pct_of_core": 100.0 * engines_cpu / wall,
        "client_cpu_s": time.process_time() - before[3],
        "machine_busy_pct": 100.0 * (busy - before[4][0]) / max(1, total - before[4][1]),
        "service_rss_mb_after": _memory_mb(pid, "VmRSS")})
    return row


@dataclass(slots=True)
class _Arm:
    """One service under test: its engine HTTP stack, process and results."""

    engine_http: str
    url: str
    pid: int
    engine_pids: list[int]
    rss_start: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    idle: _Probes = field(default_factory=_Probes)
    peak: float = 0.0

    def report(self) -> dict[str, Any]:
        rows = self.rows
        return {
            "jobs": rows,
            "summary": {
                "trajectories_per_s_median": statistics.median(r["trajectories_per_s"]
                                                               for r in rows),
                "live_over_sim_median": statistics.median(r["live_over_sim"] for r in rows),
                "service_cpu_pct_of_core_median": statistics.median(
                    r["service_cpu_pct_of_core"] for r in rows),
                "service_cpu_ms_per_turn_median": statistics.median(
                    r["service_cpu_ms_per_turn"] for r in rows),
                "journal_ms_per_turn_median": statistics.median(
                    r["journal_ms_per_turn"] for r in rows),
                "status_p99_ms_median": statistics.median(
                    r["status_route"].get("p99_ms", 0.0) for r in rows),
                "submit_p99_ms_median": statistics.median(
                    r["submit_route"].get("p99_ms", 0.0) for r in rows),
                "engines_cpu_pct_of_core_median": statistics.median(
                    r["engines_cpu_pct_of_core"] for r in rows),
                "service_rss_mb_at_start": self.rss_start,
                "service_rss_mb_after_each_job": [r["service_rss_mb_after"] for r in rows],
                "service_peak_rss_mb": self.peak},
            "idle_stream_reread": {"first_byte": self.idle.stream_first_byte.summary(),
                                   "full": self.idle.stream_full.summary()},
        }


def run_service_bench(*, trajectories: int, jobs: int, workload: str, policy: str,
                      engines: int, time_scale: float, model: str, gpu: str, seed: int,
                      status_interval_s: float, log: Log,
                      engine_http: tuple[str, ...] = ("wire",)) -> dict[str, Any]:
    """The report (see the module docstring).

    `engine_http` names the engine clients' HTTP stack of each service under test
    (`TREADLE_ENGINE_HTTP`: "wire", or "httpx" for the stack before it). With more
    than one, a service per stack runs at once, idle but for its own jobs, which
    alternate (job k of each arm before job k + 1 of any), so that the arms share
    the machine's state; the report then has an `arms` object, one report each.
    """
    from treadle.core.cost_model import CostModel
    from treadle.core.policies import parse_policy
    from treadle.sim.runner import simulate
    from treadle.workloads.load import generate_named

    cost = CostModel.named(model, gpu)
    spec = parse_policy(policy)
    arms: list[_Arm] = []
    with tempfile.TemporaryDirectory(prefix="treadle-bench-service-") as tmp, \
            contextlib.ExitStack() as stack:
        for name in engine_http:
            serve = ["--db", str(Path(tmp) / f"bench-{name}.db"), "--emulate", str(engines),
                     "--time-scale", repr(time_scale), "--policy", policy, "--model", model,
                     "--gpu", gpu]
            url, proc = stack.enter_context(serving(serve, Path(tmp) / f"serve-{name}.log",
                                                    {"TREADLE_ENGINE_HTTP": name}))
            arm = _Arm(name, url, proc.pid, descendants(proc.pid),
                       _memory_mb(proc.pid, "VmRSS"))
            arms.append(arm)
            log(f"service ({name}) pid {proc.pid} up at {url} with {len(arm.engine_pids)} "
                f"engine processes; RSS {arm.rss_start:.0f} MiB")

        async def main() -> None:
            async with contextlib.AsyncExitStack() as clients:
                cs = [await clients.enter_async_context(httpx.AsyncClient(
                    base_url=arm.url, timeout=120,
                    headers={"authorization": f"Bearer {_TOKEN}"},
                    limits=httpx.Limits(max_connections=64))) for arm in arms]
                for k in range(jobs):
                    job = f"bench-{k}"
                    body = {"tasks": {"workload": workload, "trajectories": trajectories,
                                      "seed": seed + k}}
                    batch = generate_named(workload, trajectories, seed=seed + k,
                                           max_context=cost.model.max_context)
                    sim, _ = simulate(batch, spec, cost, engines)
                    turns = sum(len(t.turns) for t in batch.trajectories)
                    for arm, c in zip(arms, cs, strict=True):
                        counters = await _counters(c)
                        before = (time.perf_counter(), _cpu_s(arm.pid),
                                  _tree_cpu_s(arm.engine_pids), time.process_time(),
                                  _machine_ticks())
                        row = await run_job(c, job, body, trajectories,
                                            previous=f"bench-{k - 1}" if k else None,
                                            status_interval_s=status_interval_s)
                        after = await _counters(c)
                        row = _job_row(row, before, pid=arm.pid, engine_pids=arm.engine_pids,
                                       counted={k: v - counters[k] for k, v in after.items()},
                                       sim_makespan_s=sim.makespan_s, turns=turns,
                                       trajectories=trajectories, time_scale=time_scale)
                        row = {"job": job, "engine_http": arm.engine_http, **row}
                        log(f"  {job} ({arm.engine_http}): {row['delivered']}/{trajectories} "
                            f"in {row['wall_s']:.1f}s (live/sim {row['live_over_sim']:.2f});"
                            f" service CPU {row['service_cpu_ms_per_turn']:.2f} ms a turn, "
                            f"{row['service_cpu_pct_of_core']:.0f}% of a core, engines "
                            f"{row['engines_cpu_pct_of_core']:.0f}%, machine "
                            f"{row['machine_busy_pct']:.0f}% busy; status p99 "
                            f"{row['status_route'].get('p99_ms')} ms; RSS "
                            f"{row['service_rss_mb_after']:.0f} MiB")
                        arm.rows.append(row)
                for arm, c in zip(arms, cs, strict=True):
                    for _ in range(5):
                        await reread(c, f"bench-{jobs - 1}", arm.idle, trajectories)

        asyncio.run(main())
        for arm in arms:
            arm.peak = _memory_mb(arm.pid, "VmHWM")
    setup = {"trajectories_per_job": trajectories, "jobs": jobs, "workload": workload,
             "policy": policy, "gpus": engines, "engine_processes": len(arms[0].engine_pids),
             "time_scale": time_scale, "model": model, "gpu": gpu, "seed": seed,
             "status_interval_s": status_interval_s, "submit_probe_interval_s": 1.0,
             "engine_http": list(engine_http), "cores": os.cpu_count(),
             "python": platform.python_version()}
    if len(arms) == 1:
        return {"setup": setup, **arms[0].report()}
    return {"setup": setup, "arms": {arm.engine_http: arm.report() for arm in arms}}
