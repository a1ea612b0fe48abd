"""`treadle bench judge --live`: the three ways of judging, run live on emulated engines.

The simulator's modes (`sim.judging`) carried out by the live runtime: each rollout
trajectory of the workload is replayed (`runtime.replay`) on emulated engine
processes started by the runtime's launcher from the policy's own pool, and its
judge call (`sim.judging.judge_call`: the same one-turn script the simulator runs)
is replayed after it:

- `shared`: as the rollout finishes, on the same runtime, as the scheduler's judge
  class (`Runtime.turns(..., judge=True)`);
- `after`: every call once the last rollout has finished, on the same runtime;
- `dedicated:G`: as the rollout finishes, on a second runtime of its own over G
  GPUs (its own engines, its own instance of the policy), the rollouts on the rest.

Both runtimes of a dedicated run share one clock, so every figure is in modelled
seconds from the first arrival (wall seconds / time scale). Each row beside the
same policy's rollout phase alone on all the GPUs, run live the same way (no
setup), gives judging's overhead. A rollout that fails (an engine error) is
counted in `errors` and gets no judge call; `after` waits for every rollout to
end, failed ones included. Limits: those of `bench live`
(the engines share this machine's cores with the runtime; a loaded machine adds
latency the model does not have).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from treadle.clock import ScaledClock
from treadle.core.cost_model import CostModel
from treadle.core.policies import PolicySpec
from treadle.core.predictor import Outcome
from treadle.runtime.driver import Runtime
from treadle.runtime.launcher import EmulatedProcess, LocalLauncher
from treadle.runtime.replay import ReplayResult, replay
from treadle.sim.judging import (
    JudgeMode,
    JudgeSetup,
    JudgeSizes,
    judge_call,
    judge_history,
    judged_policy,
)
from treadle.sim.runner import MAX_BATCH, layout_label
from treadle.workloads import TrajectorySpec, Workload

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LiveJudged:
    """One policy under one judge mode, live (modelled seconds from the first arrival)."""

    policy: str
    judge: str  # shared | after | dedicated:G
    layout: str  # the rollout pool
    judge_layout: str  # the pool the judge calls ran on
    rollout_makespan_s: float  # when the last rollout finished
    judged_makespan_s: float  # when the last judgement finished
    first_verdict_s: float  # when the first judgement finished (0: none)
    overhead: float  # judged_makespan_s / the rollout phase alone's - 1 (0 for it)
    judge_latency_max_s: float  # a call's rollout finish to its verdict, at most
    errors: int  # replays that failed (engine errors)
    wall_s: float


def _runtime(spec: PolicySpec, cost: CostModel, gpus: int, n: int,
             history: Sequence[Outcome], clock: ScaledClock, *, model: str, gpu: str,
             seed: int, time_scale: float) -> tuple[Runtime, str]:
    scheduler = judged_policy(spec, cost, gpus, n, history, None, seed)
    layout = layout_label(scheduler.initial_pool(gpus))
    launcher = LocalLauncher(EmulatedProcess(model, gpu, time_scale=time_scale,
                                             max_num_seqs=MAX_BATCH, seed=seed))
    return Runtime(scheduler, launcher=launcher, gpus=gpus, clock=clock,
                   engine_wait_s=30.0), layout


async def live_judged(workload: Workload, spec: PolicySpec, cost: CostModel, gpus: int,
                      setup: JudgeSetup | None, *, sizes: JudgeSizes, time_scale: float,
                      history: Sequence[Outcome] = (), seed: int = 0, model: str, gpu: str,
                      rollout_alone_s: float | None = None,
                      log: Log | None = None) -> LiveJudged:
    """Every trajectory of `workload` replayed and judged once in `setup`'s mode
    (None: the rollout phase alone, no judging, on all the GPUs); `rollout_alone_s`,
    that phase's makespan, for the overhead (required with a setup)."""
    if setup is not None and rollout_alone_s is None:
        raise ValueError("a judged run needs the rollout phase alone's makespan")
    trajs = list(workload.trajectories)
    calls = {t.traj_id: judge_call(t, sizes, seed) for t in trajs}
    clock = ScaledClock(time_scale)
    dedicated = setup is not None and setup.mode is JudgeMode.DEDICATED
    rollout_gpus = gpus - setup.judge_gpus if setup is not None and dedicated else gpus
    rollouts, layout = _runtime(spec, cost, rollout_gpus, len(trajs), history, clock,
                                model=model, gpu=gpu, seed=seed, time_scale=time_scale)
    judges, judge_layout = rollouts, layout
    if setup is not None and dedicated:
        judges, judge_layout = _runtime(spec, cost, setup.judge_gpus, len(trajs),
                                        judge_history(history, sizes, seed), clock,
                                        model=model, gpu=gpu, seed=seed,
                                        time_scale=time_scale)
    finished: dict[str, float] = {}  # a completed rollout's finish, by trajectory id
    ended = 0  # rollouts over, completed or failed
    all_rolled = asyncio.Event()
    started_wall = time.monotonic()

    async def judged(call: TrajectorySpec) -> ReplayResult:
        # On a pool of its own a call is the only work there: the ordinary class.
        return await replay(call, judges.turns(call.traj_id, call.group_id,
                                               judge=not dedicated), clock)

    async def one(t: TrajectorySpec) -> tuple[ReplayResult, ReplayResult | None]:
        nonlocal ended
        try:
            rolled = await replay(t, rollouts.turns(t.traj_id, t.group_id), clock)
            finished[t.traj_id] = rolled.finished_at
        finally:
            ended += 1
            if ended == len(trajs):
                all_rolled.set()
            if log is not None and ended % max(1, len(trajs) // 4) == 0:
                log(f"  {ended}/{len(trajs)} rollouts done at "
                    f"t={clock.now() - started:.0f}s (modelled)")
        if setup is None:
            return rolled, None
        if setup.mode is JudgeMode.AFTER:
            await all_rolled.wait()
        return rolled, await judged(calls[t.traj_id])

    await rollouts.start()
    try:
        if dedicated:
            await judges.start()
        try:
            started = clock.now()
            done = await asyncio.gather(*(one(t) for t in trajs), return_exceptions=True)
        finally:
            if dedicated:
                await judges.close()
    finally:
        await rollouts.close()
    ok = [d for d in done if not isinstance(d, BaseException)]
    errors = len(done) - len(ok)
    if not ok:
        raise RuntimeError(f"every replay failed: {done[0]!r}")
    verdicts = [(r, j) for r, j in ok if j is not None]
    rolled_at = max(r.finished_at for r, _ in ok) - started
    judged_at = max((j.finished_at - started for _, j in verdicts), default=rolled_at)
    return LiveJudged(
        policy=spec.label, judge="none" if setup is None else setup.label, layout=layout,
        judge_layout=judge_layout, rollout_makespan_s=rolled_at,
        judged_makespan_s=judged_at,
        first_verdict_s=min((j.finished_at - started for _, j in verdicts), default=0.0),
        overhead=judged_at / (rollout_alone_s or rolled_at) - 1.0,
        judge_latency_max_s=max((j.finished_at - finished[r.traj_id] for r, j in verdicts),
                                default=0.0),
        errors=errors, wall_s=time.monotonic() - started_wall)
