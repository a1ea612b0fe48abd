"""Scheduling policies, selected by name.

`slime`, `verl`, `verl-star` (baselines), `heddle`, `treadle` and `oracle`. A
baseline name may carry a TP suffix, `verl@tp4`, to run it on a homogeneous pool
of that degree. Every policy is a `TrajectoryScheduler` with an
`initial_pool(gpus) -> list[int]` giving the TP degree of each starting engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from treadle.core.cost_model import CostModel
from treadle.core.policies.baselines import PAPER_TP, Slime, Verl, VerlStar
from treadle.core.policies.heddle import Heddle
from treadle.core.policies.oracle import TruthEstimator
from treadle.core.policies.progressive import Progressive, Staleness
from treadle.core.policies.treadle_policy import LayoutScorer, Treadle
from treadle.core.predictor import Outcome, Predictor
from treadle.core.scheduler import TrajectoryScheduler

BASELINES = {"slime": Slime, "verl": Verl, "verl-star": VerlStar}
POLICIES = (*BASELINES, "heddle", "treadle", "oracle")
_SPEC = re.compile(r"^(?P<name>[a-z-]+)(?:@tp(?P<tp>\d+))?$")


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str  # one of POLICIES
    tp: int | None  # baselines only: homogeneous TP degree; None = paper default

    @property
    def label(self) -> str:
        return self.name if self.tp is None else f"{self.name}@tp{self.tp}"


def parse_policy(spec: str) -> PolicySpec:
    """Parse `name` or `name@tpN`; ValueError names the valid choices."""
    m = _SPEC.match(spec.strip())
    if m is None or m["name"] not in POLICIES:
        raise ValueError(f"unknown policy {spec!r}; choose from {', '.join(POLICIES)} "
                         "(baselines take a TP suffix, e.g. verl@tp4)")
    tp = int(m["tp"]) if m["tp"] else None
    if tp is not None:
        if m["name"] not in BASELINES:
            raise ValueError(f"{m['name']} plans its own TP layout; a @tp suffix is only "
                             "for slime, verl and verl-star")
        if tp not in (1, 2, 4, 8):
            raise ValueError(f"TP degree must be 1, 2, 4 or 8, got {tp} in {spec!r}")
    return PolicySpec(m["name"], tp)


def expected_lengths(history: Sequence[Outcome], n: int) -> list[float]:
    """The batch the history leads one to expect: n evenly spaced quantiles of its
    total lengths, longest first (empty with no history)."""
    if not history or n <= 0:
        return []
    totals = sorted(o.output_tokens for o in history)
    return sorted((float(totals[min(len(totals) - 1, int((i + 0.5) * len(totals) / n))])
                   for i in range(n)), reverse=True)


def typical_context(history: Sequence[Outcome]) -> float:
    """Mean context over a trajectory's life: prompt plus half its output."""
    if not history:
        return 4096.0
    return sum(o.prompt_tokens + o.output_tokens / 2.0 for o in history) / len(history)


def build_policy(spec: PolicySpec, cost: CostModel, *, batch_size: int,
                 history: Sequence[Outcome] = (), truth: Mapping[str, Outcome] | None = None,
                 layout: Sequence[int] | None = None, seed: int = 0,
                 max_batch: int = 1024,
                 layout_scorer: LayoutScorer | None = None,
                 staleness: Staleness | None = None,
                 reconfigure: bool = True) -> TrajectoryScheduler:
    """A fresh scheduler. `history` holds earlier rollout steps' outcomes (the
    predictors' warm start); `truth` is required by, and only given to, `oracle`;
    `layout` forces the pool of `treadle` and `oracle`; `layout_scorer` is how
    `treadle` scores candidate pools (see `treadle_policy`); `staleness` is how
    `treadle` weighs staleness across RL steps (`progressive.Staleness`);
    `reconfigure`: whether `treadle` and `oracle` merge idle engines for the tail
    (`tail_merge`)."""
    paper_tp = PAPER_TP.get(cost.model.name, cost.min_tp())
    if spec.name in BASELINES:
        return BASELINES[spec.name](spec.tp or paper_tp, paper_tp)
    prior = expected_lengths(history, batch_size)
    ctx = typical_context(history)
    max_tokens = cost.model.max_context
    if spec.name == "heddle":
        return Heddle(cost, Predictor(history, max_tokens=max_tokens, use_groups=False),
                      paper_tp=paper_tp, prior_lengths=prior, typical_context=ctx, seed=seed,
                      max_batch=max_batch)
    if spec.name == "treadle":
        return Treadle(cost, Predictor(history, max_tokens=max_tokens), prior_lengths=prior,
                       typical_context=ctx, max_batch=max_batch, layout=layout,
                       layout_scorer=layout_scorer, staleness=staleness,
                       reconfigure=reconfigure)
    if truth is None:
        raise ValueError("oracle needs the true outcomes of the batch")
    true_lengths = sorted((float(o.output_tokens) for o in truth.values()), reverse=True)
    # `truth` may hold judge calls too (a simulated run that judges), whose estimator
    # is another view of it.
    policy: Progressive = Treadle(cost, TruthEstimator(truth), prior_lengths=true_lengths,
                                  typical_context=typical_context(list(truth.values())),
                                  max_batch=max_batch, layout=layout,
                                  judge_estimator=TruthEstimator(truth),
                                  layout_scorer=layout_scorer, staleness=staleness,
                                  reconfigure=reconfigure)
    policy.name = "oracle"
    return policy
