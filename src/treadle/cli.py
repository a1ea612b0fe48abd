"""Command line: treadle sim, bench, serve, run, train, engine, sandbox, sandbox-server, demo.

Imports are lazy so that `--help` is instant. Bad input ends with one line on
stderr naming what is wrong and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from treadle.errors import UsageError
from treadle.reports import log as _log
from treadle.workloads.load import load_workload

if TYPE_CHECKING:
    from treadle.core.predictor import Outcome

DEFAULT_POLICIES = "slime,verl,verl-star,heddle,treadle,oracle"


def _sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="coding",
                   help="coding, search, math, swe; a shape nothing was tuned on "
                        "(pareto, bimodal, flat, short); or a trace file (.jsonl)")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated (default {DEFAULT_POLICIES}); baselines take "
                        "a TP suffix, e.g. verl@tp4")
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--model", default="qwen3-14b", help="qwen3-8b, qwen3-14b, qwen3-32b")
    p.add_argument("--gpu", default="h100", help="h100 or h200")
    p.add_argument("--trajectories", type=int, default=1024,
                   help="batch size of a generated workload (a multiple of 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--history", metavar="FILE.jsonl",
                   help="a trace of the previous rollout step, whose outcomes warm-start "
                        "the predictors (default: a generated workload's previous step, "
                        "none for a trace)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--timeline", metavar="FILE.html",
                   help="write a per-engine Gantt chart of the last policy's run")
    j = p.add_argument_group("judging (docs/rewards.md)")
    j.add_argument("--judge", metavar="MODE",
                   help="judge every trajectory once: shared (the scheduler's judge class "
                        "on the same engines, as trajectories finish), after (on the same "
                        "engines once the rollout phase ends) or dedicated:G (a judge pool "
                        "of G GPUs); reports rollout_makespan_s and judged_makespan_s")
    j.add_argument("--judge-context", type=int, default=8192,
                   help="most tokens of a trajectory a judge call reads (default 8192)")
    j.add_argument("--judge-output", default="64,256", metavar="LO,HI",
                   help="a judge reply's tokens, drawn uniformly (default 64,256)")
    m = p.add_argument_group("several RL steps (docs/sim-steps.md)")
    m.add_argument("--steps", type=int, default=1,
                   help="RL steps: rollouts and training steps (default 1: one rollout step)")
    m.add_argument("--mode", choices=("sync", "overprovision", "async", "partial"),
                   help="how rollouts and training alternate (default sync; implies --steps)")
    m.add_argument("--max-staleness", type=_staleness_bound, default=1,
                   help="most policy versions a delivered trajectory may lag (default 1; "
                        "none: no bound)")
    m.add_argument("--train-fraction", type=float, default=0.3,
                   help="training's share of a synchronous step at the lower bound "
                        "(default 0.3)")
    m.add_argument("--overprovision", type=float, default=0.25,
                   help="extra share of a batch kept launched, not sync (default 0.25)")
    m.add_argument("--train-gpus", type=int,
                   help="the trainer's own GPUs in async mode (default 3/8 of --gpus)")
    m.add_argument("--prompts", type=int,
                   help="prompts (groups) an epoch of a generated workload (default "
                        "5 batches' worth)")


def _staleness_bound(text: str) -> int | None:
    """`--max-staleness`: versions (>= 0), or "none" for no bound."""
    if text.lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of versions >= 0 or none, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _sim_args(sub.add_parser("sim", help="simulate scheduling policies on a cluster"))
    bench = sub.add_parser("bench", help="benchmarks with a JSON report")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    b = bench_sub.add_parser("sim", help="the scheduling benchmark (all workloads)")
    b.add_argument("--json", action="store_true", help="print the JSON report")
    b.add_argument("--out",
                   help="where to write the report (default out/sim.json, with --steps "
                        "out/sim-steps.json; the committed ones are in benchmarks/)")
    b.add_argument("--sizes", default="1024,4096",
                   help="batch sizes (with --steps: the first is the batch of a step)")
    b.add_argument("--workloads",
                   help="default coding,search,math,swe (with --steps: and the shapes)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--steps", type=int, default=1,
                   help="RL steps a run: > 1 runs the multi-step benchmark "
                        "(benchmarks/sim-steps.json) in every mode")
    b.add_argument("--modes", default="sync,overprovision,async,partial",
                   help="with --steps: the modes")
    b.add_argument("--policies", help="with --steps: the policies (default every baseline "
                                      "at every TP, heddle, treadle, oracle)")
    b.add_argument("--merge", metavar="REPORT.json",
                   help="with --steps: run only --policies and put their rows into this "
                        "report of the same settings (the others kept), written to --out")
    b.add_argument("--train-fraction", type=float, default=0.3)
    b.add_argument("--max-staleness", type=int, default=1)
    b.add_argument("--jobs", type=int, default=1, help="with --steps: runs at a time")
    from treadle.bench.chaos import add_chaos_bench_parser
    from treadle.bench.control_plane import add_control_plane_parser
    from treadle.bench.gateway import add_gateway_bench_parser
    from treadle.bench.judge import add_judge_bench_parser
    from treadle.bench.live import add_live_bench_parser
    from treadle.bench.reconfigure import add_reconfigure_parser
    from treadle.bench.sandbox import add_bench_parser
    from treadle.bench.service_cli import add_service_bench_parser
    from treadle.engines.cli import add_engine_parser
    from treadle.run.cli import add_run_parser
    from treadle.sandbox.cli import add_parser as add_sandbox_parser
    from treadle.sandbox.cli import add_server_parser
    from treadle.service.cli import add_keys_parser, add_serve_parser
    from treadle.train.cli import add_train_parser

    add_bench_parser(bench_sub)
    add_live_bench_parser(bench_sub)
    add_chaos_bench_parser(bench_sub)
    add_gateway_bench_parser(bench_sub)
    add_service_bench_parser(bench_sub)
    add_control_plane_parser(bench_sub)
    add_judge_bench_parser(bench_sub)
    add_reconfigure_parser(bench_sub)
    add_sandbox_parser(sub)
    add_server_parser(sub)
    add_engine_parser(sub)
    add_serve_parser(sub)
    add_keys_parser(sub)
    add_run_parser(sub)
    add_train_parser(sub)
    from treadle.demo import add_demo_parser

    add_demo_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sim":
            return _sim(args)
        if args.command in ("sandbox", "sandbox-server", "engine", "serve", "keys", "run",
                            "train", "demo") or (
                args.command == "bench" and args.bench in ("sandbox", "live", "service", "chaos",
                                                    "gateway", "control-plane", "judge",
                                                    "reconfigure")):
            result: int = args.func(args)
            return result
        if args.command == "bench" and args.merge and args.steps <= 1:
            raise UsageError("--merge is for the multi-step benchmark (--steps > 1)")
        if args.command == "bench" and args.steps > 1:
            from treadle.bench.sim_steps import POLICIES, run_steps_bench
            from treadle.workloads.load import GENERATED

            args.workloads = args.workloads or ",".join(GENERATED)
            args.policies = args.policies or ",".join(POLICIES)
            args.out = args.out or "out/sim-steps.json"
            report = run_steps_bench(args, log=_log)  # UsageError: a --merge refused
            if args.json:
                print(json.dumps(report, indent=2))
            return 0
        if args.command == "bench":
            from treadle.bench.sim import run_bench

            args.workloads = args.workloads or "coding,search,math,swe"
            args.out = args.out or "out/sim.json"
            report = run_bench(args, log=_log)
            if args.json:
                print(json.dumps(report, indent=2))
            return 0
    except UsageError as exc:
        print(f"treadle: error: {exc}", file=sys.stderr)
        return 2
    return 2


def _sim(args: argparse.Namespace) -> int:
    if args.judge is not None:
        if args.steps != 1 or args.mode is not None or args.timeline:
            raise UsageError("--judge is for one rollout step, without --timeline")
        return _sim_judge(args)
    if args.steps != 1 or args.mode is not None:
        return _sim_steps(args)
    from treadle.core.cost_model import CostModel
    from treadle.core.policies import parse_policy
    from treadle.sim.runner import compare

    try:
        cost = CostModel.named(args.model, args.gpu)
        specs = [parse_policy(p) for p in args.policies.split(",") if p.strip()]
    except (KeyError, ValueError) as exc:
        raise UsageError(str(exc).strip("'\"")) from exc
    if not specs:
        raise UsageError("--policies is empty")
    if args.gpus < 1:
        raise UsageError(f"--gpus must be >= 1, got {args.gpus}")
    workload = load_workload(args.workload, args.trajectories, args.seed,
                             cost.model.max_context)
    history = _history(args, len(workload.trajectories), cost.model.max_context)
    try:
        rows, timeline = compare(workload, [s.label for s in specs], cost, args.gpus,
                                 history=history, seed=args.seed, progress=_log,
                                 timeline_policy=specs[-1].label if args.timeline else None)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.timeline and timeline is not None:
        from treadle.sim.timeline import write_timeline

        tokens = {t.traj_id: t.output_tokens for t in workload.trajectories}
        write_timeline(args.timeline, timeline.spans, timeline.engines,
                       title=f"{specs[-1].label} on {workload.name}: {len(tokens)} "
                             f"trajectories, {args.gpus} x {args.gpu}, {args.model}",
                       trajectory_tokens=tokens)
        _log(f"timeline written to {args.timeline}")
    from treadle.sim.runner import report_dict

    if args.json:
        print(json.dumps({"workload": workload.name, "gpus": args.gpus, "model": args.model,
                          "gpu": args.gpu, "trajectories": len(workload.trajectories),
                          "results": report_dict(rows)}, indent=2))
    else:
        print(format_table(rows))
    return 0


def _sim_judge(args: argparse.Namespace) -> int:
    """`treadle sim --judge MODE`: every policy, each trajectory judged once."""
    from dataclasses import asdict

    from treadle.core.cost_model import CostModel
    from treadle.core.policies import parse_policy
    from treadle.sim.judging import JudgeSizes, parse_judge, simulate_judged

    try:
        cost = CostModel.named(args.model, args.gpu)
        specs = [parse_policy(p) for p in args.policies.split(",") if p.strip()]
        setup = parse_judge(args.judge)
        out = [int(v) for v in args.judge_output.split(",")]
        if len(out) != 2:
            raise ValueError(f"--judge-output takes LO,HI, got {args.judge_output}")
        sizes = JudgeSizes(args.judge_context, output_tokens=(out[0], out[1]))
    except (KeyError, ValueError) as exc:
        raise UsageError(str(exc).strip("'\"")) from exc
    if not specs:
        raise UsageError("--policies is empty")
    if args.gpus < 1:
        raise UsageError(f"--gpus must be >= 1, got {args.gpus}")
    workload = load_workload(args.workload, args.trajectories, args.seed,
                             cost.model.max_context)
    history = _history(args, len(workload.trajectories), cost.model.max_context)
    rows = []
    for spec in specs:
        _log(f"simulating {spec.label} on {workload.name} ({len(workload.trajectories)} "
             f"trajectories, {args.gpus} GPUs), judged {setup.label}")
        try:
            rows.append(simulate_judged(workload, spec, cost, args.gpus, setup, sizes=sizes,
                                        history=history, seed=args.seed)[0])
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps({"workload": workload.name, "gpus": args.gpus, "model": args.model,
                          "gpu": args.gpu, "trajectories": len(workload.trajectories),
                          "judge": setup.label, "judge_sizes": asdict(sizes),
                          "results": [asdict(r) for r in rows]}, indent=2))
    else:
        print(format_judge_table(rows))
    return 0


def format_judge_table(rows: Sequence[Any]) -> str:
    header = ("policy", "judge", "alone_s", "rollout_s", "judged_s", "judged/rollout",
              "overhead", "verdict p50/max s", "layout")
    lines = [header]
    for r in rows:
        layout = f"{r.layout} | {r.judge_layout}" if r.judge_gpus else r.layout
        lines.append((r.policy, r.judge, f"{r.rollout_alone_makespan_s:.1f}",
                      f"{r.rollout_makespan_s:.1f}", f"{r.judged_makespan_s:.1f}",
                      f"{r.judged_over_rollout:.3f}", f"{r.overhead:+.1%}",
                      f"{r.judge_latency_p50_s:.1f}/{r.judge_latency_max_s:.1f}", layout))
    return _columns(lines)


def _history(args: argparse.Namespace, trajectories: int,
             max_context: int) -> list[Outcome]:
    """The predictors' warm start: the outcomes of `--history` (a trace of the previous
    step), else of a generated workload's previous step; none for a trace."""
    from treadle.sim.runner import history_for, outcomes
    from treadle.workloads.load import GENERATED

    if args.history:
        return outcomes(load_workload(args.history, trajectories, args.seed, max_context))
    if args.workload in GENERATED:
        return list(history_for(args.workload, trajectories, args.seed,
                                max_context=max_context))
    return []


def _sim_steps(args: argparse.Namespace) -> int:
    """`treadle sim --steps K --mode M`: every policy through K RL steps."""
    from dataclasses import asdict

    from treadle.core.cost_model import CostModel
    from treadle.core.policies import parse_policy
    from treadle.sim.steps import Mode
    from treadle.sim.steps_runner import EPOCH_BATCHES, StepsPlan, epoch_source, simulate_steps
    from treadle.sim.stream import PromptStream
    from treadle.workloads.load import GENERATED

    try:
        cost = CostModel.named(args.model, args.gpu)
        specs = [parse_policy(p) for p in args.policies.split(",") if p.strip()]
    except (KeyError, ValueError) as exc:
        raise UsageError(str(exc).strip("'\"")) from exc
    if not specs:
        raise UsageError("--policies names no policy")
    if args.steps < 1 or args.gpus < 1 or args.trajectories < 16 or args.trajectories % 16:
        raise UsageError("--steps and --gpus must be >= 1, --trajectories a multiple of 16")
    if args.timeline:
        raise UsageError("--timeline is for one rollout step (no --steps or --mode)")
    mode = Mode(args.mode or "sync")
    if args.train_gpus is not None and mode is not Mode.ASYNC:
        raise UsageError("--train-gpus is for --mode async (the other modes train on all GPUs)")
    batch_groups = args.trajectories // 16
    generated = args.workload in GENERATED
    if generated:
        prompts = args.prompts or EPOCH_BATCHES * batch_groups
        source = epoch_source(args.workload, prompts, 16, args.seed, cost.model.max_context)
    else:
        trace = load_workload(args.workload, args.trajectories, args.seed,
                              cost.model.max_context)
        prompts = len({t.group_id for t in trace.trajectories})
        source = epoch_source(trace, prompts, 16, args.seed, cost.model.max_context)
    try:
        stream = PromptStream(args.workload if generated else trace.name, source, prompts, 16)
        plan = StepsPlan(stream, cost, args.gpus, steps=args.steps, batch_groups=batch_groups,
                         train_fraction=args.train_fraction, max_staleness=args.max_staleness,
                         overprovision=args.overprovision, train_gpus=args.train_gpus)
        config = plan.config(mode)
        bound = plan.bound(config)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    history = _history(args, args.trajectories, cost.model.max_context)
    rows = []
    for spec in specs:
        _log(f"simulating {spec.label}: {args.steps} {mode.value} steps of {args.trajectories} "
             f"{args.workload} trajectories on {args.gpus} GPUs")
        try:
            rows.append(simulate_steps(spec, stream, cost, args.gpus, config, bound,
                                       history=history, seed=args.seed))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps({"workload": args.workload, "gpus": args.gpus, "model": args.model,
                          "gpu": args.gpu, "trajectories_per_step": args.trajectories,
                          "steps": args.steps, "mode": mode.value,
                          "max_staleness": args.max_staleness,
                          "train_fraction": args.train_fraction, "train_s": plan.train_s,
                          "train_gpus": config.train_gpus, "prompts_per_epoch": prompts,
                          "lower_bound": {"makespan_s": bound.makespan_s,
                                          "tokens_per_gpu_s_ceiling":
                                          bound.tokens_per_gpu_s_ceiling, **asdict(bound)},
                          "results": [asdict(r) for r in rows]}, indent=2))
    else:
        print(format_steps_table(rows))
    return 0


def format_steps_table(rows: Sequence[Any]) -> str:
    header = ("policy", "trained tok/GPU-s", "makespan_s", "x_bound", "util", "stale p50/max",
              "discarded", "restarts", "layout")
    lines = [header]
    for r in rows:
        lines.append((r.policy, f"{r.trained_tokens_per_gpu_s:,.1f}", f"{r.makespan_s:.1f}",
                      f"{r.ratio_to_lower_bound:.2f}", f"{r.utilisation:.0%}",
                      f"{r.staleness_p50:g}/{r.staleness_max}", f"{r.tokens_discarded:,}",
                      str(r.groups_restarted),
                      r.layout + (f" +{r.train_gpus} train" if r.train_gpus else "")))
    return _columns(lines)


def _columns(lines: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                     for row in lines)


def format_table(rows: Sequence[Any]) -> str:
    header = ("policy", "makespan_s", "tokens/s", "bound_s", "x_bound", "util",
              "longest_q_s", "preempt", "evict", "migrate", "layout")
    lines = [header]
    for r in rows:
        lines.append((r.policy, f"{r.makespan_s:.1f}", f"{r.tokens_per_s:,.0f}",
                      f"{r.lower_bound_s:.1f}", f"{r.ratio_to_lower_bound:.2f}",
                      f"{r.utilisation:.0%}", f"{r.longest_queue_s:.1f}", str(r.preemptions),
                      str(r.kv_evictions), str(r.migrations), r.layout))
    return _columns(lines)
