"""`treadle bench reconfigure`: what merging idle engines for the tail
(`core.policies.tail_merge`) does to one rollout step, in the simulator.

For each workload, treadle runs on pools of every homogeneous TP degree (forced)
and on the pool it chooses itself (chosen once, by simulating with merges on, and
run both ways), each with and without merges, beside the best
TP-tuned baseline (verl at its best degree). The report says, per run, the
makespan, the merges decided (their degrees) and the trajectories moved, and the
ratio of the merged run to the plain one. A merge changes nothing on a pool whose
engines are already of the largest degree (8): there is nothing to merge into.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treadle.core.cost_model import TP_DEGREES, CostModel
from treadle.core.policies import PolicySpec, build_policy
from treadle.core.policies.treadle_policy import Treadle
from treadle.errors import UsageError
from treadle.reports import log
from treadle.sim.cluster import Cluster
from treadle.sim.runner import MAX_BATCH, history_for, layout_label, simulate, treadle_scorer
from treadle.workloads import Workload
from treadle.workloads.load import GENERATED, generate_named


def _treadle(workload: Workload, cost: CostModel, gpus: int, history: list[Any],
             layout: tuple[int, ...] | None, reconfigure: bool) -> dict[str, Any]:
    """One run of treadle on `layout` (None: the pool it chooses by simulating)."""
    n = len(workload.trajectories)
    scorer = treadle_scorer(cost, gpus, history, n) if layout is None else None
    policy = build_policy(PolicySpec("treadle", None), cost, batch_size=n, history=history,
                          layout=layout, max_batch=MAX_BATCH, layout_scorer=scorer,
                          reconfigure=reconfigure)
    assert isinstance(policy, Treadle)
    pool = policy.initial_pool(gpus)
    result = Cluster(cost, gpus, policy, list(workload.trajectories), pool,
                     max_batch=MAX_BATCH).run()
    return {"pool": "chosen" if layout is None else f"tp{layout[0]}",
            "layout": layout_label(pool), "reconfigure": reconfigure,
            "makespan_s": result.makespan_s, "merges": [m.tp for m in policy.merges],
            "moved": sum(len(m.moved) for m in policy.merges),
            "migrations": result.migrations, "preemptions": result.preemptions}


def run_reconfigure_bench(args: argparse.Namespace,
                          log: Callable[[str], None]) -> dict[str, Any]:
    """The report (see the module docstring), also written to `args.out`."""
    cost = CostModel.named(args.model, args.gpu)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in args.workloads.split(","):
        workload = generate_named(name, args.trajectories, seed=args.seed,
                                  max_context=cost.model.max_context)
        history = history_for(name, args.trajectories, args.seed,
                              max_context=cost.model.max_context)
        baselines = {tp: simulate(workload, f"verl@tp{tp}", cost, args.gpus)[0].makespan_s
                     for tp in TP_DEGREES if cost.min_tp() <= tp <= min(8, args.gpus)}
        best_tp = min(baselines, key=lambda tp: baselines[tp])
        runs = []
        for layout in [*((tp,) * (args.gpus // tp) for tp in baselines), None]:
            plain = _treadle(workload, cost, args.gpus, history, layout, False)
            merged = _treadle(workload, cost, args.gpus, history, layout, True)
            merged["over_plain"] = merged["makespan_s"] / plain["makespan_s"]
            runs += [plain, merged]
            log(f"{name}: treadle on {plain['layout']}: {plain['makespan_s']:.1f}s, with "
                f"merges {merged['makespan_s']:.1f}s ({merged['merges'] or 'none'})")
        chosen = runs[-1]
        rows.append({"workload": name, "verl_by_tp": baselines, "best_baseline":
                     f"verl@tp{best_tp}", "best_baseline_s": baselines[best_tp],
                     "treadle_over_best": baselines[best_tp] / chosen["makespan_s"],
                     "runs": runs})
    report = {"gpus": args.gpus, "trajectories": args.trajectories, "model": args.model,
              "gpu": args.gpu, "seed": args.seed,
              "machine": {"python": platform.python_version(),
                          "processor": platform.machine()},
              "wall_s": time.perf_counter() - started, "workloads": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"report written to {out}")
    return report


def add_reconfigure_parser(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `bench reconfigure` on the `treadle bench` subparsers."""
    p = bench_subparsers.add_parser(
        "reconfigure", help="merging idle engines for the long tail, with and without, "
                            "on every homogeneous pool (simulated)")
    p.add_argument("--workloads", default=",".join(GENERATED),
                   help=f"default {','.join(GENERATED)}")
    p.add_argument("--trajectories", type=int, default=1024)
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", default="out/reconfigure.json",
                   help="where to write the report (default out/reconfigure.json; the "
                        "committed one is benchmarks/reconfigure.json)")
    p.set_defaults(func=run_reconfigure_command)


def run_reconfigure_command(args: argparse.Namespace) -> int:
    """Handler of `bench reconfigure`; 2 with one line on stderr for bad input."""
    try:
        CostModel.named(args.model, args.gpu)
        unknown = [w for w in args.workloads.split(",") if w not in GENERATED]
        if unknown:
            raise ValueError(f"unknown workload {unknown[0]!r}; choose from "
                             f"{', '.join(GENERATED)}")
        if args.trajectories < 16 or args.trajectories % 16 or args.gpus < 8 or args.gpus % 8:
            raise ValueError("--trajectories must be a multiple of 16 and --gpus of 8")
    except (KeyError, ValueError) as exc:
        raise UsageError(str(exc).strip("'\"")) from exc
    report = run_reconfigure_bench(args, log)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0
