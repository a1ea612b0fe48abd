"""A lower bound on the makespan of a rollout batch on a cluster.

No schedule — whatever its placement, priorities, migrations or TP layout — can
finish the batch sooner than `lower_bound(...)`, *under the engine cost model*
(`core.cost_model`), which is the physics the simulator runs. Two terms:

**Critical path.** A trajectory's turns run one after another, each after the
previous tool call returns. A turn first prefills the tokens no cache can hold
(the prompt, or the observation just appended) and then samples its tokens one
step at a time. On any engine of any TP degree t, a step with batch b ≥ 1 and
total KV K ≥ c (c: this sequence's context) takes

    α(t, b) + β(t)·K ≥ α(t, 1) + β(t)·c,

because α grows with b (per-sequence overhead, compute) and other sequences only
add KV. The token's time is therefore at least min_t (α(t, 1) + β(t)·c), the lower
envelope of four lines in c; its integral over the turn's context range is exact
and piecewise closed-form. Prefill likewise takes at least min_t of its time on
an idle engine (stalls for other prefills only add). Tool latencies are fixed.
The bound is the largest such sum over the batch.

**Total work.** Every GPU-second goes to decode steps or prefills (engines are
never faster than their cost). A decode step of a TP-t engine lasts at least its
compute term plus its KV term, and occupies t GPUs, so per generated token the
GPU-time is at least 2P/(F·e_c) + c·kv/(BW·e) — the token's share of the weight
GEMMs plus the read of its own context's KV, which batching cannot share. Each
new (uncacheable) token must be prefilled once, at no less than its FLOPs over
the GPU's effective FLOP rate. Dividing the total by the GPU count bounds the
makespan. Unlike "total tokens / peak throughput", this accounts for what batching
cannot amortise, so it stays valid (and tighter) when the cluster is loaded.

Limits: the bound ignores queueing, KV capacity and restarts, so it is not
attainable in general; it is only as true as the cost model.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from treadle.core.cost_model import TP_DEGREES, CostModel


class TurnShape(Protocol):
    @property
    def output_tokens(self) -> int: ...
    @property
    def tool_latency_s(self) -> float: ...
    @property
    def tool_output_tokens(self) -> int: ...


class TrajectoryShape(Protocol):
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def turns(self) -> Sequence[TurnShape]: ...


@dataclass(frozen=True, slots=True)
class LowerBound:
    """The bound and its two terms (seconds)."""

    critical_path_s: float  # the slowest trajectory alone on the fastest engine
    total_work_s: float  # GPU-seconds the batch needs, over the GPU count
    longest_traj_index: int  # which trajectory sets the critical path

    @property
    def makespan_s(self) -> float:
        return max(self.critical_path_s, self.total_work_s)


def lower_bound(trajectories: Sequence[TrajectoryShape], cost: CostModel,
                gpus: int) -> LowerBound:
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    degrees = [tp for tp in TP_DEGREES if tp >= cost.min_tp()]
    lines = [cost.step_coeffs(tp, 1) for tp in degrees]
    m, g, p = cost.model, cost.gpu, cost.params
    per_token_gpu_s = 2.0 * m.params / (g.bf16_flops * p.decode_flops_efficiency)
    kv_gpu_s = m.kv_bytes_per_token / (g.hbm_bw * p.hbm_efficiency)
    prefill_gpu_s = 2.0 * m.params / (g.bf16_flops * p.prefill_flops_efficiency)

    worst, worst_i, work = 0.0, -1, 0.0
    for i, traj in enumerate(trajectories):
        ctx = float(traj.prompt_tokens)
        new = float(traj.prompt_tokens)
        path = 0.0
        for turn in traj.turns:
            path += min(cost.prefill_time(tp, new, ctx - new) for tp in degrees)
            work += new * prefill_gpu_s
            out = float(turn.output_tokens)
            path += _envelope_integral(lines, ctx, ctx + out)
            # Σ over the turn's tokens of their context: ctx, ctx+1, ... (continuous).
            work += out * per_token_gpu_s + kv_gpu_s * (out * ctx + out * out / 2.0)
            ctx += out
            path += turn.tool_latency_s
            new = float(turn.tool_output_tokens)
            ctx += new
        if path > worst:
            worst, worst_i = path, i
    return LowerBound(worst, work / gpus, worst_i)


def _envelope_integral(lines: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """∫ from lo to hi of min over lines (a + b·c) dc — the lower envelope is concave
    and piecewise linear, so integrate between its breakpoints."""
    if hi <= lo:
        return 0.0
    cuts = {lo, hi}
    for i, (a1, b1) in enumerate(lines):
        for a2, b2 in lines[i + 1:]:
            if b1 != b2:
                c = (a2 - a1) / (b1 - b2)
                if lo < c < hi:
                    cuts.add(c)
    points = sorted(cuts)
    total = 0.0
    for x0, x1 in itertools.pairwise(points):
        mid = (x0 + x1) / 2.0
        a, b = min(lines, key=lambda ab: ab[0] + ab[1] * mid)
        total += a * (x1 - x0) + b * (x1 * x1 - x0 * x0) / 2.0
    return total
