"""Seeded trace-like workloads of shapes the schedulers were not tuned on.

The four suites of `synthetic` (coding, search, math, swe) are what treadle's
defaults were chosen on. These generators stand in for replayed traces of other
shapes, to check that a policy is robust to them rather than fitted to the four:

* ``pareto``: coding-like turns whose *total* output per trajectory is Pareto
  distributed (tail index 1.3, minimum 800 tokens), so the tail is heavier than any
  lognormal suite's and a few trajectories run to the context cap (output p50
  1,474, p90 5,848, p99 35,179 tokens; 9 of 1,024 reach 40,960);
* ``bimodal``: 75% short answers (median 1,200 tokens) and 25% long ones (median
  18,000) mixed *within* each group, so a group's history says little about which
  mode a sibling will take (p50 1,430, p90 19,638, p99 30,827);
* ``flat``: every trajectory about the same length (uniform 6,000-8,000 output
  tokens, four turns; p50 6,982, p99 7,984): nothing to schedule around, a check
  that the scheduler costs nothing when lengths are uniform;
* ``short``: many short trajectories (median 350 output tokens, one to three
  turns, fast tools; p50 372, p90 766, p99 1,503): the step-overhead-bound regime.

The figures are measured from the generators at 1,024 trajectories, seed 0, groups
of 16, max_context 40,960.

Each trajectory's total output is drawn first and split over its turns by random
weights (uniform, normalised), so the length law is the documented one up to the
context cap. Groups of `group_size` siblings share a mild difficulty factor
(lognormal, sigma 0.25) in ``pareto`` and ``short``; ``bimodal`` draws its mode per
trajectory and ``flat`` has nothing to share. Tools
are lognormal in latency and observation size. The same arguments always give the
same workload (`random.Random(seed)` throughout).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from treadle.workloads.spec import TrajectorySpec, TurnSpec, Workload
from treadle.workloads.synthetic import resampled

__all__ = ["SHAPES", "generate_shape"]


@dataclass(frozen=True, slots=True)
class _Tools:
    """A suite's tool calls: latency and observation size, both lognormal."""

    latency_median_s: float  # median seconds per call
    latency_sigma: float  # of the log
    obs_median: float  # median observation tokens
    obs_sigma: float  # of the log


@dataclass(frozen=True, slots=True)
class _Suite:
    """One shape: how a trajectory's total output and turn count are drawn."""

    # Draws a trajectory's total output tokens from (rng, group difficulty factor).
    total: Callable[[random.Random, float], float]
    turns_lo: int  # fewest turns
    turns_hi: int  # most turns (uniform in between)
    prompt_median: float  # median prompt tokens (lognormal, sigma 0.3)
    tools: _Tools  # the calls between turns
    group_sigma: float  # sigma of the log of the per-group difficulty factor


def _pareto(rng: random.Random, factor: float) -> float:
    # Inverse CDF of Pareto(x_m = 800, alpha = 1.3): p50 ~1,360, p90 ~4,900, p99 ~27,000
    # before the cap; 1 - U keeps the draw finite.
    return factor * 800.0 * float((1.0 - rng.random()) ** (-1.0 / 1.3))


def _bimodal(rng: random.Random, factor: float) -> float:
    median = 18_000.0 if rng.random() < 0.25 else 1_200.0
    return factor * median * math.exp(0.35 * rng.gauss(0.0, 1.0))


def _flat(rng: random.Random, factor: float) -> float:
    return rng.uniform(6_000.0, 8_000.0)  # no group factor: flat means flat


def _short(rng: random.Random, factor: float) -> float:
    return factor * 350.0 * math.exp(0.5 * rng.gauss(0.0, 1.0))


_SUITES: dict[str, _Suite] = {
    "pareto": _Suite(_pareto, 1, 6, 700.0, _Tools(0.3, 0.9, 150.0, 0.8), 0.25),
    "bimodal": _Suite(_bimodal, 2, 4, 400.0, _Tools(0.5, 0.7, 200.0, 0.6), 0.0),
    "flat": _Suite(_flat, 4, 4, 500.0, _Tools(0.4, 0.2, 150.0, 0.2), 0.0),
    "short": _Suite(_short, 1, 3, 300.0, _Tools(0.05, 0.5, 40.0, 0.5), 0.25),
}

SHAPES: tuple[str, ...] = tuple(_SUITES)


def _split(total: int, turns: int, rng: random.Random) -> list[int]:
    """`total` tokens over `turns` turns (each >= 1) by random uniform weights."""
    turns = max(1, min(turns, total))
    weights = [rng.random() + 1e-3 for _ in range(turns)]
    scale = (total - turns) / sum(weights)
    parts = [1 + int(w * scale) for w in weights]
    parts[-1] += total - sum(parts)  # rounding remainder goes to the last turn
    return parts


def _trajectory(suite: _Suite, rng: random.Random, traj_id: str, group_id: str,
                factor: float, max_context: int) -> TrajectorySpec:
    prompt = min(max(50, round(suite.prompt_median * math.exp(0.3 * rng.gauss(0.0, 1.0)))),
                 max_context - 1)
    total = max(1, round(suite.total(rng, factor)))
    planned = _split(total, rng.randint(suite.turns_lo, suite.turns_hi), rng)
    context = prompt
    turns: list[TurnSpec] = []
    t = suite.tools
    for k, out in enumerate(planned):
        room = max_context - context
        if out >= room or k == len(planned) - 1:
            # As in `synthetic`: the turn that reaches the cap is cut and ends it.
            turns.append(TurnSpec(max(1, min(out, room)), 0.0, 0))
            break
        context += out
        latency = round(t.latency_median_s * math.exp(t.latency_sigma * rng.gauss(0.0, 1.0)), 6)
        obs = max(1, round(t.obs_median * math.exp(t.obs_sigma * rng.gauss(0.0, 1.0))))
        if context + obs >= max_context:
            turns.append(TurnSpec(out, 0.0, 0))
            break
        context += obs
        turns.append(TurnSpec(out, latency, obs))
    return TrajectorySpec(traj_id, group_id, prompt, tuple(turns))


def generate_shape(name: str, trajectories: int = 1024, *, seed: int = 0,
                   group_size: int = 16, max_context: int = 40960,
                   sample: int = 0) -> Workload:
    """A workload of `trajectories` episodes of shape `name` (one of `SHAPES`), in
    groups of `group_size`. Ids follow `synthetic.generate`:
    ``{name}-s{seed}-g{group:04d}-r{sibling:02d}``. Same arguments, same workload;
    each trajectory draws from its own stream, so a larger batch extends a smaller
    one. No context exceeds `max_context`. `sample` > 0 samples the same prompts
    again (`synthetic.generate`'s `sample`). ValueError for an unknown name, a count
    that is not a positive multiple of `group_size`, `max_context` < 2 or a negative
    `sample`."""
    suite = _SUITES.get(name)
    if suite is None:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    if group_size < 1 or trajectories < 1 or trajectories % group_size:
        raise ValueError(f"trajectories ({trajectories}) must be a positive multiple of "
                         f"group_size ({group_size})")
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2, got {max_context}")
    if sample < 0:
        raise ValueError(f"sample must be >= 0, got {sample}")
    rng = random.Random(seed)
    specs: list[TrajectorySpec] = []
    for g in range(trajectories // group_size):
        group_id = f"{name}-s{seed}-g{g:04d}"
        factor = math.exp(suite.group_sigma * rng.gauss(0.0, 1.0))
        for r in range(group_size):
            own = random.Random(resampled(rng.getrandbits(64), sample))
            specs.append(_trajectory(suite, own, f"{group_id}-r{r:02d}", group_id, factor,
                                     max_context))
    return Workload(name, tuple(specs))
