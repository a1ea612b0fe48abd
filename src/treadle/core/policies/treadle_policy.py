"""`treadle`: our own policy, built on heddle's mechanisms (see `progressive`).

What it adds, each mechanism in turn:

1. **Group-sibling prediction.** The predictor blends a trajectory's own progress
   with the finished lengths of its GRPO siblings (Seer's observation), so the
   long tail of a hard prompt is recognised as soon as its easy siblings finish.
2. **Layout planned for the whole batch, exhaustively.** Instead of annealing, every
   split of the GPU budget into TP-1/2/4/8 engines is scored with the placement
   model on the batch's expected length quantiles, and the best is taken.
3. **Migration priced by the cost model.** A move is made only if the predicted
   remaining decode time saved on the destination exceeds the KV transfer time
   (or, with no KV cached, the re-prefill) by a margin.
"""

from __future__ import annotations

from collections.abc import Sequence

from treadle.core.cost_model import CostModel
from treadle.core.policies.layout import best_layout
from treadle.core.policies.progressive import Progressive, WorkEstimator
from treadle.core.scheduler import TrajState


class Treadle(Progressive):
    name = "treadle"
    migration_margin = 1.5  # saved time must exceed the move's cost by this factor

    def __init__(self, cost: CostModel, estimator: WorkEstimator, *,
                 prior_lengths: Sequence[float], typical_context: float,
                 max_batch: int = 1024, layout: Sequence[int] | None = None) -> None:
        super().__init__(cost, estimator)
        self.prior_lengths = list(prior_lengths)
        self.typical_context = typical_context
        self.max_batch = max_batch
        self.layout = list(layout) if layout is not None else None

    def initial_pool(self, gpus: int) -> list[int]:
        if self.layout is not None:
            return self.layout
        if not self.prior_lengths:
            tp = self.cost.min_tp()
            return [tp] * (gpus // tp)
        return list(best_layout(gpus, self.prior_lengths, self.cost, self.typical_context,
                                self.max_batch, self.cost.min_tp()))

    def should_migrate(self, t: TrajState, src: str, dst: str, now: float) -> bool:
        s, d = self.engines[src], self.engines[dst]
        remaining = self.remaining(t)
        ctx = float(t.context_tokens)
        before = self.cost.step_time(s.tp, max(1, len(s.running)), ctx * max(1, len(s.running)))
        after = self.cost.step_time(d.tp, len(d.running) + 1, ctx * (len(d.running) + 1))
        saved = remaining * (before - after)
        return saved > self.migration_margin * self.cost.migration_time(ctx)
