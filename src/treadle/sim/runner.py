"""Run policies on a workload and cluster, side by side, and report.

Each policy gets a fresh scheduler and a fresh cluster on the same workload, so
their numbers compare directly. Predictors are warm-started from `history`: the
outcomes of an earlier rollout step (for built-in workloads, the same generator
with the next seed — other prompts, same distribution); a trace replays cold
unless the caller supplies a history.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from treadle.core.cost_model import TP_DEGREES, CostModel
from treadle.core.lower_bound import LowerBound, lower_bound
from treadle.core.policies import PolicySpec, build_policy, parse_policy
from treadle.core.policies.layout import Layout, anneal_layout
from treadle.core.predictor import Outcome
from treadle.core.scheduler import TrajectoryScheduler
from treadle.sim.cluster import Cluster
from treadle.sim.layout_scoring import SimulatedScorer, expected_batch
from treadle.sim.records import SimResult
from treadle.workloads import TrajectorySpec, Workload
from treadle.workloads.load import generate_named

MAX_BATCH = 1024  # engine max_num_seqs (vLLM's default on 80 GB+ GPUs)


@dataclass(frozen=True, slots=True)
class PolicyReport:
    """One policy's row of the comparison."""

    policy: str  # label, e.g. "verl@tp4"
    makespan_s: float  # simulated time until the last trajectory finished
    tokens_per_s: float  # generated tokens / makespan (rollout token throughput)
    lower_bound_s: float  # the batch's makespan lower bound (same for every policy)
    ratio_to_lower_bound: float  # makespan / lower bound (≥ 1)
    utilisation: float  # GPU-time busy / (GPUs × makespan)
    longest_queue_s: float  # queueing delay of the longest trajectory
    preemptions: int  # scheduler-initiated pauses
    kv_evictions: int  # engine-initiated evictions (KV full)
    migrations: int  # KV moves in tool gaps
    reconfigurations: int  # engines started after t = 0
    layout: str  # starting pool, e.g. "8x2+1x48"
    layout_choice_s: float  # wall seconds the policy took to choose that pool
    events: int  # simulator events processed
    sim_wall_s: float  # wall-clock seconds the simulation took
    trace_digest: str  # sha256 of the event trace


def outcome_of(t: TrajectorySpec) -> Outcome:
    """The outcome the trajectory's script leads to."""
    return Outcome(t.group_id, t.prompt_tokens, t.output_tokens, t.num_turns, t.tool_time_s,
                   sum(turn.tool_output_tokens for turn in t.turns))


def outcomes(workload: Workload) -> list[Outcome]:
    return [outcome_of(t) for t in workload.trajectories]


def treadle_scorer(cost: CostModel, gpus: int, history: Sequence[Outcome],
                   batch_size: int) -> SimulatedScorer | None:
    """treadle's layout scorer: the expected batch simulated on each candidate pool
    (`sim.layout_scoring`); None without a history to expect a batch from."""
    if not history:
        return None

    def policy_on(layout: Layout) -> TrajectoryScheduler:
        return build_policy(PolicySpec("treadle", None), cost, batch_size=batch_size,
                            history=history, layout=layout, max_batch=MAX_BATCH)

    key = (cost.model.name, cost.gpu.name, cost.params, gpus, batch_size, tuple(history))
    return SimulatedScorer(cost, gpus, expected_batch(history, batch_size), policy_on,
                           max_batch=MAX_BATCH, memo=_SCORES.setdefault(key, {}))


# Layout scores per (model, GPU, cost figures, GPUs, batch size, history): a process
# that runs treadle on one workload several times (a benchmark) simulates each
# candidate pool once. Bounded by the runs' distinct settings.
_SCORES: dict[tuple[object, ...], dict[Layout, float]] = {}


def history_for(workload: str, trajectories: int, seed: int, group_size: int = 16,
                max_context: int = 40960) -> list[Outcome]:
    """Outcomes of the previous rollout step of a generated workload (a suite or a
    shape: the same generator with seed + 1), which warm-start predictors."""
    return outcomes(generate_named(workload, trajectories, seed=seed + 1, group_size=group_size,
                             max_context=max_context))


def layout_label(layout: Sequence[int]) -> str:
    parts = [f"{tp}x{layout.count(tp)}" for tp in sorted(set(layout), reverse=True)]
    return "+".join(f"tp{p}" for p in parts)


def simulate(workload: Workload, spec: PolicySpec | str, cost: CostModel, gpus: int, *,
             history: Sequence[Outcome] = (), seed: int = 0, record_spans: bool = False,
             layout: Sequence[int] | None = None, bound: LowerBound | None = None,
             clock: Callable[[], float] = time.perf_counter) -> tuple[PolicyReport, SimResult]:
    """One policy on one workload. `layout` forces the oracle's starting pool."""
    if isinstance(spec, str):
        spec = parse_policy(spec)
    started = clock()
    truth = {t.traj_id: o for t, o in zip(workload.trajectories, outcomes(workload),
                                          strict=True)} if spec.name == "oracle" else None
    n = len(workload.trajectories)
    scorer = treadle_scorer(cost, gpus, history, n) if spec.name == "treadle" else None
    policy = build_policy(spec, cost, batch_size=n, history=history, truth=truth,
                          layout=layout, seed=seed, max_batch=MAX_BATCH, layout_scorer=scorer)
    pool = policy.initial_pool(gpus)
    chosen = clock()
    cluster = Cluster(cost, gpus, policy, list(workload.trajectories), pool,
                      max_batch=MAX_BATCH, record_spans=record_spans)
    result = cluster.run()
    wall = clock() - started
    lb = bound or lower_bound(workload.trajectories, cost, gpus)
    report = PolicyReport(
        policy=spec.label, makespan_s=result.makespan_s, tokens_per_s=result.tokens_per_s,
        lower_bound_s=lb.makespan_s, ratio_to_lower_bound=result.makespan_s / lb.makespan_s,
        utilisation=result.utilisation, longest_queue_s=result.longest_queue_s,
        preemptions=result.preemptions, kv_evictions=result.kv_evictions,
        migrations=result.migrations, reconfigurations=result.reconfigurations,
        layout=layout_label(pool), layout_choice_s=chosen - started, events=result.events,
        sim_wall_s=wall,
        trace_digest=result.trace_digest,
    )
    return report, result


def oracle_layouts(workload: Workload, cost: CostModel, gpus: int) -> list[tuple[int, ...]]:
    """Candidate pools the oracle tries in hindsight: every homogeneous pool and the
    annealed layout for the true lengths (its own exhaustive plan is tried too)."""
    lengths = sorted((float(t.output_tokens) for t in workload.trajectories), reverse=True)
    ctx = sum(t.prompt_tokens + t.output_tokens / 2 for t in workload.trajectories) / max(
        1, len(workload.trajectories))
    out: list[tuple[int, ...]] = []
    for tp in TP_DEGREES:
        if tp >= cost.min_tp() and gpus % tp == 0:
            out.append((tp,) * (gpus // tp))
    out.append(anneal_layout(gpus, lengths, cost, ctx, MAX_BATCH, start_tp=cost.min_tp(),
                             min_tp=cost.min_tp()))
    return out


def compare(workload: Workload, policies: Sequence[str], cost: CostModel, gpus: int, *,
            history: Sequence[Outcome] = (), seed: int = 0,
            progress: Callable[[str], None] | None = None,
            timeline_policy: str | None = None,
            bound: LowerBound | None = None) -> tuple[list[PolicyReport], SimResult | None]:
    """Every policy on the workload; returns the rows and, if asked, the spans of
    `timeline_policy`'s run for a timeline. `bound` saves recomputing the batch's
    lower bound when the caller has it."""
    specs = [parse_policy(p) for p in policies]
    bound = bound or lower_bound(workload.trajectories, cost, gpus)
    rows: list[PolicyReport] = []
    timeline: SimResult | None = None
    for spec in specs:
        if progress:
            progress(f"simulating {spec.label} on {workload.name} "
                     f"({len(workload.trajectories)} trajectories, {gpus} GPUs)")
        want_spans = spec.label == timeline_policy
        candidates: list[tuple[int, ...] | None] = [None]
        if spec.name == "oracle":
            candidates += oracle_layouts(workload, cost, gpus)
        best: tuple[PolicyReport, SimResult] | None = None
        for layout in candidates:
            run = simulate(workload, spec, cost, gpus, history=history, seed=seed,
                           record_spans=want_spans, layout=layout, bound=bound)
            if best is None or run[0].makespan_s < best[0].makespan_s:
                best = run
        assert best is not None
        rows.append(best[0])
        if want_spans:
            timeline = best[1]
    return rows, timeline


def report_dict(rows: Sequence[PolicyReport]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]
