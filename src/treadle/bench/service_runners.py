"""`treadle bench service --runners 0,1,2,4`: the data plane in runner actors, side by side.

    treadle bench service --runners 0,1,2,4 --trajectories 512 --jobs 2 --workload search \\
        --engines 8 --time-scale 0.02 --json --out benchmarks/service-runners.json

One arm per count, one after the other (each has the machine to itself): a service
(`treadle serve --ray --emulate N`, its own local Ray cluster, the engines on it)
whose workload replays run in that many runner actors (`--runners K`; 0: in the
service's process, as without Ray). Each arm runs the same `--jobs` jobs as `bench
service` (`bench.service.run_job`: the job's stream followed, the routes probed).

Per job: turns/s delivered (the workload's turns over the job's wall time); the
service process's CPU a turn (its scheduler, store and HTTP: with runners, no agent
loop or engine call; with `--stores process` the store's SQLite in a process of its
own, counted apart), and its scheduler's part; the runner actors' CPU a turn (the
data plane moved out); the engines' and Ray's own processes' CPU; live/simulated
makespan (near 1: the service kept up with its engines). A small time scale makes
the engines fast, so that the service or its runners are the limit.

Limits: Linux only (/proc); everything on one machine, so runners beyond its cores
share them (and the engines'); the processes are told apart by their command lines
(a Ray actor's process is titled ``ray::RunnerWorker``).
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from treadle.bench.service import (
    _TOKEN,
    Log,
    _counters,
    _cpu_s,
    _machine_ticks,
    _memory_mb,
    _tree_cpu_s,
    run_job,
    serving,
)
from treadle.sandbox.inside.reaper import descendants


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _processes(root: int) -> dict[str, list[int]]:
    """The service's descendants by part: runner actors, engines, its store's own
    process, the rest (Ray's)."""
    parts: dict[str, list[int]] = {"runners": [], "engines": [], "store": [], "ray": []}
    for pid in descendants(root):
        line = _cmdline(pid)
        if line.startswith("ray::RunnerWorker"):
            parts["runners"].append(pid)
        elif " -m treadle.store.child " in line:
            parts["store"].append(pid)
        elif " engine emulate " in line:
            parts["engines"].append(pid)
        else:
            parts["ray"].append(pid)
    return parts


def run_runners_bench(*, runners: tuple[int, ...], stores: tuple[str | None, ...],
                      trajectories: int, jobs: int,
                      workload: str, policy: str, engines: int, time_scale: float, model: str,
                      gpu: str, seed: int, status_interval_s: float, log: Log) -> dict[str, Any]:
    """The report (module docstring): `setup` and one `arms` entry per runner count
    and store (`stores`: "thread", "process", or None for serve's default; the arm is
    named by its count alone then)."""
    from treadle.core.cost_model import CostModel
    from treadle.core.policies import parse_policy
    from treadle.sim.runner import simulate
    from treadle.workloads.load import generate_named

    cost = CostModel.named(model, gpu)
    batches = [generate_named(workload, trajectories, seed=seed + k,
                              max_context=cost.model.max_context) for k in range(jobs)]
    sims = [simulate(b, parse_policy(policy), cost, engines)[0].makespan_s for b in batches]
    arms: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="treadle-bench-runners-") as tmp:
        for count, store in [(c, s) for c in runners for s in stores]:
            arm = str(count) if store is None else f"{count}/{store}"
            name = arm.replace("/", "-")
            serve = ["--db", str(Path(tmp) / f"runners-{name}.db"), "--ray", "--emulate",
                     str(engines), "--time-scale", repr(time_scale), "--policy", policy,
                     "--model", model, "--gpu", gpu]
            if count:
                serve += ["--runners", str(count), "--runner-cpus", "0"]
            if store is not None:
                serve.append("--store-process" if store == "process" else "--no-store-process")
            with serving(serve, Path(tmp) / f"serve-{name}.log") as (url, proc):
                parts = _processes(proc.pid)
                log(f"runners {arm}: service pid {proc.pid} at {url}; "
                    f"{len(parts['runners'])} runner, {len(parts['engines'])} engine, "
                    f"{len(parts['store'])} store and {len(parts['ray'])} other processes")
                rows = asyncio.run(_jobs(url, proc.pid, batches, sims, workload=workload,
                                         trajectories=trajectories, seed=seed,
                                         time_scale=time_scale,
                                         status_interval_s=status_interval_s, log=log))
            arms[arm] = {"jobs": rows, "summary": _summary(rows)}
    return {"setup": {"runners": list(runners), "stores": list(stores),
                      "trajectories_per_job": trajectories,
                      "jobs": jobs, "workload": workload, "policy": policy, "gpus": engines,
                      "time_scale": time_scale, "model": model, "gpu": gpu, "seed": seed,
                      "cores": os.cpu_count(), "python": platform.python_version()},
            "arms": arms}


async def _jobs(url: str, pid: int, batches: list[Any], sims: list[float], *, workload: str,
                trajectories: int, seed: int, time_scale: float, status_interval_s: float,
                log: Log) -> list[dict[str, Any]]:
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 headers={"authorization": f"Bearer {_TOKEN}"},
                                 limits=httpx.Limits(max_connections=64)) as client:
        for k, (batch, sim) in enumerate(zip(batches, sims, strict=True)):
            job = f"bench-{k}"
            parts = _processes(pid)  # the runners and engines up now (Ray starts some late)
            counters = await _counters(client)
            turns = sum(len(t.turns) for t in batch.trajectories)
            started, service0 = time.perf_counter(), _cpu_s(pid)
            cpu0 = {name: _tree_cpu_s(pids) for name, pids in parts.items()}
            ticks = _machine_ticks()
            row = await run_job(client, job, {"tasks": {"workload": workload,
                                                        "trajectories": trajectories,
                                                        "seed": seed + k}},
                                trajectories, previous=None,
                                status_interval_s=status_interval_s)
            wall = time.perf_counter() - started
            after = await _counters(client)
            busy, total = _machine_ticks()
            cpu = {name: _tree_cpu_s(pids) - cpu0[name] for name, pids in parts.items()}
            service = _cpu_s(pid) - service0
            row.update({
                "job": job, "turns": turns, "turns_per_s": turns / row["wall_s"],
                "live_over_sim": row["wall_s"] / time_scale / sim,
                "service_cpu_ms_per_turn": 1000.0 * service / turns,
                "service_cpu_pct_of_core": 100.0 * service / wall,
                "scheduler_cpu_ms_per_turn": 1000.0 * (after["scheduler_cpu_s"]
                                                       - counters["scheduler_cpu_s"]) / turns,
                "runners_cpu_ms_per_turn": 1000.0 * cpu["runners"] / turns,
                "runners_cpu_pct_of_core": 100.0 * cpu["runners"] / wall,
                # The store's own process (none: the store is in the service's).
                "store_cpu_ms_per_turn": 1000.0 * cpu["store"] / turns,
                "engines_cpu_pct_of_core": 100.0 * cpu["engines"] / wall,
                "ray_cpu_pct_of_core": 100.0 * cpu["ray"] / wall,
                "machine_busy_pct": 100.0 * (busy - ticks[0]) / max(1, total - ticks[1]),
                "service_rss_mb_after": _memory_mb(pid, "VmRSS")})
            log(f"  {job}: {row['delivered']}/{trajectories} in {row['wall_s']:.1f}s, "
                f"{row['turns_per_s']:.0f} turns/s (live/sim {row['live_over_sim']:.2f}); "
                f"service {row['service_cpu_ms_per_turn']:.2f} ms a turn (scheduler "
                f"{row['scheduler_cpu_ms_per_turn']:.2f}), store process "
                f"{row['store_cpu_ms_per_turn']:.2f}, runners "
                f"{row['runners_cpu_ms_per_turn']:.2f} ms a turn; machine "
                f"{row['machine_busy_pct']:.0f}% busy")
            rows.append(row)
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("turns_per_s", "live_over_sim", "service_cpu_ms_per_turn",
            "service_cpu_pct_of_core", "scheduler_cpu_ms_per_turn", "runners_cpu_ms_per_turn",
            "runners_cpu_pct_of_core", "store_cpu_ms_per_turn", "engines_cpu_pct_of_core",
            "ray_cpu_pct_of_core", "machine_busy_pct")
    return {f"{k}_median": statistics.median(r[k] for r in rows) for k in keys}
