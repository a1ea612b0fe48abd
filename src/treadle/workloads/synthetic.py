"""Seeded synthetic workloads: GRPO rollouts of a reasoning model in four suites.

`generate(name, n, seed=...)` builds a `Workload` (`treadle.workloads.spec`). The
suites model GRPO rollouts of a reasoning model (Qwen3 thinking) in
groups of `group_size` samples per prompt:

* tool latencies: Heddle (arXiv 2603.28101) measured the mean tool latency on
  Qwen3-14B as 0.41 s for coding (CodeForces + code sandbox), 1.41 s for search
  (HotpotQA + web search) and 0.046 s for math (DAPO-Math + calculator); the
  generators draw lognormal latencies with exactly these means. `swe` is not in
  Heddle: it mixes fast file reads/edits (0.1 s up) with 10-90 s test runs.
* lengths: public reports on RL rollouts of reasoning models (DAPO, Seer, Kimi
  k1.5, APRIL, RollPacker) agree that response lengths are long-tailed, with p99
  several times the median and a pile-up at the generation cap, and that samples
  of one prompt have similar lengths. Hence lognormal turn counts and tokens per
  turn, a per-group difficulty factor shared by all siblings (it stretches both
  the turn count and the tokens per turn), smaller per-trajectory noise, and an
  AR(1) noise across the turns of one trajectory (a verbose turn is followed by
  verbose turns).
* the context cap: Heddle capped output at 40K tokens. A trajectory's whole
  context (prompt + outputs + observations) never exceeds `max_context`; the turn
  that reaches the cap is cut to fit and ends the trajectory.

The shapes are estimates from those public figures, not fitted to any trace, and
they are not tuned to favour any scheduler. Limits: tool latencies are
independent per call (a slow sandbox is not slower for the whole group);
observation sizes do not depend on the turn's output; no trajectory fails or
times out; the prompt is one block (no shared system-prompt prefix is modelled).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from treadle.workloads.spec import TrajectorySpec, TurnSpec, Workload

__all__ = ["WORKLOADS", "generate"]


# -- generator shapes --------------------------------------------------------------

# Draws one tool call: (latency in seconds, observation tokens).
_ToolSampler = Callable[[random.Random], tuple[float, int]]


@dataclass(frozen=True, slots=True)
class _Shape:
    """Parameters of one synthetic suite. Medians are in tokens; sigmas are of the
    natural log; every draw is clamped to [lo, hi]."""

    prompt_median: float
    prompt_sigma: float
    prompt_lo: int
    prompt_hi: int
    turns_median: float
    turns_group_sigma: float  # shared by a group's siblings
    turns_traj_sigma: float  # per trajectory
    turns_lo: int
    turns_hi: int  # the harness's turn limit
    out_median: float  # tokens per turn (turns after the first)
    out_first_scale: float  # the first turn reasons from scratch, so it runs longer
    out_group_sigma: float
    out_traj_sigma: float
    out_turn_sigma: float
    out_turn_rho: float  # AR(1) correlation of successive turns' noise
    out_lo: int
    out_hi: int
    tool: _ToolSampler


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def _clamp(x: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(x)))


def resampled(stream_seed: int, sample: int) -> int:
    """The seed of a trajectory's own stream in draw `sample` of its prompt: sample 0
    is the stream itself; others are other streams of the same prompt."""
    return stream_seed + (sample << 64)


def _mean_lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    # A lognormal's mean is median·exp(σ²/2): set the median so the mean is exact.
    return _lognormal(rng, mean * math.exp(-sigma * sigma / 2.0), sigma)


def _latency(seconds: float) -> float:
    # Microsecond resolution keeps traces readable; far below any effect modelled.
    return round(seconds, 6)


def _coding_tool(rng: random.Random) -> tuple[float, int]:
    # Sandbox run of the candidate against sample tests: mean 0.41 s (Heddle);
    # σ=0.9 puts p99 near 2 s (a slow test or a long compile). The observation is
    # a verdict with stdout/stderr excerpts.
    return _latency(_mean_lognormal(rng, 0.41, 0.9)), _clamp(_lognormal(rng, 150, 0.8), 10, 2000)


def _search_tool(rng: random.Random) -> tuple[float, int]:
    # Web search + page fetch: mean 1.41 s (Heddle), network-bound so less spread.
    # The observation is a few retrieved passages, ~300-1500 tokens.
    return _latency(_mean_lognormal(rng, 1.41, 0.6)), _clamp(_lognormal(rng, 700, 0.45), 150, 3000)


def _math_tool(rng: random.Random) -> tuple[float, int]:
    # Calculator / small Python eval: mean 0.046 s (Heddle); a short numeric result.
    return _latency(_mean_lognormal(rng, 0.046, 0.6)), _clamp(_lognormal(rng, 20, 0.5), 3, 200)


_SWE_TEST_RUN_P = 0.15  # share of tool calls that run the test suite


def _swe_tool(rng: random.Random) -> tuple[float, int]:
    # Most calls read, grep or edit files (0.1 s up, a few seconds at most); about
    # one in seven runs tests, which takes 10-90 s and returns a long log.
    if rng.random() < _SWE_TEST_RUN_P:
        seconds = min(90.0, max(10.0, _lognormal(rng, 25.0, 0.6)))
        return _latency(seconds), _clamp(_lognormal(rng, 1500, 0.6), 200, 4000)
    seconds = min(5.0, max(0.1, _lognormal(rng, 0.3, 0.8)))
    return _latency(seconds), _clamp(_lognormal(rng, 350, 1.0), 30, 4000)


_CODING = _Shape(
    prompt_median=700, prompt_sigma=0.4, prompt_lo=200, prompt_hi=2000,
    turns_median=3, turns_group_sigma=0.35, turns_traj_sigma=0.15, turns_lo=1, turns_hi=8,
    out_median=1200, out_first_scale=2.0, out_group_sigma=0.6, out_traj_sigma=0.2,
    out_turn_sigma=0.45, out_turn_rho=0.5, out_lo=40, out_hi=32768,
    tool=_coding_tool,
)  # fmt: skip
_SEARCH = _Shape(
    prompt_median=450, prompt_sigma=0.3, prompt_lo=200, prompt_hi=1500,
    turns_median=5, turns_group_sigma=0.35, turns_traj_sigma=0.15, turns_lo=2, turns_hi=12,
    out_median=260, out_first_scale=1.3, out_group_sigma=0.4, out_traj_sigma=0.15,
    out_turn_sigma=0.45, out_turn_rho=0.5, out_lo=40, out_hi=4096,
    tool=_search_tool,
)  # fmt: skip
_MATH = _Shape(
    prompt_median=300, prompt_sigma=0.35, prompt_lo=120, prompt_hi=1200,
    turns_median=2, turns_group_sigma=0.35, turns_traj_sigma=0.2, turns_lo=1, turns_hi=4,
    out_median=2500, out_first_scale=1.5, out_group_sigma=0.6, out_traj_sigma=0.2,
    out_turn_sigma=0.45, out_turn_rho=0.5, out_lo=60, out_hi=32768,
    tool=_math_tool,
)  # fmt: skip
_SWE = _Shape(
    prompt_median=3500, prompt_sigma=0.25, prompt_lo=2000, prompt_hi=6000,
    turns_median=20, turns_group_sigma=0.4, turns_traj_sigma=0.2, turns_lo=3, turns_hi=100,
    out_median=280, out_first_scale=1.5, out_group_sigma=0.35, out_traj_sigma=0.15,
    out_turn_sigma=0.7, out_turn_rho=0.5, out_lo=30, out_hi=8192,
    tool=_swe_tool,
)  # fmt: skip


def _trajectory(
    shape: _Shape,
    rng: random.Random,
    traj_id: str,
    group_id: str,
    difficulty: float,
    max_context: int,
) -> TrajectorySpec:
    drawn = _lognormal(rng, shape.prompt_median, shape.prompt_sigma)
    # The prompt is clamped below max_context so that at least one token fits.
    prompt = min(_clamp(drawn, shape.prompt_lo, shape.prompt_hi), max_context - 1)
    log_turns = shape.turns_group_sigma * difficulty + shape.turns_traj_sigma * rng.gauss(0, 1)
    planned = _clamp(shape.turns_median * math.exp(log_turns), shape.turns_lo, shape.turns_hi)
    # A harder prompt stretches every turn of every sibling; each sibling adds its
    # own verbosity offset, and each turn an AR(1) deviation around it.
    offset = shape.out_group_sigma * difficulty + shape.out_traj_sigma * rng.gauss(0, 1)
    innovation = math.sqrt(1.0 - shape.out_turn_rho**2)
    noise = rng.gauss(0, 1)
    context = prompt
    turns: list[TurnSpec] = []
    for k in range(planned):
        if k:
            noise = shape.out_turn_rho * noise + innovation * rng.gauss(0, 1)
        scale = shape.out_first_scale if k == 0 else 1.0
        median = shape.out_median * scale * math.exp(offset)
        out = _clamp(median * math.exp(shape.out_turn_sigma * noise), shape.out_lo, shape.out_hi)
        room = max_context - context
        if out >= room or k == planned - 1:
            # The turn that reaches the cap is cut to fit and ends the episode.
            turns.append(TurnSpec(min(out, room), 0.0, 0))
            break
        context += out
        latency, observation = shape.tool(rng)
        if context + observation >= max_context:
            # No room left for another turn after this observation: the harness
            # stops here, as a context-length check before the call would.
            turns.append(TurnSpec(out, 0.0, 0))
            break
        context += observation
        turns.append(TurnSpec(out, latency, observation))
    return TrajectorySpec(traj_id, group_id, prompt, tuple(turns))


def _suite(
    name: str, shape: _Shape, rng: random.Random, groups: int, group_size: int, max_context: int,
    sample: int,
) -> list[TrajectorySpec]:
    out: list[TrajectorySpec] = []
    for g in range(groups):
        group_id = f"{name}-g{g:04d}"
        difficulty = rng.gauss(0.0, 1.0)  # one per prompt, shared by its siblings
        for r in range(group_size):
            # Each trajectory draws from its own stream, so how many draws a
            # truncated one skips never shifts the others: raising max_context
            # leaves every trajectory the same, only less cut.
            own = random.Random(resampled(rng.getrandbits(64), sample))
            traj_id = f"{group_id}-r{r:02d}"
            out.append(_trajectory(shape, own, traj_id, group_id, difficulty, max_context))
    return out


# -- generators --------------------------------------------------------------------
# Each docstring's figures are measured from the generator itself at 1,024
# trajectories, seed 0, group_size 16, max_context 40,960 (a test re-measures them).


def _coding(
    rng: random.Random, groups: int, group_size: int, max_context: int, sample: int
) -> list[TrajectorySpec]:
    """CodeForces with a code sandbox (Heddle's `coding`): few, long reasoning turns.

    Output tokens per trajectory: p50 5,371, p90 25,300, p99 39,648 (max 40,033).
    Turns: mean 3.43 (p50 3, p90 5, p99 7, max 8). Mean tool latency: 0.422 s.

    Shape: 1-8 turns (median 3, the harness stops at 8); the first turn, which
    reasons from the statement, is twice as long as later fix-up turns (median
    ~2,000 tokens a turn overall, p95 ~7,600). Competitive programming is where
    reasoning models think longest, so 4.4% of trajectories are cut at 40,960.
    Tool latency: lognormal, mean 0.41 s (Heddle, Qwen3-14B), σ 0.9.
    Observations: sandbox verdicts and output excerpts, median 150 tokens.
    Prompts: problem statements, 200-2,000 tokens (median 700).
    """
    return _suite("coding", _CODING, rng, groups, group_size, max_context, sample)


def _search(
    rng: random.Random, groups: int, group_size: int, max_context: int, sample: int
) -> list[TrajectorySpec]:
    """HotpotQA with web search (Heddle's `search`): more, shorter turns, each
    followed by retrieved passages.

    Output tokens per trajectory: p50 1,566, p90 5,718, p99 11,593 (max 19,801).
    Turns: mean 5.80 (p50 5, p90 9, p99 12, max 12). Mean tool latency: 1.417 s.

    Shape: 2-12 turns (median 5; multi-hop questions need two searches and an
    answer, the harness stops at 12); ~100-1,000 tokens a turn (median ~340).
    Tool latency: lognormal, mean 1.41 s (Heddle, Qwen3-14B), σ 0.6 (network-bound,
    less spread than a sandbox). Observations: retrieved passages, ~330-1,500
    tokens (median 700). Prompts: instructions, tool schema and the question,
    200-1,500 tokens. No trajectory reaches the context cap.
    """
    return _suite("search", _SEARCH, rng, groups, group_size, max_context, sample)


def _math(
    rng: random.Random, groups: int, group_size: int, max_context: int, sample: int
) -> list[TrajectorySpec]:
    """DAPO-Math with a calculator (Heddle's `math`): one to four very long turns.

    Output tokens per trajectory: p50 7,088, p90 32,068, p99 40,685 (max 40,795).
    Turns: mean 2.24 (p50 2, p90 3, p99 4, max 4). Mean tool latency: 0.047 s.

    Shape: 1-4 turns (median 2): the model thinks at length, checks a step with
    the calculator and goes on; ~1,000-14,000 tokens a turn (median ~3,800). Hard
    problems run to the cap: 6.5% of trajectories reach 40,960 tokens, the
    pile-up at the generation limit seen in reasoning-RL length histograms.
    Tool latency: lognormal, mean 0.046 s (Heddle, Qwen3-14B), σ 0.6.
    Observations: a number, ~10-50 tokens. Prompts: 120-1,200 tokens.
    """
    return _suite("math", _MATH, rng, groups, group_size, max_context, sample)


def _swe(
    rng: random.Random, groups: int, group_size: int, max_context: int, sample: int
) -> list[TrajectorySpec]:
    """Repository issue fixing (SWE-bench style; not in Heddle): many short-to-medium
    turns, large observations, and a few slow test runs.

    Output tokens per trajectory: p50 7,659, p90 18,363, p99 23,174 (max 30,409).
    Turns: mean 20.85 (p50 20, p90 30, p99 36, max 42). Mean tool latency: 4.953 s.

    Shape: a planned 3-100 turns (median 20; the harness stops at 100), ~90-1,200
    tokens a turn (median ~330). Observations are large (file views, diffs, test
    logs: ~70-2,500 tokens, up to 4,000), so this suite is context-bound: at the
    default 40,960 cap 24% of trajectories are cut (12% end exactly at the cap,
    the rest where an observation would leave no room) and the turn tail stops in
    the 40s; with ``max_context=131072`` the same trajectories run to p99 65 and
    max 79 turns. Tool latency: 85% reads/greps/edits (lognormal, median 0.3 s,
    0.1-5 s) and 15% test runs (lognormal, median 25 s, 10-90 s) with long logs.
    Prompts: issue text plus a repository summary, 2,000-6,000 tokens.
    """
    return _suite("swe", _SWE, rng, groups, group_size, max_context, sample)


_GENERATORS: dict[str, Callable[[random.Random, int, int, int, int], list[TrajectorySpec]]] = {
    "coding": _coding,
    "search": _search,
    "math": _math,
    "swe": _swe,
}

WORKLOADS: tuple[str, ...] = tuple(_GENERATORS)


def generate(
    name: str,
    trajectories: int = 1024,
    *,
    seed: int = 0,
    group_size: int = 16,
    max_context: int = 40960,
    sample: int = 0,
) -> Workload:
    """A synthetic workload of `trajectories` episodes in groups of `group_size`.

    `name` is one of `WORKLOADS`. The same arguments always give the same workload
    (everything derives from `random.Random(seed)`); another seed gives another.
    Trajectory ids are ``{name}-s{seed}-g{group:04d}-r{sibling:02d}``, group ids
    ``{name}-s{seed}-g{group:04d}``; siblings are adjacent. The seed is part of the
    ids because another seed means other prompts: a predictor that meets a group id
    again is entitled to believe it is the same prompt. A larger `trajectories` extends
    the smaller workload (same seed and group size: it is a prefix).

    `sample` > 0 samples the same prompts again, as a later epoch of RL does: every
    group keeps its prompt and difficulty (and so its ids), and each of its
    trajectories is drawn anew from its own stream (lengths, turns, tools).

    No trajectory's context exceeds `max_context`. The turn that would pass it is
    cut to fit and ends the trajectory; a turn whose tool observation would leave
    no room for another turn ends it too, without the call. Raising `max_context`
    changes only the trajectories that were cut. A prompt longer than
    ``max_context - 1`` is cut to that, so at least one token is sampled.

    Raises ValueError for an unknown name, a non-positive count or group size,
    `trajectories` not a multiple of `group_size`, or `max_context` < 2.
    """
    gen = _GENERATORS.get(name)
    if gen is None:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if trajectories < 1 or trajectories % group_size:
        raise ValueError(
            f"trajectories must be a positive multiple of group_size {group_size}, "
            f"got {trajectories}"
        )
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2, got {max_context}")
    if sample < 0:
        raise ValueError(f"sample must be >= 0, got {sample}")
    rng = random.Random(seed)
    specs = gen(rng, trajectories // group_size, group_size, max_context, sample)
    stem, seeded = f"{name}-g", f"{name}-s{seed}-g"
    specs = [replace(t, traj_id=seeded + t.traj_id[len(stem):],
                     group_id=seeded + t.group_id[len(stem):]) for t in specs]
    return Workload(name, tuple(specs))
