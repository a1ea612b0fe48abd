"""Run policies through K RL steps side by side (`treadle sim --steps`), with the
multi-step lower bound (`core.steps_bound`).

Every policy gets a fresh scheduler and cluster on the same prompt stream, so their
numbers compare directly; a scheduler lives for the whole run, so its predictor
keeps learning across steps (and meets each prompt's earlier epochs). Predictors
are warm-started as in `sim.runner`: from the previous step of the same generator.

Training time. `train_fraction` F is the share of a synchronous step the trainer
takes when the rollout runs at the lower bound: a training step costs
F/(1 − F) · LB GPU-seconds per GPU, LB being `core.lower_bound` of the stream's
first batch on all GPUs. It is the same for every policy (the trainer does not
depend on the rollout's scheduler); a real sync step is longer than LB + training,
so training is a little under F of it (coding, 64 H100: 25% of treadle's step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from treadle.core.cost_model import CostModel
from treadle.core.lower_bound import lower_bound, trajectory_cost
from treadle.core.policies import PolicySpec, build_policy, parse_policy
from treadle.core.policies.progressive import Staleness
from treadle.core.predictor import Outcome
from treadle.core.steps_bound import GroupCost, StepsBound, steps_lower_bound
from treadle.sim.runner import MAX_BATCH, layout_label, outcome_of, treadle_scorer
from treadle.sim.steps import Mode, StepsConfig, StepsDriver
from treadle.sim.stream import EpochSource, PromptStream
from treadle.workloads import Workload
from treadle.workloads.load import generate_named

# Prompts per epoch, in batches: a 10-step run sees each prompt twice.
EPOCH_BATCHES = 5


@dataclass(frozen=True, slots=True)
class StepsReport:
    """One policy's row of a multi-step comparison."""

    policy: str  # label, e.g. "verl@tp4"
    mode: str
    layout: str  # the engines' pool, e.g. "tp8x8"
    train_gpus: int  # the trainer's own GPUs (async); 0: colocated
    makespan_s: float  # until the last training step ended
    trained_tokens: int
    trained_tokens_per_gpu_s: float  # over all GPUs, the trainer's included
    utilisation: float
    staleness_p50: float
    staleness_max: int
    tokens_discarded: int
    tokens_in_flight: int
    groups_restarted: int
    length_bias: float
    lower_bound_s: float  # the mode's multi-step lower bound (same for every policy)
    ratio_to_lower_bound: float
    step_ends_s: tuple[float, ...]
    layout_choice_s: float  # wall seconds the policy took to choose its pool
    events: int
    sim_wall_s: float
    trace_digest: str


def epoch_source(workload: str | Workload, prompts: int, group_size: int, seed: int,
                 max_context: int) -> EpochSource:
    """A generated workload's epochs (`sample=epoch`), or a trace replayed each epoch."""
    if isinstance(workload, Workload):
        fixed = workload
        return lambda epoch: fixed
    name = workload
    return lambda epoch: generate_named(name, prompts * group_size, seed=seed,
                                        group_size=group_size, max_context=max_context,
                                        sample=epoch)


def stream_costs(stream: PromptStream, groups: int, cost: CostModel) -> list[GroupCost]:
    """The least work, critical path and output tokens of the stream's first
    `groups` groups."""
    out = []
    for i in range(groups):
        specs = stream.group(i).specs
        costs = [trajectory_cost(s, cost) for s in specs]
        out.append(GroupCost(sum(c.work_gpu_s for c in costs),
                             max(c.critical_path_s for c in costs),
                             sum(s.output_tokens for s in specs)))
    return out


class StepsPlan:
    """What the runs of one stream share — the training step's length and the
    stream's group costs (once, for the widest prefix any mode's bound needs) — and
    each mode's settings and lower bound. ValueError for a train fraction outside
    [0, 1) or settings `StepsConfig` refuses."""

    def __init__(self, stream: PromptStream, cost: CostModel, gpus: int, *, steps: int,
                 batch_groups: int, train_fraction: float, max_staleness: int | None,
                 overprovision: float = 0.25, train_gpus: int | None = None) -> None:
        if not 0.0 <= train_fraction < 1.0:
            raise ValueError(f"train fraction must be in [0, 1), got {train_fraction}")
        self.stream, self.cost, self.gpus = stream, cost, gpus
        self.steps, self.batch_groups = steps, batch_groups
        self.max_staleness, self.overprovision = max_staleness, overprovision
        self.train_gpus = train_gpus
        first = [s for i in range(batch_groups) for s in stream.group(i).specs]
        lb = lower_bound(first, cost, gpus).makespan_s
        self.train_s = train_fraction / (1.0 - train_fraction) * lb  # module docstring
        self._costs: list[GroupCost] | None = None

    def config(self, mode: Mode) -> StepsConfig:
        """The mode's settings; the trainer's own GPUs only in async (default
        `default_train_gpus`)."""
        split = 0
        if mode is Mode.ASYNC:
            split = self.train_gpus if self.train_gpus is not None \
                else default_train_gpus(self.gpus)
        return StepsConfig(mode, self.steps, self.batch_groups, self.train_s,
                           max_staleness=self.max_staleness,
                           overprovision=self.overprovision, train_gpus=split)

    def bound(self, config: StepsConfig) -> StepsBound:
        if self._costs is None:
            widest = max(self.config(m).cap for m in Mode)
            self._costs = stream_costs(self.stream, (self.steps - 1) * self.batch_groups
                                       + widest, self.cost)
        return steps_lower_bound(self._costs, steps=config.steps,
                                 batch_groups=config.batch_groups, cap=config.cap,
                                 train_gpu_s=config.train_s * self.gpus, gpus=self.gpus,
                                 train_gpus=config.train_gpus)


def simulate_steps(spec: PolicySpec | str, stream: PromptStream, cost: CostModel, gpus: int,
                   config: StepsConfig, bound: StepsBound, *,
                   history: Sequence[Outcome] = (), seed: int = 0,
                   clock: Callable[[], float] = time.perf_counter) -> StepsReport:
    """One policy through the run."""
    if isinstance(spec, str):
        spec = parse_policy(spec)
    started = clock()
    n, rollout_gpus = config.batch_groups * stream.group_size, gpus - config.train_gpus
    ours = spec.name in ("treadle", "oracle")
    scorer = treadle_scorer(cost, rollout_gpus, history, n) if ours else None
    # The oracle's gate would hold what truly cannot finish in its window until
    # nothing else runs (`Progressive._gated`), and the batch waits for those: it
    # finishes the oldest first instead.
    staleness = (Staleness(config.max_staleness, finish_first=True,
                           gate=spec.name == "treadle")
                 if ours and config.max_staleness is not None else None)
    truth = StreamTruth(stream, config.steps * config.batch_groups + config.cap,
                        config.batch_groups) \
        if spec.name == "oracle" else None
    policy = build_policy(spec, cost, batch_size=n, history=history, seed=seed,
                          max_batch=MAX_BATCH, layout_scorer=scorer, staleness=staleness,
                          truth=truth)
    pool = policy.initial_pool(rollout_gpus)
    chosen = clock()
    result = StepsDriver(cost, gpus, policy, pool, stream, config, max_batch=MAX_BATCH).run()
    return StepsReport(
        policy=spec.label, mode=config.mode.value, layout=layout_label(pool),
        train_gpus=result.train_gpus, makespan_s=result.makespan_s,
        trained_tokens=result.trained_tokens,
        trained_tokens_per_gpu_s=result.trained_tokens_per_gpu_s,
        utilisation=result.utilisation, staleness_p50=result.staleness_p50,
        staleness_max=result.staleness_max, tokens_discarded=result.tokens_discarded,
        tokens_in_flight=result.tokens_in_flight, groups_restarted=result.groups_restarted,
        length_bias=result.length_bias, lower_bound_s=bound.makespan_s,
        ratio_to_lower_bound=result.makespan_s / bound.makespan_s,
        step_ends_s=result.step_ends_s, layout_choice_s=chosen - started,
        events=result.events, sim_wall_s=clock() - started, trace_digest=result.trace_digest)


def default_train_gpus(gpus: int) -> int:
    """The async trainer's GPUs when none are named: 3/8 of the cluster in whole
    nodes of 8 (24 of 64; see docs/sim-steps.md for what other splits do)."""
    return max(8, round(gpus * 3 / 8 / 8) * 8) if gpus >= 16 else max(1, gpus // 2)


class StreamTruth(Mapping[str, Outcome]):
    """Every launched attempt's true outcome, for the multi-step `oracle`: the
    first `groups` groups of the stream, an attempt (`PromptStream.attempt`, id
    suffixed `-aN`) replaying its trajectory's episode. Built lazily: the oracle asks
    only for what was launched."""

    def __init__(self, stream: PromptStream, groups: int, first: int) -> None:
        self._stream, self._groups = stream, groups
        self._known: dict[str, Outcome] = {}
        self._filled = 0
        self._fill(first)  # the first batch: what the oracle's pool is chosen for

    def _fill(self, upto: int) -> None:
        for i in range(self._filled, min(upto, self._groups)):
            for spec in self._stream.group(i).specs:
                self._known[spec.traj_id] = outcome_of(spec)
        self._filled = max(self._filled, min(upto, self._groups))

    def __getitem__(self, traj_id: str) -> Outcome:
        base = PromptStream.episode_of(traj_id)
        while base not in self._known and self._filled < self._groups:
            self._fill(self._filled + 1)
        return self._known[base]

    def __iter__(self) -> Iterator[str]:
        return iter(self._known)

    def __len__(self) -> int:
        return len(self._known)
