"""The multi-step lower bound (`core.steps_bound`): its two terms on hand-computed
cases, which groups it may count, and its refusals. (That it is below every
simulated run, in every mode, is `tests/sim/test_steps.py`.)"""

from __future__ import annotations

import pytest

from treadle.core.cost_model import CostModel
from treadle.core.lower_bound import lower_bound, trajectory_cost
from treadle.core.steps_bound import GroupCost, steps_lower_bound
from treadle.workloads import generate


def _groups(*pairs: tuple[float, float]) -> list[GroupCost]:
    return [GroupCost(work, path, 100) for work, path in pairs]


def test_work_counts_the_least_work_of_the_batches_among_the_groups_it_may_deliver() -> None:
    # Two steps of one group each, cap 2: a delivered group is among the first
    # (2 - 1)·1 + 2 = 3; the two lightest of those are 5 and 10.
    costs = _groups((10, 3), (20, 1), (5, 1), (1, 0.5))
    b = steps_lower_bound(costs, steps=2, batch_groups=1, cap=2, train_gpu_s=4.0, gpus=2)
    assert b.groups_considered == 3
    assert b.work_s == pytest.approx((2 * 4.0 + 5 + 10) / 2)
    # The first batch's earliest finish: the fastest of the three groups, 1 s.
    assert b.chain_s == pytest.approx(1.0 + 2 * 4.0 / 2)
    assert b.makespan_s == b.work_s


def test_synchronous_steps_count_exactly_their_batches() -> None:
    costs = _groups((10, 30), (20, 10), (5, 1))
    b = steps_lower_bound(costs, steps=2, batch_groups=1, cap=1, train_gpu_s=0.0, gpus=1)
    assert b.groups_considered == 2
    assert (b.work_s, b.chain_s) == (30.0, 10.0)


def test_the_chain_waits_for_a_whole_batch_of_groups() -> None:
    costs = _groups((1, 50), (1, 70), (1, 60), (1, 10))
    b = steps_lower_bound(costs, steps=1, batch_groups=3, cap=4, train_gpu_s=30.0, gpus=10)
    assert b.chain_s == pytest.approx(60.0 + 3.0)  # the third fastest of four
    assert b.makespan_s == b.chain_s


def test_one_step_is_never_above_the_one_step_bounds_own_terms() -> None:
    """With no training and one synchronous step, the work term is the one-step
    bound's total-work term and the chain term its critical path (the whole batch
    must finish), both no more than the one-step bound."""
    cost = CostModel.named("qwen3-14b", "h100")
    w = generate("coding", 64, seed=3)
    groups: dict[str, list[float]] = {}
    paths: dict[str, float] = {}
    for t in w.trajectories:
        c = trajectory_cost(t, cost)
        groups.setdefault(t.group_id, []).append(c.work_gpu_s)
        paths[t.group_id] = max(paths.get(t.group_id, 0.0), c.critical_path_s)
    costs = [GroupCost(sum(groups[g]), paths[g], 0) for g in groups]
    b = steps_lower_bound(costs, steps=1, batch_groups=len(costs), cap=len(costs),
                          train_gpu_s=0.0, gpus=8)
    one = lower_bound(w.trajectories, cost, 8)
    assert b.work_s == pytest.approx(one.total_work_s)
    assert b.chain_s == pytest.approx(one.critical_path_s)
    assert b.makespan_s <= one.makespan_s + 1e-9


def test_a_trainer_on_gpus_of_its_own_bounds_the_run_by_its_steps() -> None:
    """Split: K training steps of W/G_t each after the first batch (chain), and the
    batches' work on the rollout GPUs before the last step (work); both above the
    colocated terms for the same run."""
    costs = _groups((8, 3), (6, 2), (4, 1), (12, 5))
    args = {"steps": 2, "batch_groups": 1, "cap": 2, "train_gpu_s": 12.0, "gpus": 4}
    colocated = steps_lower_bound(costs, **args)
    split = steps_lower_bound(costs, **args, train_gpus=1)
    assert split.chain_s == pytest.approx(1.0 + 2 * 12.0 / 1)  # c_(b) of (3, 2, 1): 1
    assert split.work_s == pytest.approx((4 + 6) / 3 + 12.0 / 1)
    assert split.work_s >= colocated.work_s and split.chain_s >= colocated.chain_s
    assert colocated.chain_s == pytest.approx(1.0 + 2 * 12.0 / 4)


def test_the_token_ceiling_counts_the_largest_groups_it_may_deliver() -> None:
    """Two batches of one group among the first three: the two largest of those."""
    costs = [GroupCost(1, 1, 300), GroupCost(1, 1, 100), GroupCost(1, 1, 200),
             GroupCost(1, 1, 900)]
    b = steps_lower_bound(costs, steps=2, batch_groups=1, cap=2, train_gpu_s=0.0, gpus=2)
    assert b.max_trained_tokens == 500
    assert b.tokens_per_gpu_s_ceiling == pytest.approx(500 / (2 * b.makespan_s))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"steps": 0}, "must be >= 1"),
    ({"cap": 1}, "cap"),
    ({"train_gpu_s": -1.0}, "train_gpu_s"),
    ({"steps": 9}, "needs its first"),
    ({"train_gpus": 4}, "train_gpus"),
])
def test_bad_arguments_are_refused(kwargs: dict[str, float], match: str) -> None:
    args: dict[str, float] = {"steps": 2, "batch_groups": 2, "cap": 2, "train_gpu_s": 1.0,
                              "gpus": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        steps_lower_bound(_groups(*[(1, 1)] * 8), **args)
