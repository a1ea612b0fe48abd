"""The multi-step simulator (`treadle.sim.steps`, `sim.steps_runner`, `sim.stream`):
each mode's invariants — no trajectory delivered staler than the bound, none lost or
delivered twice, discarded tokens counted —, the lower bound below every run, the
scheduler told of every version, its predictor learning across steps, determinism."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import pytest

from treadle.core.cost_model import CostModel
from treadle.core.events import (
    Decision,
    Event,
    PolicyUpdated,
    TrajectoryArrived,
    TrajectoryEnded,
    TurnFinished,
    TurnPreempted,
)
from treadle.core.policies import build_policy, parse_policy
from treadle.core.policies.progressive import Progressive
from treadle.core.predictor import Predictor
from treadle.core.scheduler import Scheduler, TrajectoryScheduler
from treadle.sim.runner import MAX_BATCH, history_for
from treadle.sim.steps import Mode, StepsConfig, StepsDriver, StepsResult
from treadle.sim.steps_runner import StepsPlan, epoch_source, simulate_steps
from treadle.sim.stream import PromptStream

GPUS, GROUPS, GROUP = 8, 8, 16  # 128 trajectories a step on 8 GPUs


@functools.cache
def _cost() -> CostModel:
    return CostModel.named("qwen3-14b", "h100")


def _stream(workload: str = "coding", per_prompt: bool = True, seed: int = 0,
            prompts: int = 2 * GROUPS) -> PromptStream:
    return PromptStream(workload, epoch_source(workload, prompts, GROUP, seed, 40960),
                        prompts, GROUP, per_prompt=per_prompt)


@functools.cache
def _plan(steps: int = 4, staleness: int | None = 1, workload: str = "coding") -> StepsPlan:
    return StepsPlan(_stream(workload), _cost(), GPUS, steps=steps, batch_groups=GROUPS,
                     train_fraction=0.3, max_staleness=staleness, train_gpus=2)


def _train_s(workload: str) -> float:
    return _plan(workload=workload).train_s


def _config(mode: Mode, steps: int = 4, staleness: int | None = 1,
            workload: str = "coding") -> StepsConfig:
    return _plan(steps, staleness, workload).config(mode)


@dataclass
class SpyScheduler(Scheduler):
    """Test double: forwards to a real policy and records events and decisions."""

    inner: TrajectoryScheduler
    events: list[tuple[float, Event]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name = self.inner.name

    def initial_pool(self, gpus: int) -> list[int]:
        return self.inner.initial_pool(gpus)

    def on_event(self, event: Event, now: float) -> None:
        self.events.append((now, event))
        self.inner.on_event(event, now)

    def decide(self, now: float) -> list[Decision]:
        return self.inner.decide(now)

    def wakeup(self) -> float | None:
        return self.inner.wakeup()

    def forget(self, traj_id: str) -> None:
        self.inner.forget(traj_id)


def _run(mode: Mode, policy: str = "treadle", *, steps: int = 4, staleness: int | None = 1,
         workload: str = "coding", per_prompt: bool = True,
         seed: int = 0) -> tuple[StepsResult, SpyScheduler, StepsDriver]:
    cost = _cost()
    spy = SpyScheduler(build_policy(parse_policy(policy), cost, batch_size=GROUPS * GROUP,
                                    history=history_for(workload, GROUPS * GROUP, seed),
                                    max_batch=MAX_BATCH))
    cfg = _config(mode, steps, staleness, workload)
    driver = StepsDriver(cost, GPUS, spy, spy.initial_pool(GPUS - cfg.train_gpus),
                         _stream(workload, per_prompt, seed), cfg, max_batch=MAX_BATCH)
    return driver.run(), spy, driver


@functools.cache
def _cached(mode: Mode, policy: str) -> tuple[StepsResult, SpyScheduler, StepsDriver]:
    return _run(mode, policy)


MODES = list(Mode)


# -- invariants of every mode ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_nothing_is_delivered_staler_than_the_bound(mode: Mode) -> None:
    result, _, driver = _cached(mode, "verl")
    assert result.staleness_max <= 1
    assert max(driver._staleness) == result.staleness_max
    assert len(driver._staleness) == 4 * GROUPS * GROUP  # every batch full
    if mode is Mode.SYNC:
        assert result.staleness_max == 0 and result.tokens_discarded == 0


@pytest.mark.parametrize("mode", MODES)
def test_no_trajectory_is_lost_or_delivered_twice(mode: Mode) -> None:
    """Every attempt the scheduler heard of ended exactly one way — delivered in a
    batch, restarted (its tokens discarded), or still running at the end — and no
    stream group was delivered twice."""
    _, spy, driver = _cached(mode, "verl")
    arrived = [e.traj_id for _, e in spy.events if isinstance(e, TrajectoryArrived)]
    assert len(arrived) == len(set(arrived))
    ended = {e.traj_id for _, e in spy.events if isinstance(e, TrajectoryEnded)}
    finished = {e.traj_id for _, e in spy.events if isinstance(e, TurnFinished) and e.final}
    assert not ended & finished
    delivered = driver.delivered_ids()
    assert len(delivered) == len(set(delivered)) == 4 * GROUPS * GROUP
    assert set(delivered) <= finished
    in_flight = driver.in_flight_ids()
    discarded = driver.discarded_ids()
    assert set(arrived) == set(delivered) | in_flight | discarded
    assert not (set(delivered) & (in_flight | discarded)) and not in_flight & discarded
    groups = Counter(tid.rsplit("-r", 1)[0] for tid in delivered)
    assert all(n == GROUP for n in groups.values())
    # Every group the stream handed out is delivered once, or still pending.
    done, pending, handed_out = driver.groups()
    assert len(done) == len(set(done)) == 4 * GROUPS
    assert set(done) | pending == set(range(handed_out)) and not set(done) & pending


@pytest.mark.parametrize("mode", [Mode.OVERPROVISION, Mode.ASYNC, Mode.PARTIAL])
def test_discarded_tokens_are_those_of_the_restarted_attempts(mode: Mode) -> None:
    """The tokens counted as discarded are at least the finished turns of every
    attempt thrown away, and exceed them by no more than one unfinished turn each."""
    result, spy, driver = _cached(mode, "verl")
    discarded = driver.discarded_ids()
    assert discarded and result.groups_restarted > 0
    done_turns: Counter[str] = Counter()
    for _, e in spy.events:
        if isinstance(e, TurnFinished) and e.traj_id in discarded:
            done_turns[e.traj_id] += e.output_tokens
    aborted = {e.traj_id for _, e in spy.events if isinstance(e, TrajectoryEnded)}
    slack = sum(max(t.output_tokens for t in driver.spec(tid).turns) for tid in aborted)
    assert sum(done_turns.values()) <= result.tokens_discarded \
        <= sum(done_turns.values()) + slack


@pytest.mark.parametrize("mode", MODES)
def test_the_scheduler_hears_every_version_once_in_order(mode: Mode) -> None:
    result, spy, _ = _cached(mode, "verl")
    updates = [(t, e.version) for t, e in spy.events if isinstance(e, PolicyUpdated)]
    assert [v for _, v in updates] == [1, 2, 3, 4]
    if mode is Mode.ASYNC:  # the weights reach the engines when the step ends
        assert [t for t, _ in updates] == pytest.approx(list(result.step_ends_s))


@pytest.mark.parametrize("mode", [Mode.ASYNC, Mode.PARTIAL])
def test_no_kv_of_old_weights_survives_an_update(mode: Mode) -> None:
    """At each update the turns running then lose their KV (`TurnPreempted`, to
    re-prefill under the new weights; colocated: when the trainer takes the GPUs).
    (Over-provisioning aborts them instead; sync has none running.)"""
    _, spy, _ = _cached(mode, "verl")
    updates = [t for t, e in spy.events if isinstance(e, PolicyUpdated)]
    dropped = Counter(t for t, e in spy.events if isinstance(e, TurnPreempted))
    assert all(dropped[t] > 0 for t in updates[:-1])  # the last one ends the run


@pytest.mark.parametrize("mode", MODES)
def test_the_lower_bound_is_below_every_run(mode: Mode) -> None:
    cost, stream = _cost(), _stream()
    cfg = _config(mode)
    bound = _plan().bound(cfg)
    for policy in ("verl", "verl@tp4", "treadle"):
        row = simulate_steps(policy, stream, cost, GPUS, cfg, bound,
                             history=history_for("coding", GROUPS * GROUP, 0))
        assert row.makespan_s >= bound.makespan_s
        assert row.ratio_to_lower_bound >= 1.0


@pytest.mark.parametrize("mode", [Mode.PARTIAL, Mode.ASYNC])
def test_a_run_is_deterministic_and_a_seed_changes_it(mode: Mode) -> None:
    a, _, da = _run(mode, "treadle")
    b, _, db = _run(mode, "treadle")
    c, _, _ = _run(mode, "treadle", seed=1)
    assert a == b and da.delivered_ids() == db.delivered_ids()
    assert a.trace_digest != c.trace_digest


def test_async_trains_on_its_own_gpus_and_colocated_modes_on_all() -> None:
    a, _, _ = _cached(Mode.ASYNC, "verl")
    s, _, _ = _cached(Mode.SYNC, "verl")
    assert (a.rollout_gpus, a.train_gpus) == (GPUS - 2, 2)
    assert (s.rollout_gpus, s.train_gpus) == (GPUS, 0)
    # Sync: a step is its rollout, then training on all GPUs for train_s.
    gaps = [b - a for a, b in zip((0.0, *s.step_ends_s), s.step_ends_s, strict=False)]
    assert all(g > _train_s("coding") for g in gaps)


# -- the scheduler across steps -------------------------------------------------------------------


def test_the_predictor_learns_across_steps_and_meets_each_prompt_again() -> None:
    """One scheduler lives through the run: its predictor has learnt every finished
    trajectory of the earlier steps, and in the second epoch a prompt's earlier
    samples are its group's evidence from the first arrival on."""
    _, spy, _ = _run(Mode.SYNC, "treadle", steps=3)
    policy = spy.inner
    assert isinstance(policy, Progressive) and isinstance(policy.est, Predictor)
    history = len(history_for("coding", GROUPS * GROUP, 0))
    assert policy.est.outcomes == history + 3 * GROUPS * GROUP


def test_config_rejects_a_split_outside_async() -> None:
    with pytest.raises(ValueError, match="async"):
        StepsConfig(Mode.SYNC, 2, 4, 1.0, train_gpus=8)
    with pytest.raises(ValueError, match="async"):
        StepsConfig(Mode.ASYNC, 2, 4, 1.0)


def test_an_attempts_id_names_the_episode_it_replays() -> None:
    spec = _stream().group(3).specs[0]
    for attempt in (1, 2, 12):
        run = PromptStream.attempt(spec, attempt)
        assert run.traj_id != spec.traj_id
        assert PromptStream.episode_of(run.traj_id) == spec.traj_id
    assert PromptStream.episode_of(spec.traj_id) == spec.traj_id
