"""`treadle bench service`'s command line: the service under load (`bench.service`),
with `--runners` its data plane in runner actors (`bench.service_runners`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from treadle.bench.service import run_service_bench
from treadle.reports import log, write_report


def add_service_bench_parser(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `bench service` on the `treadle bench` subparsers; handler in `args.func`."""
    p = bench_subparsers.add_parser("service", help="the rollout service under load, "
                                                    "measured over HTTP")
    p.add_argument("--trajectories", type=int, default=2000, help="per job (default 2000)")
    p.add_argument("--jobs", type=int, default=3, help="jobs run back to back (default 3)")
    p.add_argument("--workload", default="search",
                   help="coding, search, math, swe, or a shape: pareto, bimodal, flat, short")
    p.add_argument("--policy", default="treadle")
    p.add_argument("--engines", type=int, default=8, help="GPUs the emulated engines model")
    p.add_argument("--time-scale", type=float, default=0.1, metavar="X")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--status-interval", type=float, default=0.1, metavar="S",
                   help="seconds between job-status requests")
    p.add_argument("--engine-http", default="wire", metavar="STACKS",
                   help="the engine clients' HTTP stack, or a comma-separated list to "
                        "measure side by side: wire (default), httpx (the stack before)")
    p.add_argument("--runners", default=None, metavar="COUNTS",
                   help="comma-separated runner actor counts (0: in the service) to measure "
                        "one after the other, each a service on a local Ray cluster "
                        "(bench.service_runners); the ray extra")
    p.add_argument("--stores", default=None, metavar="KINDS",
                   help="with --runners: where the service's store runs, a comma-separated "
                        "list to measure side by side: thread (in the service's process), "
                        "process (one of its own); default: serve's (a process with runners)")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", default="out/service.json",
                   help="where to write the report (default out/service.json; the committed "
                        "one is benchmarks/service.json)")
    p.set_defaults(func=run_service_bench_command)


def run_service_bench_command(args: argparse.Namespace) -> int:
    """Handler of `bench service`; 2 with one line on stderr for bad input."""
    from treadle.workloads.load import GENERATED

    problems = [msg for bad, msg in (
        (args.workload not in GENERATED, f"--workload must be one of {', '.join(GENERATED)}"),
        (args.trajectories < 16 or args.trajectories % 16, "--trajectories must be a "
                                                            "multiple of 16"),
        (args.jobs < 1, "--jobs must be >= 1"), (args.engines < 1, "--engines must be >= 1"),
        (not args.time_scale > 0, "--time-scale must be > 0"),
        (not args.status_interval > 0, "--status-interval must be > 0"),
        (not set(_listed(args.engine_http)) <= {"wire", "httpx"} or not _listed(
            args.engine_http), "--engine-http must list wire and/or httpx"),
        (not Path("/proc/self/stat").exists(), "needs Linux (/proc)"),
        (args.runners is not None and _counts(args.runners) is None,
         "--runners must list counts >= 0, e.g. 0,1,2,4"),
        (args.stores is not None and (args.runners is None or not _listed(args.stores) or not
                                      set(_listed(args.stores)) <= {"thread", "process"}),
         "--stores (with --runners) must list thread and/or process")) if bad]
    if problems:
        print(f"treadle bench service: {problems[0]}", file=sys.stderr)
        return 2
    try:
        if args.runners is not None:
            from treadle.bench.service_runners import run_runners_bench

            report = run_runners_bench(
                runners=_counts(args.runners) or (),
                stores=_listed(args.stores) if args.stores else (None,),
                trajectories=args.trajectories,
                jobs=args.jobs, workload=args.workload, policy=args.policy,
                engines=args.engines, time_scale=args.time_scale, model=args.model,
                gpu=args.gpu, seed=args.seed, status_interval_s=args.status_interval, log=log)
            write_report(report, args.out, name="service bench", echo=args.json)
            return 0
        report = run_service_bench(
            trajectories=args.trajectories, jobs=args.jobs, workload=args.workload,
            policy=args.policy, engines=args.engines, time_scale=args.time_scale,
            model=args.model, gpu=args.gpu, seed=args.seed,
            status_interval_s=args.status_interval, log=log,
            engine_http=_listed(args.engine_http))
    except (KeyError, ValueError) as e:
        print(f"treadle bench service: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    write_report(report, args.out, name="service bench", echo=args.json)
    return 0


def _counts(text: str) -> tuple[int, ...] | None:
    try:
        counts = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        return None
    return counts if counts and min(counts) >= 0 else None


def _listed(text: str) -> tuple[str, ...]:
    """A comma-separated list's names, each once, in order."""
    return tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
