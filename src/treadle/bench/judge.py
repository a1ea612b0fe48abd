"""`treadle bench judge`: what judging every trajectory once costs a rollout step.

One seeded workload (default: 1,024 coding trajectories on 64 H100s, Qwen3-14B),
one judge call per trajectory (`sim.judging`'s size model), three ways side by
side for each policy: `shared` (the scheduler's judge class on the rollout engines,
as trajectories finish), `after` (on the same engines once the rollout phase has
ended, verl's way) and `dedicated:G` (a judge pool of G GPUs, the rollouts on the
rest). Each row gives the rollout phase's end, the last verdict's, and the
overhead over the same policy's rollout phase alone (all GPUs, no judging). The
goal it checks: on shared engines judging costs treadle under 10% and beats both
other ways. A second size model (`heavy`: judges that read up to 32k tokens and
reply with up to 1k) shows how the answer moves with the judge's size.

Deterministic except for the wall-clock fields (`*_wall_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from treadle.bench.judge_live import LiveJudged, live_judged
from treadle.core.cost_model import CostModel
from treadle.core.policies import PolicySpec, parse_policy
from treadle.core.predictor import Outcome
from treadle.errors import UsageError
from treadle.reports import log as _log
from treadle.sim.judging import JudgeSetup, JudgeSizes, parse_judge, simulate_judged
from treadle.sim.runner import history_for, simulate
from treadle.workloads import Workload
from treadle.workloads.load import GENERATED, generate_named

POLICIES = "slime,verl,slime@tp8,verl@tp8,heddle,treadle,oracle"
MODEL, GPU = "qwen3-14b", "h100"
GOAL_OVERHEAD = 0.10  # judging on shared engines should cost treadle less than this
# Judges that read much more of the trajectory and reason before the verdict.
HEAVY = JudgeSizes(context_cap=32768, template_tokens=256, output_tokens=(256, 1024))
HEAVY_POLICIES = ("verl@tp8", "treadle")


class JudgedRow(Protocol):
    """A row of either kind (simulated `JudgeReport`, live `LiveJudged`)."""

    @property
    def judge(self) -> str: ...
    @property
    def overhead(self) -> float: ...
    @property
    def judged_makespan_s(self) -> float: ...


def summarise(rows: Sequence[JudgedRow]) -> dict[str, Any]:
    """One policy's modes: each one's overhead, the fastest, and the goal's checks
    (shared under `GOAL_OVERHEAD`, and finishing before each other mode)."""
    by = {r.judge: r for r in rows}
    shared = by["shared"]
    others = [r for r in rows if r.judge != "shared"]
    return {
        "overhead": {r.judge: r.overhead for r in rows},
        "fastest": min(rows, key=lambda r: (r.judged_makespan_s, r.judge)).judge,
        "shared_under_10pct": shared.overhead < GOAL_OVERHEAD,
        **{f"shared_beats_{r.judge.partition(':')[0]}":
           shared.judged_makespan_s < r.judged_makespan_s for r in others},
    }


def run_judge_bench(args: argparse.Namespace,
                    log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Every policy in every mode; writes the report to `args.out` and returns it."""
    cost = CostModel.named(MODEL, GPU)
    specs = [parse_policy(p) for p in args.policies.split(",") if p.strip()]
    modes = ["shared", "after", f"dedicated:{args.judge_gpus}"]
    setups = [parse_judge(m) for m in modes]
    n, gpus, seed = args.trajectories, args.gpus, args.seed
    workload = generate_named(args.workload, n, seed=seed, max_context=cost.model.max_context)
    history = history_for(args.workload, n, seed, max_context=cost.model.max_context)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "workload": args.workload, "trajectories": n, "gpus": gpus, "model": MODEL, "gpu": GPU,
        "seed": seed, "modes": modes,
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
    }
    for name, sizes, labels in (("default", JudgeSizes(), [s.label for s in specs]),
                                ("heavy", HEAVY, list(HEAVY_POLICIES))):
        section: dict[str, Any] = {"judge_sizes": asdict(sizes), "policies": []}
        for spec in [parse_policy(label) for label in labels]:
            log(f"{name} judges: {spec.label} on {n} {args.workload} trajectories, {gpus} GPUs")
            alone = simulate(workload, spec, cost, gpus, history=history, seed=seed)[0]
            rows = [simulate_judged(workload, spec, cost, gpus, setup, sizes=sizes,
                                    history=history, seed=seed,
                                    rollout_alone_s=alone.makespan_s)[0]
                    for setup in setups]
            section["policies"].append({"policy": spec.label, "summary": summarise(rows),
                                        "results": [asdict(r) for r in rows]})
        report[name] = section
    if args.live:
        report["live"] = _live_section(args, workload, history, setups, log)
    for part, key in (("default", "goal"), ("live", "live_goal")):
        ours = next((p for p in report.get(part, {}).get("policies", [])
                     if p["policy"] == "treadle"), None)
        if ours is not None:
            report[key] = _goal(ours["summary"])
    report["bench_wall_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"report written to {out}")
    return report


def _goal(summary: dict[str, Any]) -> dict[str, Any]:
    return {"statement": "judging on shared engines costs treadle under 10% over the "
                         "rollout phase alone and finishes before judging after the "
                         "rollout phase and on a dedicated pool",
            "met": bool(summary["shared_under_10pct"] and summary["shared_beats_after"]
                        and summary["shared_beats_dedicated"]),
            **summary}


def _live_section(args: argparse.Namespace, workload: Workload,
                  history: Sequence[Outcome], setups: Sequence[JudgeSetup],
                  log: Callable[[str], None]) -> dict[str, Any]:
    """The default-size judges live (`bench.judge_live`) for `--live-policies`."""
    section: dict[str, Any] = {"time_scale": args.time_scale, "policies": []}
    for spec in [parse_policy(p) for p in args.live_policies.split(",") if p.strip()]:
        alone = _live_row(args, workload, history, spec, None, None, log)
        rows = [_live_row(args, workload, history, spec, setup, alone.rollout_makespan_s,
                          log) for setup in setups]
        section["policies"].append({
            "policy": spec.label, "rollout_alone": asdict(alone),
            "summary": summarise(rows), "results": [asdict(r) for r in rows]})
    return section


def _live_row(args: argparse.Namespace, workload: Workload, history: Sequence[Outcome],
              spec: PolicySpec, setup: JudgeSetup | None, alone_s: float | None,
              log: Callable[[str], None]) -> LiveJudged:
    log(f"live: {spec.label}, judging {'none' if setup is None else setup.label}, "
        f"{len(workload.trajectories)} trajectories on {args.gpus} GPUs, time scale "
        f"{args.time_scale}")
    row = asyncio.run(live_judged(
        workload, spec, CostModel.named(MODEL, GPU), args.gpus, setup, sizes=JudgeSizes(),
        time_scale=args.time_scale, history=history, seed=args.seed, model=MODEL, gpu=GPU,
        rollout_alone_s=alone_s, log=log))
    log(f"  rollouts {row.rollout_makespan_s:.1f}s, judged {row.judged_makespan_s:.1f}s "
        f"(modelled), overhead {row.overhead:+.1%}, {row.errors} errors, {row.wall_s:.0f}s wall")
    return row


def add_judge_bench_parser(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `bench judge` on the `treadle bench` subparsers."""
    p = bench_subparsers.add_parser(
        "judge", help="judging every trajectory once: shared engines vs after the rollout "
                      "phase vs a dedicated pool (simulated)")
    p.add_argument("--workload", default="coding", choices=GENERATED)
    p.add_argument("--trajectories", type=int, default=1024)
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--judge-gpus", type=int, default=8,
                   help="the dedicated pool's GPUs (default 8)")
    p.add_argument("--policies", default=POLICIES, help=f"default {POLICIES}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--live", action="store_true",
                   help="also run the default-size judges live on emulated engines "
                        "(--live-policies; minutes a policy)")
    p.add_argument("--live-policies", default="treadle",
                   help="the policies run live (default treadle)")
    p.add_argument("--time-scale", type=float, default=0.1,
                   help="live runs: real seconds per modelled second (default 0.1)")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", default="out/judge.json",
                   help="where to write the report (default out/judge.json; the "
                        "committed one is benchmarks/judge.json)")
    p.set_defaults(func=run_judge_command)


def run_judge_command(args: argparse.Namespace) -> int:
    """Handler of `bench judge`; 2 with one line on stderr for bad input."""
    try:
        [parse_policy(p) for p in f"{args.policies},{args.live_policies}".split(",")
         if p.strip()]
        if not args.time_scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {args.time_scale}")
        parse_judge(f"dedicated:{args.judge_gpus}")
        if args.trajectories < 16 or args.trajectories % 16 or not \
                0 < args.judge_gpus < args.gpus:
            raise ValueError("--trajectories must be a multiple of 16 and --judge-gpus "
                             "between 1 and --gpus - 1")
        report = run_judge_bench(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps(report, indent=2))
    return 0
