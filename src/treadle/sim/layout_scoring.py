"""treadle's `LayoutScorer` in the simulator: a candidate pool is worth the makespan
of one rollout step of the batch one expects, simulated on it under the cost model
with treadle's own mechanisms — what the oracle does in hindsight with the true
batch, done in foresight with the predicted one.

The expected batch is the warm-start history (the outcomes of earlier steps: other
prompts of the same distribution) made into episodes: each outcome's tokens spread
evenly over its turns, its tool time over its calls, its observation tokens over
them too. Group ids are renamed, so the simulated predictor knows the distribution
but none of the prompts, as in the step itself. Deterministic; costs one simulated
step per candidate (`layout_choice_s` in the reports).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from treadle.core.cost_model import CostModel
from treadle.core.policies.layout import Layout
from treadle.core.predictor import Outcome
from treadle.core.scheduler import TrajectoryScheduler
from treadle.sim.cluster import Cluster
from treadle.workloads import TrajectorySpec, TurnSpec

# A scheduler that runs on a given pool (treadle with its layout forced).
PolicyOn = Callable[[Layout], TrajectoryScheduler]


def expected_batch(history: Sequence[Outcome], n: int) -> list[TrajectorySpec]:
    """`n` episodes shaped like the history's outcomes (cycled if there are fewer)."""
    if not history:
        return []
    out = []
    for i in range(n):
        o = history[i % len(history)]
        turns = max(1, o.turns)
        base, extra = divmod(max(turns, o.output_tokens), turns)
        calls = turns - 1
        latency = o.tool_time_s / calls if calls else 0.0
        obs = o.observation_tokens // calls if calls else 0
        out.append(TrajectorySpec(
            f"expected-{i:05d}", f"expected-{o.group_id}-{i // len(history)}",
            max(1, o.prompt_tokens),
            tuple(TurnSpec(base + (k < extra), latency if k < calls else 0.0,
                           obs if k < calls else 0) for k in range(turns))))
    return out


class SimulatedScorer:
    """Scores a pool by simulating the expected batch on it (`policy_on(layout)`
    runs it); the makespan in seconds. `memo` keeps scores already simulated: a
    caller that scores the same batch on the same GPUs again (another run of one
    benchmark) passes the same dict, and the answer is the same."""

    def __init__(self, cost: CostModel, gpus: int, batch: Sequence[TrajectorySpec],
                 policy_on: PolicyOn, *, max_batch: int,
                 memo: dict[Layout, float] | None = None) -> None:
        self.cost, self.gpus, self.batch = cost, gpus, list(batch)
        self.policy_on = policy_on
        self.max_batch = max_batch
        self.memo = {} if memo is None else memo

    def __call__(self, layout: Layout) -> float:
        if sum(layout) > self.gpus:
            raise ValueError(f"pool {layout} needs more than {self.gpus} GPUs")
        if layout not in self.memo:
            cluster = Cluster(self.cost, self.gpus, self.policy_on(layout), self.batch,
                              list(layout), max_batch=self.max_batch)
            self.memo[layout] = cluster.run().makespan_s
        return self.memo[layout]
