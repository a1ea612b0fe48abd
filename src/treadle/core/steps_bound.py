"""A lower bound on the time K RL steps take: K rollout batches delivered and K
training steps done, on one cluster, in any mode (synchronous, over-provisioned,
asynchronous, partial rollouts), under any scheduler and engine layout.

Setting (what `sim.steps` runs). G GPUs. The trainer's step costs W GPU-seconds
(`train_gpu_s`: a colocated trainer holds all G GPUs for W/G seconds, a trainer on
G_t GPUs of its own takes W/G_t), and training steps run one after another, step k
on batch k. A batch is `batch_groups` complete GRPO groups. Groups are launched in
the order of a fixed stream (`group_costs`, index 0 first; a restart from the
prompt relaunches the same group), and a mode never holds more than `cap` groups
launched but not yet delivered (in flight, or complete and waiting). T is the time
the K-th training step ends.

**Which groups can be delivered.** When the K-th batch is sealed, (K−1)·b groups
(b = `batch_groups`) have been delivered and at most `cap` are launched and not
delivered; launches follow the stream, so every delivered group is among its first
L = (K−1)·b + cap groups. (Synchronous steps: cap = b, L = K·b, the K batches
exactly.)

**1. Work.** Every delivered trajectory was generated in full at least once, and
its GPU-seconds are at least `lower_bound.trajectory_cost(...).work_gpu_s` (term 2
of `core.lower_bound`: per token its share of the weight GEMMs plus the read of its
own context's KV, per new token its prefill FLOPs; discarded attempts, re-prefills
after a weight update and idle engines only add). Rollout and training never share
a GPU at one time (colocated: one after the other; split: disjoint GPUs), and all
of it fits in G·T GPU-seconds:

    T ≥ (K·W + W_min) / G,

W_min being the least total work of K·b distinct groups among the first L: the sum
of the K·b smallest group works there.

**2. Chain.** The first training step starts after a batch is complete, i.e. after
b groups have finished; a group finishes no sooner than its slowest member's
critical path (term 1 of `core.lower_bound`: alone on the fastest engine), so not
before c_(b), the b-th smallest group critical path among the first L groups. Then
K training steps of at least W/G seconds each run one after another:

    T ≥ c_(b) + K·W / G.

**Split GPUs** (asynchronous: the trainer on G_t GPUs of its own, the rollout on
the other G_r = G − G_t): the K batches' groups are generated on G_r GPUs before
the K-th training step starts, and that step takes W/G_t; the training steps take
W/G_t each, one after another, the first after a batch is complete:

    T ≥ W_min / G_r + W / G_t,        T ≥ c_(b) + K·W / G_t.

These replace the colocated terms, which they never undercut ((K·W + W_min)/G is
a weighted mean of K·W/G_t and W_min/G_r, each of which the split terms exceed).

**Tokens.** A delivered group is one of the first L, each at most once, so K
batches train on at most the K·b largest groups' output tokens among them
(`max_trained_tokens`); over G GPUs and the bound, no schedule trains more tokens
per GPU-second than `max_trained_tokens / (G · T_bound)` (`tokens_per_gpu_s_ceiling`).

The bound is the larger. Limits: it ignores the staleness bound (which only
restricts schedules), queueing, KV capacity and the split's balance, so it is not
attainable in general, and is only as true as the cost model. A trace's groups of
other sizes are fine: each group's work and path are its members' sum and maximum.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GroupCost:
    """What one group of the stream costs at the least (`lower_bound.trajectory_cost`
    of its members): the sum of their work, the largest of their critical paths."""

    work_gpu_s: float
    critical_path_s: float
    output_tokens: int  # the members' output tokens (what training on the group counts)


@dataclass(frozen=True, slots=True)
class StepsBound:
    """The bound and its two terms (seconds)."""

    work_s: float  # (K·W + W_min) / G; split: W_min / G_r + W / G_t
    chain_s: float  # c_(b) + K·W / G; split: c_(b) + K·W / G_t
    groups_considered: int  # L: the stream prefix a delivered group comes from
    max_trained_tokens: int  # the K·b largest groups' output tokens among the first L
    gpus: int  # G, the trainer's included

    @property
    def makespan_s(self) -> float:
        return max(self.work_s, self.chain_s)

    @property
    def tokens_per_gpu_s_ceiling(self) -> float:
        """The most trained tokens per GPU-second any schedule reaches."""
        return self.max_trained_tokens / (self.gpus * self.makespan_s) \
            if self.makespan_s > 0 else float("inf")


def steps_lower_bound(group_costs: Sequence[GroupCost], *, steps: int, batch_groups: int,
                      cap: int, train_gpu_s: float, gpus: int,
                      train_gpus: int = 0) -> StepsBound:
    """The bound for `steps` batches of `batch_groups` groups (see the module
    docstring); `train_gpus` > 0: the trainer's own GPUs (split), 0: colocated on
    all. `group_costs` is the stream in launch order and must hold at least its
    first L = (steps − 1)·batch_groups + cap groups. ValueError on a non-positive
    count, `cap` < `batch_groups`, a negative `train_gpu_s`, `train_gpus` outside
    [0, gpus) or too short a stream."""
    if steps < 1 or batch_groups < 1 or gpus < 1:
        raise ValueError(f"steps ({steps}), batch_groups ({batch_groups}) and gpus ({gpus}) "
                         "must be >= 1")
    if cap < batch_groups:
        raise ValueError(f"cap ({cap}) must be at least a batch ({batch_groups} groups)")
    if not 0 <= train_gpus < gpus:
        raise ValueError(f"train_gpus ({train_gpus}) must be in [0, {gpus})")
    if not train_gpu_s >= 0:
        raise ValueError(f"train_gpu_s must be >= 0, got {train_gpu_s}")
    considered = (steps - 1) * batch_groups + cap
    if len(group_costs) < considered:
        raise ValueError(f"the stream has {len(group_costs)} groups; the bound needs its "
                         f"first {considered}")
    prefix = group_costs[:considered]
    least_work = sum(heapq.nsmallest(steps * batch_groups, (g.work_gpu_s for g in prefix)))
    first_batch = heapq.nsmallest(batch_groups, (g.critical_path_s for g in prefix))[-1]
    most_tokens = sum(heapq.nlargest(steps * batch_groups, (g.output_tokens for g in prefix)))
    train = steps * train_gpu_s
    if train_gpus:
        work_s = least_work / (gpus - train_gpus) + train_gpu_s / train_gpus
        chain_s = first_batch + train / train_gpus
    else:
        work_s, chain_s = (train + least_work) / gpus, first_batch + train / gpus
    return StepsBound(work_s=work_s, chain_s=chain_s, groups_considered=considered,
                      max_trained_tokens=most_tokens, gpus=gpus)
