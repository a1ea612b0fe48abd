"""Remaining-work predictor: how much more each live trajectory will sample, how many
more turns it will take and how long its tools will still run.

The trajectory scheduler asks after every turn and tool result (Heddle's progressive
priority: longer predicted remaining work runs first; placement puts predicted long
trajectories on faster engines). Three signals are blended in log space, in this
order (lengths are heavy-tailed and multiplicative, so errors are ratios):

1. **Length distribution, conditioned on progress.** Finished totals (the `history`
   warm start plus every trajectory finished in this run) sit in a log-bucket
   histogram with Fenwick trees over per-bucket counts and sums of ``ln L``, so
   ``E[ln L | L > x]`` at tokens-so-far ``x`` costs O(log buckets), as does adding
   an outcome; within ``x``'s own bucket the values above ``x`` are interpolated
   from the bucket's min, max and mean. With heavy tails this grows with ``x``: a
   trajectory that has already run long is expected to run longer still. It is
   the expectation of ``ln L``, not of ``L``, on purpose: the plain mean of a heavy
   tail is ruled by a few huge outcomes and, mixed with the tight group estimates
   of signal 2, ranks uninformed trajectories too high; on the tests' synthetic
   workload the log form scored better in recall, rank correlation and relative
   error alike. So the total is a *typical* total given progress (a mean of work
   would be larger by the spread). One pseudo-observation of a tail prior
   ``max(TAIL_GROWTH·x, x + 2·r)`` (``r``: tokens per turn) keeps it sane where
   data above ``x`` is sparse, and is the whole answer with no data (cold start:
   two more turns of the trajectory's per-turn size, or half again what it has).
2. **Group siblings** (Seer: samples of one prompt finish at similar lengths). The
   group centre ``mu`` is the censored maximum-likelihood fit of a lognormal with
   the pooled within-group log spread (learnt from all groups): finished members
   (of this run, or of `history` should the group recur) are exact; running members
   (the 64 furthest along) count as "longer than their progress so far" — without
   them ``mu`` is biased low, as the short siblings finish first. The group's
   estimate for a member at ``x`` is ``E[ln L | L > x]`` under that lognormal, so a
   member that outlived its siblings is predicted a little past its progress, never
   below it. Its blend weight is ``n / (n + k0)``: ``n`` the finished siblings plus
   the running ones' Fisher information, ``k0`` the within- over between-group log
   variance (empirical-Bayes shrinkage, learnt online, clamped). Used once at least
   one sibling finished, unless `use_groups` is False.
3. **Progress.** After ``k >= 1`` turns the total is also estimated as ``x + r·(T̂ -
   k)``, with ``r`` the trajectory's tokens per turn (its own mean, shrunk toward
   the finished mean by one pseudo-turn) and ``T̂ = exp E[ln T | T > k]`` from a
   second log histogram, of finished turn counts (tail prior ``max(1.5·k, k + 1)``).
   Its blend weight ``k / (k + PROGRESS_PSEUDO)`` grows as the rate firms up.
   Remaining turns are remaining tokens over ``r`` (at least 1); remaining tool
   time is remaining tool calls times the mean latency per call (its own, shrunk
   toward the finished mean by one call).

Contracts: estimates are finite and >= 0; a live trajectory's total is at least its
tokens so far plus one (one more turn samples at least one token) and at most
`max_tokens` if given and not yet passed; remaining turns are >= 1 while live. After
`finished`, `estimate` gives the actual total and zero remaining work until
`forget`. Unknown ids raise `KeyError` naming the id. Deterministic (no randomness;
insertion-ordered dicts). Estimates are cached per trajectory until its own events,
its group's events or any new outcome: repeated queries are O(1), a recomputation is
O(log buckets) plus the group fit, O(group size) and cached per group state; members
with no progress yet share one computation a group state.

Limits: prompt length is recorded but not used; history weighs like this run's
outcomes (no recency decay); state is kept for every group seen (a few hundred bytes
each) and for a finished trajectory until `forget`. A trajectory that ended
abnormally (cancelled, limits, failure) should be dropped with `forget`, not taught
with `finished`: truncated lengths would bias the distributions.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from treadle.core.log_histogram import LogHistogram, log_len

# Tail prior: with no data above x, a Pareto tail of index 3 has E[L | L > x] = 1.5·x;
# the prior weighs as one observation (`log_histogram.TAIL_PSEUDO`).
TAIL_GROWTH = 1.5
# Progress weight k / (k + PROGRESS_PSEUDO) after k turns: the per-turn rate of one
# turn is noisy, of several telling. 2 scored best of 0.5, 1, 2, 4 on the tests'
# synthetic workload.
PROGRESS_PSEUDO = 2.0
# Cold start: tokens per turn and tool seconds per call before anything finished.
DEFAULT_TURN_TOKENS = 512.0
DEFAULT_TOOL_S = 0.5
# Pseudo-counts pulling a trajectory's own per-turn and per-call means toward the
# means of finished trajectories (one turn, one call).
RATE_PSEUDO = 1.0
TOOL_PSEUDO = 1.0
# Within-group log spread: prior value and weight (degrees of freedom) until groups
# with two or more finished members teach it; clamped to a sane range.
PRIOR_WITHIN_SD = 0.5
PRIOR_WITHIN_DF = 4.0
WITHIN_SD_RANGE = (0.05, 3.0)
# Group shrinkage k0 = within / between log variance: default until three outcomes
# exist; clamped so that neither signal is ever ignored outright.
DEFAULT_GROUP_PSEUDO = 1.0
GROUP_PSEUDO_RANGE = (0.25, 16.0)
# Beyond this z the normal tail ratio comes from its asymptote (erfc underflows
# near 38; the asymptote's error there is below 0.1%).
_Z_MAX = 30.0
_SQRT1_2 = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# Censored group fit: Newton iterations, tolerance, step cap (in sds), and the most
# running members it uses (the furthest along: they carry the information).
_FIT_ITERS = 8
_FIT_TOL = 1e-4
_FIT_MAX_STEP = 3.0
_FIT_MAX_RUNNING = 64


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished trajectory, used for the warm start and learnt online."""

    group_id: str
    prompt_tokens: int
    output_tokens: int  # total sampled over all turns
    turns: int
    tool_time_s: float  # summed tool latency
    observation_tokens: int = 0  # tool output appended to its context, all calls


class Estimate(NamedTuple):
    """Predicted work of one trajectory; all fields finite and >= 0. A tuple of
    floats, which Python's cyclic collector stops tracking: a large batch holds one
    an estimated trajectory, and tracked ones made its full collections slower."""

    total_tokens: float  # predicted total output tokens (>= tokens so far)
    remaining_tokens: float
    remaining_turns: float
    remaining_tool_s: float


@dataclass(slots=True)
class _LogStats:
    """Count, mean and sum of squared deviations of log lengths (Welford)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, v: float) -> float:
        """Adds v; returns the increase of m2 (to keep pooled sums in step)."""
        self.n += 1
        delta = v - self.mean
        self.mean += delta / self.n
        inc = delta * (v - self.mean)
        self.m2 += inc
        return inc


@dataclass(slots=True, eq=False)
class _Group:
    """One group: its finished members' log lengths and its running members."""

    group_id: str
    finished: _LogStats = field(default_factory=_LogStats)
    running: dict[str, _Live] = field(default_factory=dict)  # ordered: deterministic fit
    version: int = 0  # bumped whenever the group's evidence changes
    fit: tuple[float, float] | None = None  # (log centre, effective members)
    fit_key: tuple[int, int] = (-1, -1)  # (predictor epoch, version) of the fit
    # The estimate of a member with no progress yet (`_Live.fresh`): it depends on
    # the group and the predictor's state only, so siblings share it.
    fresh: Estimate | None = None
    fresh_key: tuple[int, int] = (-1, -1)  # (predictor epoch, version) of `fresh`


@dataclass(slots=True, eq=False)
class _Live:
    """What the predictor knows about one trajectory."""

    group: _Group
    prompt_tokens: int
    tokens: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_s: float = 0.0
    in_tool: bool = False  # a turn finished and its tool result is pending
    done: bool = False
    cache: Estimate | None = None
    cache_key: tuple[int, int] = (-1, -1)  # (predictor epoch, group version)

    @property
    def fresh(self) -> bool:
        """Nothing sampled, no turn or tool call yet: its estimate is its group's
        (`_compute` reads nothing else of it; the prompt is not used)."""
        return not (self.tokens or self.turns or self.tool_calls or self.in_tool
                    or self.done) and self.tool_s == 0.0


def _hazard(a: float) -> float:
    """Inverse Mills ratio φ(a) / Q(a) of the standard normal."""
    if a > _Z_MAX:
        return a + 1.0 / a  # asymptote: erfc would underflow
    return _INV_SQRT_2PI * math.exp(-0.5 * a * a) / (0.5 * math.erfc(a * _SQRT1_2))


def _tail_log_mean(mu: float, sigma: float, x: float) -> float:
    """E[ln L | L > x] for ln L ~ Normal(mu, sigma²); >= ln x."""
    if x <= 1.0:
        return max(mu, 0.0)
    lx = math.log(x)
    return max(lx, mu + sigma * _hazard((lx - mu) / sigma))


def _check(name: str, v: float) -> None:
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {v}")


class Predictor:
    """Online remaining-work predictor; see the module docstring for the method.

    Event methods raise `KeyError` for an unknown trajectory and `ValueError` for
    negative counts or latencies and for events after `finished`. `max_tokens`, if
    given, caps predicted totals (the sampling limit). `use_groups=False` turns
    signal 2 off (a progress-only predictor, for baselines and ablations).
    """

    def __init__(
        self,
        history: Sequence[Outcome] = (),
        *,
        max_tokens: int | None = None,
        use_groups: bool = True,
    ) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self._max_tokens = max_tokens
        self._use_groups = use_groups
        self._hist = LogHistogram()  # finished totals
        self._turn_hist = LogHistogram()  # finished turn counts
        self._all = _LogStats()  # log totals of every outcome
        self._groups: dict[str, _Group] = {}
        self._within_ss = 0.0  # pooled within-group sum of squared log deviations
        self._within_df = 0  # sum over groups of (finished members - 1)
        self._out_tokens = 0  # sums over outcomes: the finished per-turn mean ...
        self._out_turns = 0
        self._out_tool_s = 0.0  # ... and the finished latency per call
        self._out_tool_calls = 0
        self._live: dict[str, _Live] = {}
        self._epoch = 0  # bumped on every outcome: it changes every estimate
        for outcome in history:
            self._learn(outcome)

    # -- events ---------------------------------------------------------------

    def arrived(self, traj_id: str, group_id: str, prompt_tokens: int) -> None:
        """A new trajectory; its id must not be tracked already."""
        if traj_id in self._live:
            raise ValueError(f"trajectory {traj_id!r} is already tracked")
        _check("prompt_tokens", prompt_tokens)
        g = self._group(group_id)
        self._live[traj_id] = g.running[traj_id] = _Live(g, prompt_tokens)
        # No progress yet, so the group's evidence (and version) is unchanged.

    def turn_finished(self, traj_id: str, output_tokens: int) -> None:
        """A turn sampled `output_tokens`; a tool call (or the end) follows."""
        t = self._running(traj_id)
        _check("output_tokens", output_tokens)
        t.tokens += output_tokens
        t.turns += 1
        t.in_tool = True
        t.cache = None
        t.group.version += 1  # its progress is evidence about its siblings

    def tool_finished(self, traj_id: str, latency_s: float) -> None:
        """The tool call after the last turn returned after `latency_s` seconds."""
        t = self._running(traj_id)
        _check("latency_s", latency_s)
        t.tool_calls += 1
        t.tool_s += latency_s
        t.in_tool = False
        t.cache = None

    def finished(self, traj_id: str) -> None:
        """The trajectory completed normally; its outcome is learnt at once."""
        t = self._running(traj_id)
        t.done = True
        t.cache = None
        del t.group.running[traj_id]
        self._learn(Outcome(t.group.group_id, t.prompt_tokens, t.tokens, t.turns, t.tool_s))

    def forget(self, traj_id: str) -> None:
        """Drops the trajectory's state: after `finished`, or instead of it for a
        trajectory that ended abnormally (then nothing is learnt from it)."""
        t = self._get(traj_id)
        del self._live[traj_id]
        if not t.done:
            del t.group.running[traj_id]
            t.group.version += 1

    # -- queries --------------------------------------------------------------

    def estimate(self, traj_id: str) -> Estimate:
        """Predicted total and remaining work of a tracked trajectory."""
        t = self._get(traj_id)
        key = (self._epoch, t.group.version)
        if t.cache is None or t.cache_key != key:
            if t.done:
                t.cache = Estimate(float(t.tokens), 0.0, 0.0, 0.0)
            elif t.fresh:
                # A batch's arrival asks for every member of every group: computed
                # once a group, not once a trajectory.
                g = t.group
                if g.fresh is None or g.fresh_key != key:
                    g.fresh, g.fresh_key = self._compute(t), key
                t.cache = g.fresh
            else:
                t.cache = self._compute(t)
            t.cache_key = key
        return t.cache

    @property
    def outcomes(self) -> int:
        """Outcomes learnt so far (history plus finished trajectories)."""
        return self._hist.n

    def __len__(self) -> int:
        """Trajectories tracked (live, or finished and not yet forgotten)."""
        return len(self._live)

    # -- internals ------------------------------------------------------------

    def _get(self, traj_id: str) -> _Live:
        t = self._live.get(traj_id)
        if t is None:
            raise KeyError(f"unknown trajectory {traj_id!r}: never arrived, or forgotten")
        return t

    def _running(self, traj_id: str) -> _Live:
        t = self._get(traj_id)
        if t.done:
            raise ValueError(f"trajectory {traj_id!r} already finished")
        return t

    def _group(self, group_id: str) -> _Group:
        g = self._groups.get(group_id)
        if g is None:
            g = self._groups[group_id] = _Group(group_id)
        return g

    def _learn(self, o: Outcome) -> None:
        for name in ("prompt_tokens", "output_tokens", "turns", "tool_time_s"):
            _check(name, getattr(o, name))
        self._hist.add(o.output_tokens)
        self._turn_hist.add(o.turns)
        v = log_len(o.output_tokens)
        self._all.add(v)
        g = self._group(o.group_id)
        self._within_ss += g.finished.add(v)
        self._within_df += int(g.finished.n > 1)
        g.version += 1
        self._out_tokens += o.output_tokens
        self._out_turns += o.turns
        if o.turns > 1:  # a tool call follows every turn but the last
            self._out_tool_s += o.tool_time_s
            self._out_tool_calls += o.turns - 1
        self._epoch += 1

    def _turn_rate(self, t: _Live) -> float:
        turns = self._out_turns
        prior = max(1.0, self._out_tokens / turns) if turns else DEFAULT_TURN_TOKENS
        return (t.tokens + RATE_PSEUDO * prior) / (t.turns + RATE_PSEUDO)

    def _tool_rate(self, t: _Live) -> float:
        calls = self._out_tool_calls
        prior = self._out_tool_s / calls if calls else DEFAULT_TOOL_S
        return (t.tool_s + TOOL_PSEUDO * prior) / (t.tool_calls + TOOL_PSEUDO)

    def _within_sd(self) -> float:
        var = (self._within_ss + PRIOR_WITHIN_DF * PRIOR_WITHIN_SD**2) / (
            self._within_df + PRIOR_WITHIN_DF
        )
        return min(WITHIN_SD_RANGE[1], max(WITHIN_SD_RANGE[0], math.sqrt(var)))

    def _group_pseudo(self, within_sd: float) -> float:
        """k0 = within-group / between-group log variance."""
        if self._all.n < 3:
            return DEFAULT_GROUP_PSEUDO
        within = within_sd * within_sd
        between = self._all.m2 / (self._all.n - 1) - within
        lo, hi = GROUP_PSEUDO_RANGE
        return hi if between <= within / hi else min(hi, max(lo, within / between))

    def _group_fit(self, g: _Group, sd: float) -> tuple[float, float]:
        """(mu, n_eff) of a group with a finished member: the log centre maximising
        the censored normal likelihood (finished members exact, running ones longer
        than their progress), and the finished count plus the running members'
        Fisher information. The log-likelihood is concave, so Newton converges in a
        few steps (each capped for safety). Cached per (epoch, group version)."""
        key = (self._epoch, g.version)
        if g.fit is not None and g.fit_key == key:
            return g.fit
        progress = [m.tokens for m in g.running.values() if m.tokens > 1]
        if len(progress) > _FIT_MAX_RUNNING:  # bounds the cost in huge groups
            progress = heapq.nlargest(_FIT_MAX_RUNNING, progress)
        cens = [math.log(v) for v in progress]
        n_f, mean_f = g.finished.n, g.finished.mean
        mu = mean_f
        info = 0.0
        for _ in range(_FIT_ITERS):
            score = n_f * (mean_f - mu)  # d loglik / d mu, times sd²
            info = 0.0
            for c in cens:
                a = (c - mu) / sd
                lam = _hazard(a)
                score += sd * lam
                info += lam * (lam - a)  # in (0, 1): a fraction of one member
            step = min(score / (n_f + info), _FIT_MAX_STEP * sd)
            mu += step
            if abs(step) < _FIT_TOL:
                break
        g.fit = (mu, n_f + info)
        g.fit_key = key
        return g.fit

    def _compute(self, t: _Live) -> Estimate:
        x = float(t.tokens)
        rate = self._turn_rate(t)
        # 1: population E[ln L | L > x].
        log_total = self._hist.log_mean_above(x, log_len(max(TAIL_GROWTH * x, x + 2 * rate)))
        g = t.group
        if self._use_groups and g.finished.n:  # 2: shrink toward the group
            sd = self._within_sd()
            mu, n_eff = self._group_fit(g, sd)
            w = n_eff / (n_eff + self._group_pseudo(sd))
            log_total += w * (_tail_log_mean(mu, sd, x) - log_total)
        if t.turns:  # 3: per-turn rate times expected remaining turns
            k = t.turns
            prior = math.log(max(TAIL_GROWTH * k, k + 1.0))
            more_turns = math.exp(self._turn_hist.log_mean_above(k, prior)) - k
            w = k / (k + PROGRESS_PSEUDO)
            log_total += w * (log_len(x + rate * more_turns) - log_total)
        total = math.exp(log_total)
        if self._max_tokens is not None:
            total = min(total, float(self._max_tokens))
        total = max(total, x + 1.0)  # at least one more turn, so one more token
        remaining = total - x
        turns = max(1.0, remaining / rate)
        # A pending tool call still runs, and one call follows each remaining turn
        # but the last.
        calls = turns if t.in_tool else turns - 1.0
        return Estimate(total, remaining, turns, calls * self._tool_rate(t))
