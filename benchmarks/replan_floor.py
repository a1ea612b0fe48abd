"""What a whole re-plan of N live trajectories costs at least, in pure Python.

    flock /tmp/treadle-bench.lock .venv/bin/python benchmarks/replan_floor.py \
        --trajectories 100000 --engines 1024

A re-plan that places every live trajectory by its predicted length has to list
them, read each one's remaining-work estimate, order them by it and write each one's
target. This times exactly that, with the cheapest placement there is (round-robin
over the engines in that order) and without the tie-break by id a deterministic
policy adds to the order: a floor for any placement by predicted length. Beside it, on
the same trajectories, treadle's list placement (`lpt_placement` over the same
columns, the policy's own sort and heap: `Treadle.plan`). The trajectories are the
scheduler's own `TrajState`s, each with a fresh memoised `Estimate` (log-normal
remaining tokens, median ~1,800), which both read through the policy's
`remaining`, as a re-plan between turns does.

Times are the thread's CPU time, median and min of `--repeats`, with the cyclic
collector on (it runs where the allocations put it, as in the service). Seeded.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from treadle.core.cost_model import CostModel
from treadle.core.policies.treadle_policy import Treadle
from treadle.core.predictor import Estimate, Predictor
from treadle.core.scheduler import EngineState, Phase, TrajState


def _trajectories(n: int, seed: int) -> dict[str, TrajState]:
    rng = random.Random(seed)
    out: dict[str, TrajState] = {}
    for k in range(n):
        t = TrajState(f"traj-{k:06d}", f"group-{k // 16}", 500, 0.0,
                      context_tokens=rng.randint(500, 20_000))
        t.phase = Phase.QUEUED
        remaining = float(int(rng.lognormvariate(7.5, 1.2)))
        t.memo, t.memo_turns, t.memo_generation = Estimate(remaining + 100.0, remaining,
                                                           3.0, 10.0), 0, 0
        out[t.traj_id] = t
    return out


def floor(policy: Treadle, engines: list[str]) -> dict[str, str]:
    """List, read every estimate, order, write every target (round-robin)."""
    live = [t for t in policy.trajs.values() if t.phase is not Phase.DONE]
    ids = [t.traj_id for t in live]
    remaining = [max(1.0, policy.remaining(t)) for t in live]
    order = sorted(range(len(remaining)), key=remaining.__getitem__, reverse=True)
    picks = [0] * len(order)
    m = len(engines)
    for rank, j in enumerate(order):
        picks[j] = rank % m
    return {tid: engines[i] for tid, i in zip(ids, picks, strict=True)}


def _timed(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        start = time.thread_time_ns()
        fn()
        times.append((time.thread_time_ns() - start) / 1e6)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trajectories", type=int, default=100_000)
    p.add_argument("--engines", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cost = CostModel.named("qwen3-14b", "h100")
    # Its estimator is never asked: every memoised estimate is fresh.
    policy = Treadle(cost, Predictor(), prior_lengths=[], typical_context=4000.0)
    policy.trajs.update(_trajectories(args.trajectories, args.seed))
    live = list(policy.trajs.values())
    engines = [EngineState(f"e{i:04d}", 1, 256, cost.kv_capacity_tokens(1))
               for i in range(args.engines)]
    names = [e.engine_id for e in engines]
    report: dict[str, Any] = {
        "trajectories": args.trajectories, "engines": args.engines, "repeats": args.repeats,
        "floor": _timed(lambda: floor(policy, names), args.repeats),
        "list_placement": _timed(lambda: policy.plan(live, engines), args.repeats),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
