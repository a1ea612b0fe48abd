"""`heddle`: the three mechanisms of Heddle (arXiv 2603.28101) as RESEARCH.md
describes them, on treadle's shared machinery (`progressive.Progressive`).

1. *When* — progressive priority with preemption: priority = predicted remaining
   work, re-estimated after every turn and tool result; a paused turn keeps its
   prefix cache.
2. *Where* — presorted-DP placement of trajectories sorted by predicted length,
   re-planned periodically, with migration only in tool-call gaps (KV moved, not
   re-prefilled).
3. *How* — adaptive model parallelism: the TP layout of the pool is planned jointly
   with the grouping by simulated annealing initialised from the paper-configured
   homogeneous pool, once at the start of the rollout step, from the predicted
   lengths of the batch.

Where the paper is silent this implementation chooses the simple reading: the
predictor is the progress-based one without group-sibling information (the
paper's predictor is a per-trajectory regressor), every migration the plan asks
for is made, and the layout is not changed within a rollout step.
"""

from __future__ import annotations

from collections.abc import Sequence

from treadle.core.cost_model import CostModel
from treadle.core.policies.layout import anneal_layout, homogeneous_pool
from treadle.core.policies.progressive import Progressive, WorkEstimator


class Heddle(Progressive):
    name = "heddle"

    def __init__(self, cost: CostModel, estimator: WorkEstimator, *, paper_tp: int,
                 prior_lengths: Sequence[float], typical_context: float, seed: int = 0,
                 max_batch: int = 1024) -> None:
        super().__init__(cost, estimator)
        self.paper_tp = paper_tp
        self.prior_lengths = list(prior_lengths)  # expected batch lengths, for the layout
        self.typical_context = typical_context
        self.seed = seed
        self.max_batch = max_batch

    def initial_pool(self, gpus: int) -> list[int]:
        homogeneous_pool(gpus, self.cost.min_tp(), self.name)  # raises if nothing fits
        if not self.prior_lengths:
            return homogeneous_pool(gpus, self.paper_tp, self.name)
        layout = anneal_layout(gpus, self.prior_lengths, self.cost, self.typical_context,
                               self.max_batch, start_tp=self.paper_tp, seed=self.seed,
                               min_tp=self.cost.min_tp())
        return list(layout)
