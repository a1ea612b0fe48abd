"""`treadle bench live`: the same trace replayed live and simulated, side by side.

    treadle bench live --workload coding --trajectories 256 --engines 8 \\
        --policies slime,verl,treadle --time-scale 0.1 --json --out benchmarks/live.json

For each policy, a fresh runtime drives that policy's scheduler over emulated engine
processes (`treadle engine emulate`, vLLM's HTTP API, timing from the cost model,
`--time-scale` times real) started by the runtime's launcher from the policy's own
initial pool on `--engines` GPUs; every trajectory of the workload is replayed
(`runtime.replay`) concurrently, all arriving at once as one synchronous RL step.
Then `treadle sim` runs the same workload on the same cluster. Live figures are in
modelled seconds (wall seconds / time scale), so live and simulated throughput
compare directly; the report gives each policy's live and simulated throughput and
makespan, and for every pair (treadle over each other policy) the live and the
simulated ratio and how far apart they are.

The control plane is measured in every run (each `decide` with the events before
it, `runtime.driver.ControlStats`; decisions that re-placed the whole batch are
reported apart from the per-turn ones), and in a separate phase where
`--control-trajectories` (default 2,048) trajectories are live at once under the
last policy, for `--control-seconds` of the modelled clock; that phase measures
decisions, not throughput (it stops before the batch ends).

Limits: the emulated engines share this machine's cores with the runtime, so a
loaded machine slows the replay (the emulator catches up on missed steps, so its
rates hold while it keeps up, but HTTP and the runtime add latency the model does
not have); a time scale too small for the machine shows up as live makespans well
above the simulated ones. Migrations move no KV here (each engine re-prefills).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from treadle.clock import ScaledClock
from treadle.core.cost_model import CostModel
from treadle.core.policies import PolicySpec, build_policy, parse_policy
from treadle.core.predictor import Outcome
from treadle.reports import log, write_report
from treadle.runtime.driver import Runtime
from treadle.runtime.launcher import EmulatedProcess, LocalLauncher
from treadle.runtime.replay import ReplayResult, replay
from treadle.sim.runner import MAX_BATCH, layout_label, simulate
from treadle.workloads import Workload

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LiveRun:
    """One policy replayed live."""

    policy: str
    live_makespan_s: float  # modelled seconds from the first arrival to the last finish
    live_tokens_per_s: float  # generated tokens per modelled second
    wall_s: float  # real seconds the replay took
    per_turn_p50_ms: float  # control-plane CPU per turn (plain decisions / turns ended)
    per_turn_p99_ms: float
    per_turn_max_ms: float
    decision_p99_ms: float  # per decision (with its events), re-plans included
    decision_max_ms: float
    plain_decision_p99_ms: float  # decisions that re-placed nothing
    replans: int  # decisions that re-placed the whole batch
    replan_p50_ms: float
    replan_max_ms: float
    decisions: int
    events: int
    max_live: int  # most trajectories alive at once
    preemptions: int  # decided by the scheduler
    migrations: int
    layout: str  # the policy's starting pool
    errors: int  # trajectories that failed (engine errors)


async def live_run(workload: Workload, spec: PolicySpec, cost: CostModel, gpus: int, *,
                   time_scale: float, history: Sequence[Outcome] = (), seed: int = 0,
                   model: str, gpu: str, stop_after_s: float | None = None,
                   log: Log | None = None, log_dir: str | None = None) -> LiveRun:
    """Replay `workload` live under `spec`; `stop_after_s` (modelled) cuts it short."""
    scheduler = build_policy(spec, cost, batch_size=len(workload.trajectories),
                             history=history, seed=seed, max_batch=MAX_BATCH)
    pool = scheduler.initial_pool(gpus)
    clock = ScaledClock(time_scale)
    launcher = LocalLauncher(EmulatedProcess(model, gpu, time_scale=time_scale,
                                             max_num_seqs=MAX_BATCH, seed=seed),
                             log_dir=log_dir)
    runtime = Runtime(scheduler, launcher=launcher, gpus=gpus, clock=clock,
                      engine_wait_s=30.0)  # every call keeps the default request timeout
    await runtime.start()
    try:
        started_wall, started = time.monotonic(), clock.now()
        jobs = [asyncio.ensure_future(replay(t, runtime.turns(t.traj_id, t.group_id), clock))
                for t in workload.trajectories]
        watcher = asyncio.ensure_future(_progress(jobs, runtime, clock, started, log))
        done, pending = await asyncio.wait(
            jobs, timeout=None if stop_after_s is None else clock.real_seconds(stop_after_s))
        for job in pending:
            job.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        watcher.cancel()
        wall = time.monotonic() - started_wall
    finally:
        await runtime.close()
    results = [j.result() for j in done if not j.cancelled() and j.exception() is None]
    errors = sum(1 for j in done if not j.cancelled() and j.exception() is not None)
    makespan = max((r.finished_at for r in results), default=clock.now()) - started
    tokens = sum(r.output_tokens for r in results)
    ctl = runtime.control
    return LiveRun(
        policy=spec.label, live_makespan_s=makespan,
        live_tokens_per_s=tokens / makespan if makespan > 0 else 0.0, wall_s=wall,
        per_turn_p50_ms=ctl.percentile_ms(0.5, "per_turn"),
        per_turn_p99_ms=ctl.percentile_ms(0.99, "per_turn"),
        per_turn_max_ms=ctl.percentile_ms(1.0, "per_turn"),
        decision_p99_ms=ctl.percentile_ms(0.99), decision_max_ms=ctl.percentile_ms(1.0),
        plain_decision_p99_ms=ctl.percentile_ms(0.99, "plain"), replans=len(ctl.replans),
        replan_p50_ms=ctl.percentile_ms(0.5, "replans"),
        replan_max_ms=ctl.percentile_ms(1.0, "replans"), decisions=ctl.decisions,
        events=ctl.events,
        max_live=ctl.max_live, preemptions=scheduler.preemptions,
        migrations=runtime.scheduler.migrations, layout=layout_label(pool), errors=errors)


async def _progress(jobs: Sequence[asyncio.Future[ReplayResult]], runtime: Runtime,
                    clock: ScaledClock, started: float, log: Log | None) -> None:
    if log is None:
        return
    while True:
        await asyncio.sleep(10.0)
        finished = sum(j.done() for j in jobs)
        log(f"  {finished}/{len(jobs)} trajectories done at t={clock.now() - started:.0f}s "
            f"(modelled), {runtime.live_trajectories} live, decision p99 "
            f"{runtime.control.percentile_ms(0.99, 'per_turn'):.3f} ms per turn")


def run_live_bench(workload: Workload, policies: Sequence[str], *, model: str, gpu: str,
                   gpus: int, time_scale: float, history: Sequence[Outcome], seed: int,
                   control: Workload | None, control_seconds: float,
                   control_history: Sequence[Outcome] = (), log: Log) -> dict[str, Any]:
    """The report (see the module docstring); ValueError for bad policies."""
    cost = CostModel.named(model, gpu)
    specs = [parse_policy(p) for p in policies]
    rows: list[dict[str, Any]] = []
    for spec in specs:
        log(f"live: {spec.label} on {workload.name} ({len(workload.trajectories)} "
            f"trajectories, {gpus} GPUs, time scale {time_scale})")
        live = asyncio.run(live_run(workload, spec, cost, gpus, time_scale=time_scale,
                                    history=history, seed=seed, model=model, gpu=gpu,
                                    log=log))
        sim, _ = simulate(workload, spec, cost, gpus, history=history, seed=seed)
        log(f"  live {live.live_tokens_per_s:,.0f} tok/s, makespan {live.live_makespan_s:.1f}s"
            f" | sim {sim.tokens_per_s:,.0f} tok/s, makespan {sim.makespan_s:.1f}s | "
            f"control p99 {live.per_turn_p99_ms:.3f} ms per turn ({live.wall_s:.0f}s wall)")
        rows.append({**asdict(live), "sim_tokens_per_s": sim.tokens_per_s,
                     "sim_makespan_s": sim.makespan_s,
                     "live_over_sim_makespan": live.live_makespan_s / sim.makespan_s})
    report: dict[str, Any] = {
        "engines": gpus, "workload": workload.name, "trajectories": len(workload.trajectories),
        "model": model, "gpu": gpu, "time_scale": time_scale, "seed": seed,
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
        "results": rows, "ratios": ratios(rows),
    }
    if control is not None:
        spec = specs[-1]
        log(f"control plane: {spec.label} with {len(control.trajectories)} trajectories live "
            f"for {control_seconds:.0f}s (modelled)")
        run = asyncio.run(live_run(control, spec, cost, gpus, time_scale=time_scale,
                                   history=control_history, seed=seed, model=model, gpu=gpu,
                                   stop_after_s=control_seconds, log=log))
        fields = asdict(run)
        report["control_plane"] = {
            "policy": spec.label, "workload": control.name,
            "trajectories": len(control.trajectories), "modelled_seconds": control_seconds,
            **{k: fields[k] for k in fields if k.startswith((
                "per_turn", "decision", "plain", "replan", "max_live", "events", "wall"))}}
        log(f"  {run.decisions} decisions with up to {run.max_live} live: per turn p99 "
            f"{run.per_turn_p99_ms:.3f} ms (max {run.per_turn_max_ms:.3f}); decision p99 "
            f"{run.plain_decision_p99_ms:.3f} ms; {run.replans} re-plans, p50 "
            f"{run.replan_p50_ms:.1f} ms, max {run.replan_max_ms:.1f} ms")
    return report


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """treadle over every other policy: live ratio, simulated ratio, their gap."""
    by = {r["policy"]: r for r in rows}
    top = by.get("treadle")
    out: list[dict[str, Any]] = []
    if top is None:
        return out
    for name, row in by.items():
        if name == "treadle":
            continue
        live = top["live_tokens_per_s"] / row["live_tokens_per_s"]
        sim = top["sim_tokens_per_s"] / row["sim_tokens_per_s"]
        out.append({"pair": f"treadle/{name}", "live": live, "sim": sim,
                    "gap": live / sim - 1.0, "within_15pct": abs(live / sim - 1.0) <= 0.15})
    return out


def add_live_bench_parser(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `bench live` on the `treadle bench` subparsers; handler in `args.func`."""
    p = bench_subparsers.add_parser("live", help="replay a trace live on emulated engines "
                                                 "and compare with the simulator")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default="coding",
                     help="coding, search, math, swe, or a shape nothing was tuned on: "
                          "pareto, bimodal, flat, short")
    src.add_argument("--trace", metavar="TRACE.jsonl", help="a trace file instead")
    p.add_argument("--trajectories", type=int, default=256,
                   help="batch size of a generated workload (a multiple of 16; "
                        "default 256)")
    p.add_argument("--engines", type=int, default=8,
                   help="GPUs of the cluster; each policy lays out its engines on them "
                        "(paper-configured baselines: one TP-1 engine per GPU)")
    p.add_argument("--policies", default="slime,verl,treadle")
    p.add_argument("--time-scale", type=float, default=0.1, metavar="X",
                   help="real seconds per modelled second (0.1 = 10x faster than real)")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--control-trajectories", type=int, default=2048,
                   help="trajectories live at once in the control-plane phase (0: skip)")
    p.add_argument("--control-seconds", type=float, default=600.0,
                   help="modelled seconds the control-plane phase runs")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", default="out/live.json",
                   help="where to write the report (default out/live.json; the committed "
                        "one is benchmarks/live.json)")
    p.set_defaults(func=run_live_bench_command)


def run_live_bench_command(args: argparse.Namespace) -> int:
    """Handler of `bench live`; 2 with one line on stderr for bad input."""
    from treadle.errors import UsageError
    from treadle.sim.runner import history_for
    from treadle.workloads.load import GENERATED, load_workload

    try:
        if not args.time_scale > 0:
            raise UsageError(f"--time-scale must be > 0, got {args.time_scale}")
        if args.engines < 1:
            raise UsageError(f"--engines must be >= 1, got {args.engines}")
        cost = CostModel.named(args.model, args.gpu)
        name = args.trace or args.workload
        workload = load_workload(name, args.trajectories, args.seed, cost.model.max_context)
        builtin = args.trace is None and args.workload in GENERATED
        history = (history_for(args.workload, len(workload.trajectories), args.seed,
                               max_context=cost.model.max_context) if builtin else [])
        control = control_history = None
        if args.control_trajectories > 0:
            # search has the most turns per generated token: the densest decisions.
            control_name = "search"
            control = load_workload(control_name, args.control_trajectories, args.seed + 100,
                                    cost.model.max_context)
            control_history = history_for(control_name, args.control_trajectories,
                                          args.seed + 100, max_context=cost.model.max_context)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        report = run_live_bench(workload, policies, model=args.model, gpu=args.gpu,
                                gpus=args.engines, time_scale=args.time_scale,
                                history=history, seed=args.seed, control=control,
                                control_seconds=args.control_seconds,
                                control_history=control_history or [], log=log)
    except (UsageError, KeyError, ValueError) as e:
        print(f"treadle bench live: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    write_report(report, args.out, name="live bench", echo=args.json)
    return 0

