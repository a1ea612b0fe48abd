"""The multi-step simulator: K RL steps of one workload on one cluster, rollout
phases and training steps, in one of four modes.

A training step k takes batch k — `batch_groups` complete GRPO groups — and makes
policy version k + 1; the rollout engines serve version v once it is published
(`Cluster.set_policy_version`, which the scheduler hears as `PolicyUpdated`). Groups
are launched in the order of a `PromptStream`. A delivered trajectory's staleness is
k minus the version of its oldest token (the version when it first joined an
engine); a group is delivered whole, oldest first, and never with a trajectory
staler than `max_staleness`: a group that could only be delivered staler is
restarted from its prompt at once (its tokens, finished siblings' too, are
discarded), the way prime-rl cancels stale groups.

Modes, and where the GPUs are:

- `sync` (colocated): launch a batch, wait for every group, train on all GPUs
  (the engines sleep, their KV freed), wake the engines with the new weights.
  Staleness 0; the tail of each batch decides the step.
- `overprovision` (colocated): keep ⌈batch·(1 + overprovision)⌉ groups launched
  and undelivered; the rollout phase ends when a batch of groups is complete
  (the first complete, oldest first); complete groups left over are carried to
  the next batch, groups still running are aborted — their tokens discarded — and
  relaunched first after the update (slime's over-sampling without partial
  rollouts).
- `partial` (colocated): as `overprovision`, but groups still running are carried
  across the update with the tokens they have (Kimi k1.5's and APRIL's partial
  rollouts); they re-prefill their context under the new weights.
- `async` (split): the trainer has `train_gpus` GPUs of its own, the engines the
  rest; rollouts never stop. A batch is taken as soon as the trainer is free and
  a batch of groups is complete; new weights reach the engines while they run (a
  short pause of `CostModel.weight_sync_time`, KV recomputed: running turns are
  evicted and re-prefill, cached prefixes dropped, so no KV of old weights serves
  a request of the new).

In every mode a group is launched only while a batch that could take it within
`max_staleness` has room (`StepsDriver._room`, AReaL's admission gate), so a group
is thrown away only when others overtook it.

Why colocated or split: without overlap, a trainer of its own would idle through
every rollout phase and the engines through every training step, so colocating
gives each phase all the GPUs; overlapping needs the two on different GPUs.
Training costs the same GPU-seconds a step in every mode: `train_s` on all GPUs
colocated, `train_s · gpus / train_gpus` split.

Deterministic: the same arguments give the same run, `trace_digest` included.
"""

from __future__ import annotations

import enum
import hashlib
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from treadle.core.cost_model import CostModel
from treadle.core.scheduler import Scheduler
from treadle.sim.cluster import Cluster
from treadle.sim.engine import SimEngine
from treadle.sim.stream import GroupDraw, PromptStream
from treadle.workloads import TrajectorySpec

DRIVER_ORDER = 50  # the driver acts after an instant's engine events, before decide()


class Mode(enum.Enum):
    SYNC = "sync"
    OVERPROVISION = "overprovision"
    ASYNC = "async"
    PARTIAL = "partial"

    @property
    def colocated(self) -> bool:
        return self is not Mode.ASYNC


@dataclass(frozen=True, slots=True)
class StepsConfig:
    """One run's settings; ValueError on a bad combination."""

    mode: Mode
    steps: int  # training steps (and batches)
    batch_groups: int  # groups in a batch
    train_s: float  # a training step on all GPUs (its GPU-seconds over the GPU count)
    max_staleness: int | None = 1  # versions; None: unbounded
    overprovision: float = 0.25  # extra share of a batch kept launched (not sync)
    train_gpus: int = 0  # the trainer's own GPUs (async only)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_groups < 1:
            raise ValueError(f"steps ({self.steps}) and batch_groups ({self.batch_groups}) "
                             "must be >= 1")
        if not (self.train_s >= 0 and math.isfinite(self.train_s)):
            raise ValueError(f"train_s must be finite and >= 0, got {self.train_s}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if not self.overprovision >= 0:
            raise ValueError(f"overprovision must be >= 0, got {self.overprovision}")
        if (self.mode is Mode.ASYNC) != (self.train_gpus > 0):
            raise ValueError("train_gpus (> 0) is for the async mode only, and it needs them")

    @property
    def cap(self) -> int:
        """Most groups launched and not yet delivered at any time."""
        if self.mode is Mode.SYNC:
            return self.batch_groups
        return math.ceil(self.batch_groups * (1.0 + self.overprovision) - 1e-9)


@dataclass(frozen=True, slots=True)
class StepsResult:
    """What one multi-step run measured."""

    makespan_s: float  # until the last training step ended
    trained_tokens: int  # output tokens of the delivered trajectories
    trained_tokens_per_gpu_s: float  # trained_tokens / (all GPUs × makespan)
    utilisation: float  # (engines' busy GPU-s + training GPU-s) / (all GPUs × makespan)
    staleness_p50: float  # over delivered trajectories, in versions
    staleness_max: int
    tokens_discarded: int  # sampled, then thrown away (restarted or aborted attempts)
    tokens_in_flight: int  # sampled by trajectories neither delivered nor discarded at the end
    groups_restarted: int  # group attempts thrown away
    length_bias: float  # mean delivered output over the stream's first batches' mean
    step_ends_s: tuple[float, ...]  # when each training step ended
    rollout_gpus: int
    train_gpus: int  # 0: colocated on all of them
    events: int
    trace_digest: str


@dataclass(slots=True, eq=False)
class _Group:
    draw: GroupDraw
    attempt: int = 0
    members: list[str] = field(default_factory=list)  # the current attempt's ids
    done: set[str] = field(default_factory=set)
    complete_at: float = 0.0


class StepsDriver:
    """Runs one multi-step configuration with one scheduler; `run()` once."""

    def __init__(self, cost: CostModel, gpus: int, scheduler: Scheduler, pool: list[int],
                 stream: PromptStream, config: StepsConfig, *, max_batch: int = 1024) -> None:
        self.cfg = config
        self.gpus = gpus
        self.rollout_gpus = gpus - config.train_gpus
        if self.rollout_gpus < 1:
            raise ValueError(f"train_gpus ({config.train_gpus}) leaves no GPU of {gpus} "
                             "for the engines")
        self.cost = cost
        self.stream = stream
        self.sched = scheduler
        self.cluster = Cluster(cost, self.rollout_gpus, scheduler, [], pool,
                               max_batch=max_batch, on_finish=self._finished)
        self.kernel = self.cluster.kernel
        self._member_of: dict[str, _Group] = {}
        self._running: dict[int, _Group] = {}  # by stream index, launch order
        self._complete: list[_Group] = []
        self._relaunch: deque[_Group] = deque()
        self._next_index = 0
        self._sealed = 0  # batches taken by the trainer
        self._trained = 0  # training steps done
        self._training = False
        self._poll_at: float | None = None
        self._staleness: list[int] = []
        self._trained_tokens = 0
        self._delivered = 0
        self._discarded = 0.0
        self._restarts = 0
        self._step_ends: list[float] = []
        self._end: float | None = None
        self._train_gpu_s = 0.0
        self._specs: dict[str, TrajectorySpec] = {}  # every attempt launched
        self._delivered_ids: list[str] = []
        self._discarded_ids: set[str] = set()
        self._delivered_groups: list[int] = []  # stream indices, in batch order

    # -- running ------------------------------------------------------------------------

    def run(self, max_events: int = 50_000_000) -> StepsResult:
        self.kernel.at(0.0, self._launch_more, order=DRIVER_ORDER)
        self.kernel.run(max_events=max_events)
        if self._end is None:
            raise RuntimeError(f"{self.cfg.mode.value}: {self._trained} of {self.cfg.steps} "
                               f"training steps done when the run stopped at "
                               f"t={self.kernel.now:.1f}")
        return self._result(self._end)

    def _result(self, end: float) -> StepsResult:
        in_flight = sum(self.cluster.sampled(tid) for g in self._running.values()
                        for tid in g.members if tid not in g.done)
        in_flight += sum(self._specs[tid].output_tokens for g in [*self._running.values(),
                                                             *self._complete]
                         for tid in g.done)
        for e in self.cluster.engines.values():
            e.advance(end)
        busy = sum(e.busy_s * e.tp for e in self.cluster.all_engines)
        stream_mean = statistics.fmean(
            s.output_tokens for i in range(self.cfg.steps * self.cfg.batch_groups)
            for s in self.stream.group(i).specs)
        delivered_mean = self._trained_tokens / max(1, self._delivered)
        return StepsResult(
            makespan_s=end, trained_tokens=self._trained_tokens,
            trained_tokens_per_gpu_s=self._trained_tokens / (self.gpus * end),
            utilisation=(busy + self._train_gpu_s) / (self.gpus * end),
            staleness_p50=statistics.median(self._staleness),
            staleness_max=max(self._staleness), tokens_discarded=round(self._discarded),
            tokens_in_flight=round(in_flight), groups_restarted=self._restarts,
            length_bias=delivered_mean / stream_mean, step_ends_s=tuple(self._step_ends),
            rollout_gpus=self.rollout_gpus, train_gpus=self.cfg.train_gpus,
            events=self.kernel.fired, trace_digest=self._digest())

    def _digest(self) -> str:
        h = hashlib.sha256(self.cluster.digest().encode())
        h.update(f"{self._step_ends} {self._staleness} {self._discarded:.3f}".encode())
        return h.hexdigest()

    # -- what became of the attempts (for reports and checks) ------------------------------

    def delivered_ids(self) -> list[str]:
        """Attempts delivered in a batch, in batch order."""
        return list(self._delivered_ids)

    def discarded_ids(self) -> set[str]:
        """Attempts thrown away (their group restarted)."""
        return set(self._discarded_ids)

    def in_flight_ids(self) -> set[str]:
        """Attempts launched and neither delivered nor discarded (at the end: those
        the run left running or waiting in a complete group)."""
        return {tid for g in [*self._running.values(), *self._complete] for tid in g.members}

    def groups(self) -> tuple[list[int], set[int], int]:
        """Stream indices of the groups delivered (in batch order) and of those
        launched and not delivered (running, complete or waiting to be launched
        again), and how many the stream has handed out."""
        pending = {g.draw.index for g in [*self._running.values(), *self._complete,
                                          *self._relaunch]}
        return list(self._delivered_groups), pending, self._next_index

    def spec(self, tid: str) -> TrajectorySpec:
        """The episode an attempt replays."""
        return self._specs[tid]

    # -- trajectories and groups -----------------------------------------------------------

    def _finished(self, tid: str) -> None:
        g = self._member_of[tid]
        g.done.add(tid)
        self.sched.forget(tid)
        if len(g.done) == len(g.members):
            g.complete_at = self.kernel.now
            del self._running[g.draw.index]
            self._complete.append(g)
            self._poll()

    def _poll(self) -> None:
        """Act on this instant's news after its engine events (not inside them)."""
        if self._poll_at != self.kernel.now:
            self._poll_at = self.kernel.now
            self.kernel.at(self.kernel.now, self._act, order=DRIVER_ORDER)

    def _act(self) -> None:
        self._poll_at = None
        if not self._training and self._end is None \
                and len(self._complete) >= self.cfg.batch_groups:
            self._seal()
        if not self.cfg.mode.colocated:
            self._launch_more()

    def _launch(self, g: _Group) -> None:
        g.members = []
        self._running[g.draw.index] = g
        for spec in g.draw.specs:
            run = self.stream.attempt(spec, g.attempt)
            g.members.append(run.traj_id)
            self._member_of[run.traj_id] = g
            self._specs[run.traj_id] = run
            self.cluster.launch(run)

    def _room(self) -> int:
        """How many groups may be launched and undelivered now: the mode's cap (a
        sync phase: one batch), and no more than the batches that could still take
        a group launched now hold: a group of version v goes into batch v + S at
        the latest, and batches from the next one to be taken up to that one hold
        (v + S + 1 − taken)·b groups (AReaL's admission gate). More would only be
        thrown away as stale."""
        s = self.cfg.max_staleness
        if s is None:
            return self.cfg.cap
        batches = self.cluster.policy_version + s + 1 - self._sealed
        return min(self.cfg.cap, batches * self.cfg.batch_groups)

    def _launch_more(self) -> None:
        """Launch groups, relaunches first, while there is `_room`."""
        if self._end is not None:
            return
        while len(self._running) + len(self._complete) < self._room():
            if self._relaunch:
                self._launch(self._relaunch.popleft())
            else:
                self._launch(_Group(self.stream.group(self._next_index)))
                self._next_index += 1

    def _oldest(self, g: _Group) -> int | None:
        """Version of the group's oldest sampled token (None: nothing sampled)."""
        versions = [v for tid in g.members
                    if (v := self.cluster.trajs[tid].first_version) is not None]
        return min(versions) if versions else None

    def _restart(self, g: _Group, reason: str) -> None:
        """Throw the group's attempt away and queue it to be launched again."""
        for tid in g.members:
            if tid in g.done:
                self._discarded += self._specs[tid].output_tokens
            else:
                self._discarded += self.cluster.abort(tid, reason)
            del self._member_of[tid]
            self._discarded_ids.add(tid)
        self._running.pop(g.draw.index, None)
        if g in self._complete:
            self._complete.remove(g)
        g.attempt += 1
        g.done = set()
        self._restarts += 1
        self._relaunch.append(g)

    # -- batches and training ---------------------------------------------------------------

    def _seal(self) -> None:
        """The trainer takes a batch: the oldest complete groups first."""
        index = self._sealed
        order = sorted(self._complete, key=lambda g: (self._oldest(g), g.complete_at,
                                                      g.draw.index))
        batch, self._complete = order[:self.cfg.batch_groups], order[self.cfg.batch_groups:]
        for g in batch:
            self._delivered_groups.append(g.draw.index)
            for tid in g.members:
                st = self.cluster.trajs[tid]
                assert st.first_version is not None  # it finished, so it ran
                self._staleness.append(index - st.first_version)
                self._trained_tokens += st.spec.output_tokens
                self._delivered += 1
                self._delivered_ids.append(tid)
        self._sealed += 1
        self._drop_stale()
        self._training = True
        now = self.kernel.now
        if self.cfg.mode.colocated:
            if self.cfg.mode is Mode.OVERPROVISION:
                for g in sorted(self._running.values(), key=lambda g: g.draw.index):
                    self._restart(g, "aborted at the weight update")
            train = self.cfg.train_s
            self.cluster.pause_engines(lambda e: now + train + self._sync(e), drop_kv=True)
            # Nothing is sampled until the engines wake with the new weights, so the
            # version can be announced now: the scheduler learns at once that a
            # batch was taken.
            self.cluster.set_policy_version(self._sealed)
        else:
            train = self.cfg.train_s * self.gpus / self.cfg.train_gpus
        self._train_gpu_s += self.cfg.train_s * self.gpus
        self.kernel.at(now + train, self._published, order=DRIVER_ORDER)

    def _drop_stale(self) -> None:
        """Restart every group that could now only be delivered staler than the bound."""
        s = self.cfg.max_staleness
        if s is None:
            return
        for g in sorted([*self._running.values(), *self._complete], key=lambda g: g.draw.index):
            oldest = self._oldest(g)
            if oldest is not None and self._sealed - oldest > s:
                self._restart(g, "stale")

    def _sync(self, e: SimEngine) -> float:
        return self.cost.weight_sync_time(e.tp)

    def _published(self) -> None:
        """Training step done: its weights go to the engines (version + 1)."""
        now = self.kernel.now
        self._training = False
        self._trained += 1
        self._step_ends.append(now)
        if not self.cfg.mode.colocated:
            self.cluster.pause_engines(lambda e: now + self._sync(e), drop_kv=True)
            self.cluster.set_policy_version(self._trained)
        if self._trained == self.cfg.steps:
            self._end = now
            self.kernel.stop()
            return
        self._launch_more()
        self._poll()
