"""Judging in the simulator: one judge call per rollout trajectory, scheduled three ways.

A judge call (`judge_call`) is a one-turn trajectory. Its prompt is the rubric's
instructions (`JudgeSizes.template_tokens`) around what the judge reads of the
trajectory: its whole final context up to `context_cap` tokens, and beyond that a
summary or a cut of that size (the task, the final answer, the diff). Its reply, a
verdict with a short reason, samples a seeded number of tokens drawn uniformly from
`output_tokens` (the rubric's `max_tokens` bounds it). A call never reuses the
rollout's KV: its prompt is a new message, so it prefills in full.

Modes (`JudgeSetup`), on the same cost model and through the real core scheduler:

- `shared`: each call starts when its trajectory finishes, on the same engines, as
  the scheduler's judge class (`TrajectoryArrived.judge`: queued after every rollout
  turn, paused first by a policy that preempts), placed by the policy's placement.
- `after` (verl's colocated reward model): every call starts once the last rollout
  has finished, on the same engines.
- `dedicated:G` (a reward pool of its own, as ROLL's): G GPUs form a judge pool run
  by the same policy and the rollouts get the rest; a call starts when its
  trajectory finishes. The two pools share nothing, so they are two clusters: the
  rollout pool's finish times are the judge pool's arrival times. There judge calls
  are the only work, so they are the pool's ordinary class, and its policy is
  warm-started, as the rollout pool's is, by the previous step's calls.

`JudgeReport` gives, per policy, when the last rollout finished and when the last
judgement did, beside the rollout phase alone (the same policy on all the GPUs, no
judging). Deterministic: the same arguments give the same run, digest included.
"""

from __future__ import annotations

import enum
import hashlib
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from treadle.core.cost_model import CostModel
from treadle.core.policies import PolicySpec, build_policy, parse_policy
from treadle.core.predictor import Outcome
from treadle.core.scheduler import TrajectoryScheduler
from treadle.sim.cluster import Cluster
from treadle.sim.runner import MAX_BATCH, layout_label, outcome_of, simulate, treadle_scorer
from treadle.workloads import TrajectorySpec, TurnSpec, Workload

LAUNCH_ORDER = 50  # calls launch after an instant's engine events, before decide()


class JudgeMode(enum.Enum):
    SHARED = "shared"
    AFTER = "after"
    DEDICATED = "dedicated"


@dataclass(frozen=True, slots=True)
class JudgeSetup:
    """Where and when the judge calls run; `judge_gpus` only for `dedicated`."""

    mode: JudgeMode
    judge_gpus: int = 0

    @property
    def label(self) -> str:
        return f"dedicated:{self.judge_gpus}" if self.mode is JudgeMode.DEDICATED \
            else self.mode.value


def parse_judge(text: str) -> JudgeSetup:
    """`shared`, `after` or `dedicated:G` (G >= 1); ValueError names the choices."""
    name, _, gpus = text.strip().partition(":")
    if name == "dedicated":
        if not gpus.isdigit() or int(gpus) < 1:
            raise ValueError(f"dedicated needs its pool's GPUs, e.g. dedicated:8; got {text!r}")
        return JudgeSetup(JudgeMode.DEDICATED, int(gpus))
    if name in ("shared", "after") and not gpus:
        return JudgeSetup(JudgeMode(name))
    raise ValueError(f"unknown judge mode {text!r}; choose shared, after or dedicated:G")


@dataclass(frozen=True, slots=True)
class JudgeSizes:
    """The size model of one judge call (module docstring)."""

    context_cap: int = 8192  # most tokens of the trajectory the judge reads
    template_tokens: int = 256  # the rubric's instructions around them
    # Reply tokens, drawn uniformly: the rubric's default max_tokens is 256, and a
    # verdict under the rubric's schema (a score, a reason of <= 300 characters) is
    # about a hundred.
    output_tokens: tuple[int, int] = (64, 256)

    def __post_init__(self) -> None:
        lo, hi = self.output_tokens
        if self.context_cap < 1 or self.template_tokens < 0:
            raise ValueError(f"a judge call's context cap must be >= 1 and its template "
                             f">= 0, got {self.context_cap} and {self.template_tokens}")
        if not 1 <= lo <= hi:
            raise ValueError(f"a judge reply's tokens need 1 <= LO <= HI, got {lo},{hi}")

    def prompt(self, context_tokens: int) -> int:
        return self.template_tokens + min(context_tokens, self.context_cap)


def judge_call(t: TrajectorySpec, sizes: JudgeSizes, seed: int) -> TrajectorySpec:
    """The judge call of rollout `t`: id and group `<traj_id>/judge` (a call is its
    own group, as on the live engines), one turn, seeded by (seed, traj_id)."""
    rng = random.Random(f"judge:{seed}:{t.traj_id}")
    call = f"{t.traj_id}/judge"
    return TrajectorySpec(call, call, sizes.prompt(t.context_tokens),
                          (TurnSpec(rng.randint(*sizes.output_tokens), 0.0, 0),))


def judge_history(history: Sequence[Outcome], sizes: JudgeSizes, seed: int) -> list[Outcome]:
    """The previous step's judge calls, from its rollouts' outcomes (a dedicated
    pool's warm start)."""
    out = []
    for i, o in enumerate(history):
        rng = random.Random(f"judge-history:{seed}:{i}")
        context = o.prompt_tokens + o.output_tokens + o.observation_tokens
        out.append(Outcome(f"judge-{i}", sizes.prompt(context),
                           rng.randint(*sizes.output_tokens), 1, 0.0))
    return out


@dataclass(slots=True)
class JudgedRun:
    """One mode's run: the clusters (spans and state, for a timeline or a test) and
    when the last rollout and the last judgement finished."""

    rollouts: Cluster  # where the rollouts ran
    judges: Cluster  # where the judge calls ran: `rollouts` unless dedicated
    calls: dict[str, TrajectorySpec]  # rollout id -> its judge call
    rollout_makespan_s: float
    judged_makespan_s: float

    def judge_latencies(self) -> list[float]:
        """Per call, from its rollout's finish to its verdict."""
        return [self._finish(self.judges, c.traj_id) - self._finish(self.rollouts, r)
                for r, c in self.calls.items()]

    @staticmethod
    def _finish(cluster: Cluster, tid: str) -> float:
        at = cluster.trajs[tid].finished_at
        assert at is not None, f"{tid} never finished"  # run() raises before this
        return at


def run_shared_engines(trajectories: Sequence[TrajectorySpec],
                       calls: dict[str, TrajectorySpec], policy: TrajectoryScheduler,
                       cost: CostModel, gpus: int, pool: list[int], *, after: bool,
                       record_spans: bool = False) -> JudgedRun:
    """Rollouts and their judge calls on one pool (`shared`, or `after`): a call is
    launched, of the judge class, when its rollout finishes, or with `after` all of
    them once the last rollout has."""
    left = len(trajectories)

    def finished(tid: str) -> None:
        nonlocal left
        if tid not in calls:
            return  # a judge call
        left -= 1
        if not after:
            cluster.kernel.at(cluster.kernel.now,
                              lambda: cluster.launch(calls[tid], judge=True), LAUNCH_ORDER)
        elif left == 0:
            cluster.kernel.at(cluster.kernel.now, launch_all, LAUNCH_ORDER)

    def launch_all() -> None:
        for t in trajectories:
            cluster.launch(calls[t.traj_id], judge=True)

    cluster = Cluster(cost, gpus, policy, list(trajectories), pool, max_batch=MAX_BATCH,
                      record_spans=record_spans, on_finish=finished)
    cluster.run()
    return _judged(cluster, cluster, calls)


def run_dedicated(trajectories: Sequence[TrajectorySpec], calls: dict[str, TrajectorySpec],
                  rollout_policy: TrajectoryScheduler, judge_policy: TrajectoryScheduler,
                  cost: CostModel, rollout_gpus: int, judge_gpus: int,
                  rollout_pool: list[int], judge_pool: list[int], *,
                  record_spans: bool = False) -> JudgedRun:
    """Rollouts on `rollout_gpus`, their judge calls on a pool of `judge_gpus` of its
    own, each launched when its rollout finished."""
    rollouts = Cluster(cost, rollout_gpus, rollout_policy, list(trajectories), rollout_pool,
                       max_batch=MAX_BATCH, record_spans=record_spans)
    rollouts.run()
    judges = Cluster(cost, judge_gpus, judge_policy, [], judge_pool, max_batch=MAX_BATCH,
                     record_spans=record_spans)
    def launcher(call: TrajectorySpec) -> Callable[[], None]:
        return lambda: judges.launch(call)

    for t in trajectories:  # the kernel keeps scheduling order among equal times
        judges.kernel.at(JudgedRun._finish(rollouts, t.traj_id), launcher(calls[t.traj_id]),
                         LAUNCH_ORDER)
    judges.run()
    return _judged(rollouts, judges, calls)


def _judged(rollouts: Cluster, judges: Cluster, calls: dict[str, TrajectorySpec]) -> JudgedRun:
    rollouts.result()  # raises if a rollout never finished
    judges.result()
    return JudgedRun(rollouts, judges, calls,
                     max(JudgedRun._finish(rollouts, r) for r in calls),
                     max(JudgedRun._finish(judges, c.traj_id) for c in calls.values()))


@dataclass(frozen=True, slots=True)
class JudgeReport:
    """One policy's row under one judge mode."""

    policy: str
    judge: str  # shared | after | dedicated:G
    rollout_gpus: int
    judge_gpus: int  # the judge pool's; 0 unless dedicated
    layout: str  # the rollout pool
    judge_layout: str  # the pool the judge calls ran on
    rollout_alone_makespan_s: float  # the same policy on all the GPUs, no judging
    rollout_makespan_s: float  # when the last rollout trajectory finished
    judged_makespan_s: float  # when the last judgement finished
    judged_over_rollout: float  # judged_makespan_s / rollout_makespan_s
    overhead: float  # judged_makespan_s / rollout_alone_makespan_s - 1: judging's cost
    judge_calls: int
    judge_prompt_tokens: int  # over all calls
    judge_output_tokens: int
    judge_latency_p50_s: float  # a call's rollout finish to its verdict
    judge_latency_max_s: float
    preemptions: int  # scheduler-initiated pauses, both pools
    kv_evictions: int
    events: int
    sim_wall_s: float
    trace_digest: str  # sha256 over the runs' event traces


def judged_policy(spec: PolicySpec, cost: CostModel, gpus: int, n: int,
                  history: Sequence[Outcome], truth: dict[str, Outcome] | None,
                  seed: int) -> TrajectoryScheduler:
    """The policy as `runner.simulate` builds it, for a pool of `gpus` (the live
    bench builds its runtimes' schedulers the same way)."""
    scorer = treadle_scorer(cost, gpus, history, n) if spec.name == "treadle" else None
    return build_policy(spec, cost, batch_size=n, history=history, truth=truth, seed=seed,
                        max_batch=MAX_BATCH, layout_scorer=scorer)


def simulate_judged(workload: Workload, spec: PolicySpec | str, cost: CostModel, gpus: int,
                    setup: JudgeSetup, *, sizes: JudgeSizes | None = None,
                    history: Sequence[Outcome] = (), seed: int = 0,
                    rollout_alone_s: float | None = None, record_spans: bool = False,
                    clock: Callable[[], float] = time.perf_counter,
                    ) -> tuple[JudgeReport, JudgedRun]:
    """One policy on the workload, every trajectory judged once, in `setup`'s mode.
    `rollout_alone_s`: the policy's makespan on the workload without judging, if the
    caller has it (else simulated; `after` needs none, its rollout phase is that
    run). ValueError when a dedicated pool leaves the rollouts no GPU."""
    spec = parse_policy(spec) if isinstance(spec, str) else spec
    sizes = sizes or JudgeSizes()
    if setup.mode is JudgeMode.DEDICATED and not 0 < setup.judge_gpus < gpus:
        raise ValueError(f"a judge pool of {setup.judge_gpus} GPUs leaves no room for "
                         f"rollouts on {gpus}")
    started = clock()
    trajs = list(workload.trajectories)
    calls = {t.traj_id: judge_call(t, sizes, seed) for t in trajs}
    truth = None
    if spec.name == "oracle":
        truth = {t.traj_id: outcome_of(t) for t in [*trajs, *calls.values()]}
    n = len(trajs)
    if setup.mode is JudgeMode.DEDICATED:
        rollout_gpus = gpus - setup.judge_gpus
        rp = judged_policy(spec, cost, rollout_gpus, n, history, truth, seed)
        jp = judged_policy(spec, cost, setup.judge_gpus, n,
                           judge_history(history, sizes, seed), truth, seed)
        pool, judge_pool = rp.initial_pool(rollout_gpus), jp.initial_pool(setup.judge_gpus)
        run = run_dedicated(trajs, calls, rp, jp, cost, rollout_gpus, setup.judge_gpus,
                            pool, judge_pool, record_spans=record_spans)
        scheds = [rp, jp]
    else:
        rollout_gpus = gpus
        policy = judged_policy(spec, cost, gpus, n, history, truth, seed)
        pool = judge_pool = policy.initial_pool(gpus)
        run = run_shared_engines(trajs, calls, policy, cost, gpus, pool,
                                 after=setup.mode is JudgeMode.AFTER, record_spans=record_spans)
        scheds = [policy]
    if rollout_alone_s is None:
        rollout_alone_s = run.rollout_makespan_s if setup.mode is JudgeMode.AFTER else \
            simulate(workload, spec, cost, gpus, history=history, seed=seed)[0].makespan_s
    wall = clock() - started
    clusters = [run.rollouts] if run.judges is run.rollouts else [run.rollouts, run.judges]
    latencies = run.judge_latencies()
    digest = hashlib.sha256("".join(c.digest() for c in clusters).encode()).hexdigest()
    report = JudgeReport(
        policy=spec.label, judge=setup.label, rollout_gpus=rollout_gpus,
        judge_gpus=setup.judge_gpus, layout=layout_label(pool),
        judge_layout=layout_label(judge_pool), rollout_alone_makespan_s=rollout_alone_s,
        rollout_makespan_s=run.rollout_makespan_s, judged_makespan_s=run.judged_makespan_s,
        judged_over_rollout=run.judged_makespan_s / run.rollout_makespan_s,
        overhead=run.judged_makespan_s / rollout_alone_s - 1.0,
        judge_calls=len(calls),
        judge_prompt_tokens=sum(c.prompt_tokens for c in calls.values()),
        judge_output_tokens=sum(c.output_tokens for c in calls.values()),
        judge_latency_p50_s=statistics.median(latencies),
        judge_latency_max_s=max(latencies),
        preemptions=sum(s.preemptions for s in scheds),
        kv_evictions=sum(c.kv_evictions for c in clusters),
        events=sum(c.kernel.fired for c in clusters), sim_wall_s=wall, trace_digest=digest)
    return report, run
