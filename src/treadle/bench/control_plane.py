"""`treadle bench control-plane`: what the one scheduler instance costs at cluster scale.

    treadle bench control-plane --engines 1024 --trajectories 100000 --json

The control plane is the pure scheduler (`core/`): one instance in the service, fed
every event of every trajectory and asked for decisions after each instant's events
(`Scheduler.on_event`, `Scheduler.decide`, as `runtime.control` drives it live).
This benchmark runs the real policy over the simulator's engines (`sim.cluster`: the
cost model's timings, no I/O), so that a 1,024-engine cluster and 100,000
trajectories fit one process, and times every call the driver makes:

- `decision_*_ms`: one instant's work, its events taken in and its decisions made
  (what a live turn waits for after the turn before it ends);
- `replan_*_ms`: the instants whose `decide` re-placed the whole batch
  (`Scheduler.replans` went up: the costly decision of the progressive policies);
  `replan_decide_max_ms`: the costliest such `decide` alone, without its
  instant's events (at the batch's arrival, taking in every arrival);
- `scheduler_cpu_per_turn_ms`: all of the scheduler's time over the turns it
  scheduled: the CPU a turn costs the control plane, so `1000 / that` is the turns a
  second one scheduler serves on one core.

Times are the calling thread's CPU time (`time.thread_time_ns`), not wall time: on
a loaded machine a call preempted by another process would otherwise count the
other's time; the wall time of the whole run is reported beside. The simulated
engines and the workload generation are not counted.

Python's cyclic garbage collector runs inside whichever call allocates past its
threshold, and a full collection walks every tracked object of the process (the
simulator's and the workload's too): `replan_max_gc_ms` is the collector's share of
the costliest re-plan instant and `scheduler_gc_s` its share of all the scheduler's
time, so a reader can tell the policy's own work from the collector's.

Limits: the simulator's engines answer at once, so queues are as deep as the
cost model makes them, not as an HTTP runtime would; the treadle policy's starting
pool is forced (`--tp` × `--engines`): choosing it by simulation is a one-off cost
(`layout_choice_s` in `bench sim`) this benchmark leaves out.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treadle.core.cost_model import CostModel
from treadle.core.events import Decision, Event, TurnFinished
from treadle.core.policies import build_policy, parse_policy
from treadle.core.scheduler import Scheduler
from treadle.sim.cluster import Cluster
from treadle.sim.runner import MAX_BATCH, history_for
from treadle.workloads.load import GENERATED, generate_named

GOAL_DECISION_P99_MS = 1.0  # a turn's decision
GOAL_REPLAN_MAX_MS = 100.0  # a whole re-plan


class TimedScheduler(Scheduler):
    """A test double of the driver's view: `inner` with every call timed in thread
    CPU nanoseconds. One instant's `on_event` calls are added to the `decide` that
    closes it."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.name = inner.name
        self.decisions_ns: list[int] = []  # per decide: its instant's events + itself
        self.replans_ns: list[int] = []  # the decides during which a re-plan ran
        self.replan_decides_ns: list[int] = []  # the same, without their instant's events
        self.turns = 0  # turns finished (each one scheduled once at least)
        self._pending_ns = 0
        # The collector's time inside the timed calls (`gc.callbacks`).
        self.gc_ns = 0  # all of it
        self.replan_gc_ns: list[int] = []  # inside each re-plan instant (`replans_ns`)
        self._pending_gc_ns = 0  # inside the instant under way
        self._timing = False
        self._gc_start = 0

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """A `gc.callbacks` hook: counts a collection run inside a timed call."""
        if phase == "start":
            self._gc_start = time.thread_time_ns()
        elif self._timing:
            self._pending_gc_ns += time.thread_time_ns() - self._gc_start

    def on_event(self, event: Event, now: float) -> None:
        self._timing = True
        start = time.thread_time_ns()
        self.inner.on_event(event, now)
        self._pending_ns += time.thread_time_ns() - start
        self._timing = False
        if isinstance(event, TurnFinished):
            self.turns += 1

    def decide(self, now: float) -> list[Decision]:
        replans = self.inner.replans
        self._timing = True
        start = time.thread_time_ns()
        out = self.inner.decide(now)
        alone = time.thread_time_ns() - start
        self._timing = False
        took = alone + self._pending_ns
        gc_ns, self._pending_ns, self._pending_gc_ns = self._pending_gc_ns, 0, 0
        self.gc_ns += gc_ns
        self.decisions_ns.append(took)
        # The driver reads the counters off the scheduler it drives.
        self.preemptions, self.migrations = self.inner.preemptions, self.inner.migrations
        if self.inner.replans > replans:
            self.replans_ns.append(took)
            self.replan_decides_ns.append(alone)
            self.replan_gc_ns.append(gc_ns)
        return out

    def wakeup(self) -> float | None:
        return self.inner.wakeup()

    def engine_queues(self) -> dict[str, int]:
        return self.inner.engine_queues()

    def forget(self, traj_id: str) -> None:
        self.inner.forget(traj_id)


def _quantile(values: Sequence[int], q: float) -> float:
    """The q-quantile of nanosecond values, in milliseconds (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


def run_control_plane(*, workload: str, engines: int, trajectories: int, tp: int = 1,
                      policy: str = "treadle", seed: int = 0, model: str = "qwen3-14b",
                      gpu: str = "h100") -> dict[str, Any]:
    """One run (the module docstring); the report's fields."""
    cost = CostModel.named(model, gpu)
    work = generate_named(workload, trajectories, seed=seed,
                          max_context=cost.model.max_context)
    history = history_for(workload, min(trajectories, 4096), seed,
                          max_context=cost.model.max_context)
    layout = [tp] * engines
    spec = parse_policy(policy)
    inner = build_policy(spec, cost, batch_size=trajectories, history=history, seed=seed,
                         max_batch=MAX_BATCH, layout=layout if spec.name == "treadle" else None)
    timed = TimedScheduler(inner)
    cluster = Cluster(cost, engines * tp, timed, list(work.trajectories), layout,
                      max_batch=MAX_BATCH)
    gc.callbacks.append(timed.on_gc)
    try:
        wall = time.perf_counter()
        result = cluster.run()
        wall = time.perf_counter() - wall
    finally:
        gc.callbacks.remove(timed.on_gc)
    decisions, replans = timed.decisions_ns, timed.replans_ns
    total_ms = sum(decisions) / 1e6
    return {
        "workload": workload, "policy": spec.label, "engines": engines, "tp": tp,
        "gpus": engines * tp, "trajectories": trajectories, "turns": timed.turns,
        "decisions": len(decisions),
        "decision_p50_ms": _quantile(decisions, 0.50),
        "decision_p99_ms": _quantile(decisions, 0.99),
        "decision_max_ms": _quantile(decisions, 1.0),
        "replans": len(replans),
        "replan_p50_ms": _quantile(replans, 0.50),
        "replan_max_ms": _quantile(replans, 1.0),
        "replan_decide_max_ms": _quantile(timed.replan_decides_ns, 1.0),
        "replan_max_gc_ms": (max(zip(replans, timed.replan_gc_ns, strict=True))[1] / 1e6
                             if replans else 0.0),
        "scheduler_gc_s": timed.gc_ns / 1e9,
        "scheduler_cpu_s": total_ms / 1e3,
        "scheduler_cpu_per_turn_ms": total_ms / timed.turns if timed.turns else 0.0,
        "turns_per_s_one_core": timed.turns / (total_ms / 1e3) if total_ms else 0.0,
        "makespan_s": result.makespan_s, "events": result.events, "run_wall_s": wall,
    }


def add_control_plane_parser(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `bench control-plane` on the `treadle bench` subparsers."""
    p = bench_subparsers.add_parser(
        "control-plane", help="the scheduler's cost per decision and per re-plan at "
                              "cluster scale (the real policy over simulated engines)")
    p.add_argument("--engines", default="1024",
                   help="engines, comma-separated for several runs (default 1024)")
    p.add_argument("--trajectories", type=int, default=100_000,
                   help="trajectories in the batch (default 100000)")
    p.add_argument("--tp", type=int, default=1, help="TP degree of every engine (default 1)")
    p.add_argument("--workload", default="coding", choices=GENERATED,
                   help="a generated workload (default coding)")
    p.add_argument("--policy", default="treadle", help="scheduling policy (default treadle)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", default="out/control-plane.json",
                   help="where to write the report (default out/control-plane.json; the "
                        "committed one is benchmarks/control-plane.json)")
    p.set_defaults(func=run_control_plane_command)


def run_control_plane_command(args: argparse.Namespace) -> int:
    """Handler of `bench control-plane`; 2 with one line on stderr for bad input."""
    try:
        engines = [int(e) for e in args.engines.split(",") if e.strip()]
        parse_policy(args.policy)
        if not engines or min(engines) < 1 or args.tp < 1:
            raise ValueError("--engines and --tp must be >= 1")
        if args.trajectories < 16 or args.trajectories % 16:
            raise ValueError("--trajectories must be a positive multiple of 16 (GRPO "
                             "groups of 16)")
    except ValueError as e:
        print(f"treadle bench control-plane: {e}", file=sys.stderr)
        return 2
    runs = []
    for n in engines:
        print(f"treadle: control plane: {args.policy} over {n} engines, "
              f"{args.trajectories:,} {args.workload} trajectories", file=sys.stderr,
              flush=True)
        runs.append(run_control_plane(workload=args.workload, engines=n,
                                      trajectories=args.trajectories, tp=args.tp,
                                      policy=args.policy, seed=args.seed))
        last = runs[-1]
        print(f"treadle:   decision p50 {last['decision_p50_ms']:.3f} ms, p99 "
              f"{last['decision_p99_ms']:.3f} ms; re-plan p50 {last['replan_p50_ms']:.1f} "
              f"ms, max {last['replan_max_ms']:.1f} ms ({last['replans']}; the decide "
              f"alone {last['replan_decide_max_ms']:.1f} ms, the collector "
              f"{last['replan_max_gc_ms']:.1f} ms of the costliest); "
              f"{last['scheduler_cpu_per_turn_ms']:.3f} ms a turn", file=sys.stderr,
              flush=True)
    report = {
        "benchmark": "control-plane",
        "goals": {"decision_p99_ms": GOAL_DECISION_P99_MS, "replan_max_ms": GOAL_REPLAN_MAX_MS},
        "met": {"decision_p99": all(r["decision_p99_ms"] < GOAL_DECISION_P99_MS for r in runs),
                "replan_max": all(r["replan_max_ms"] < GOAL_REPLAN_MAX_MS for r in runs),
                "replan_decide_max": all(r["replan_decide_max_ms"] < GOAL_REPLAN_MAX_MS
                                         for r in runs)},
        "runs": runs,
        "machine": {"python": platform.python_version(), "processor": platform.machine(),
                    "cpu_time": "thread CPU time of the scheduler's calls"},
        "median_cpu_per_turn_ms": statistics.median(r["scheduler_cpu_per_turn_ms"]
                                                    for r in runs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    return 0
