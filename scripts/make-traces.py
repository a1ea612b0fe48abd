#!/usr/bin/env python3
"""Write two JSONL traces of shapes no built-in generator makes, for checking that
treadle's engine pool is never below the best homogeneous one on a workload it has
no history of (unless given the previous step's trace, a trace replays with no warm
start: the predictor and the layout choice start cold).

* ``pareto-coding.jsonl``: the `coding` suite's turns, tools and prompts (seed 11),
  each trajectory's turns rescaled so that its total output is Pareto distributed:
  tail index 1.15 (heavier than the `pareto` shape's 1.3), minimum 1,000 tokens,
  a group difficulty factor (lognormal, sigma 0.3) shared by siblings, capped so
  the final context stays within 40,960 tokens;
* ``flat-short.jsonl``: one or two turns, every trajectory 250-450 output tokens
  (uniform), prompts of 300-700 tokens, a fast tool (0.1-0.4 s, 20-80 tokens)
  between two turns.

1,024 trajectories in groups of 16 each; `random.Random(seed)` throughout, so the
same arguments write the same files. A trace replays with no warm start unless
`treadle sim --history` names the previous step's: the same script with another seed.

    .venv/bin/python scripts/make-traces.py out/traces             # seed 11: the step
    .venv/bin/python scripts/make-traces.py out/traces-prev --seed 12
    .venv/bin/treadle sim --workload out/traces/pareto-coding.jsonl \\
        --history out/traces-prev/pareto-coding.jsonl --gpus 64 \\
        --policies slime,verl,slime@tp2,slime@tp4,slime@tp8,verl@tp2,verl@tp4,verl@tp8,treadle
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace
from pathlib import Path

from treadle.workloads.load import generate_named
from treadle.workloads.spec import TrajectorySpec, TurnSpec, Workload
from treadle.workloads.trace import dump_trace

N, GROUP, MAX_CONTEXT = 1024, 16, 40960


def pareto_coding(seed: int) -> Workload:
    rng = random.Random(seed)
    base = generate_named("coding", N, seed=seed, group_size=GROUP, max_context=MAX_CONTEXT)
    difficulty: dict[str, float] = {}
    out = []
    for t in base.trajectories:
        factor = difficulty.setdefault(t.group_id, rng.lognormvariate(0.0, 0.3))
        total = 1000.0 * factor * (1.0 - rng.random()) ** (-1.0 / 1.15)
        observations = sum(turn.tool_output_tokens for turn in t.turns)
        room = MAX_CONTEXT - t.prompt_tokens - observations - 1
        total = max(len(t.turns), min(total, room))
        scale = total / t.output_tokens
        turns = tuple(replace(turn, output_tokens=max(1, int(turn.output_tokens * scale)))
                      for turn in t.turns)
        out.append(replace(t, turns=turns))
    return Workload("pareto-coding", tuple(out))


def flat_short(seed: int) -> Workload:
    rng = random.Random(seed)
    out = []
    for g in range(N // GROUP):
        for r in range(GROUP):
            total = rng.randint(250, 450)
            if rng.random() < 0.5:
                turns = (TurnSpec(total, 0.0, 0),)
            else:
                first = rng.randint(total // 4, 3 * total // 4)
                turns = (TurnSpec(first, rng.uniform(0.1, 0.4), rng.randint(20, 80)),
                         TurnSpec(total - first, 0.0, 0))
            group = f"flat-short-s{seed}-g{g:04d}"
            out.append(TrajectorySpec(f"{group}-r{r:02d}", group, rng.randint(300, 700), turns))
    return Workload("flat-short", tuple(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder to write the traces into")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for workload in (pareto_coding(args.seed), flat_short(args.seed)):
        path = args.out / f"{workload.name}.jsonl"
        dump_trace(workload, path)
        stats = workload.stats()
        print(f"{path}: {stats.trajectories} trajectories, output p50/p90/p99 "
              f"{stats.output_tokens.p50:.0f}/{stats.output_tokens.p90:.0f}/"
              f"{stats.output_tokens.p99:.0f}")


if __name__ == "__main__":
    main()
