"""Prometheus metrics of the service, in the text exposition format (no dependency).

    treadle_trajectories_active             gauge     trajectories in flight here
    treadle_trajectories_queued             gauge     waiting for a slot in this process
    treadle_trajectories_finished_total     counter   by status
    treadle_failures_total                  counter   infrastructure failures by stage
    treadle_tokens_generated_total          counter   tokens sampled by the engines
    treadle_tool_latency_seconds            histogram tool-call latency
    treadle_api_latency_seconds             histogram API request latency, by route
    treadle_engine_calls_in_flight          gauge     per engine
    treadle_engines                         gauge     engines in the pool
    treadle_scheduler_decision_seconds      histogram scheduler CPU per decision
    treadle_policy_version                  gauge     stamped on new tokens
    treadle_weight_update_seconds           histogram new engine calls held, by mode
    treadle_weight_update_calls_total       counter   calls in flight at an update, by
                                                      what it did to them (kept, aborted)
    treadle_weight_update_timeouts_total    counter   updates past their timeout
    treadle_tokens_discarded_total          counter   tokens of trajectories restarted
                                                      as stale (continuous jobs)
    treadle_journal_turns_total             counter   completed turns journaled
    treadle_tokens_unjournaled              gauge     tokens sampled that a crash now
                                                      would throw away (turns not kept)
    treadle_journal_flush_seconds           histogram one batch of journal writes: the
                                                      store's SQLite time (its thread's
                                                      or process's), before the commit
    treadle_resumes_total                   counter   attempts resumed after a restart,
                                                      by from (turn | prompt)
    treadle_resume_discarded_tokens_total   counter   journaled tokens a resume could
                                                      not keep (sampled again)

Rates (tokens/s) are what Prometheus computes from the counters. Histograms use
fixed log-spaced buckets. Everything here is updated from the service's event loop.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)
DECISION_BUCKETS = (0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


class Histogram:
    """Cumulative buckets, a sum and a count, per label value."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[str, list[int]] = defaultdict(lambda: [0] * (len(self.buckets) + 1))
        self._sums: dict[str, float] = defaultdict(float)

    def observe(self, value: float, label: str = "") -> None:
        self._counts[label][bisect.bisect_left(self.buckets, value)] += 1
        self._sums[label] += value

    def count(self, label: str = "") -> int:
        return sum(self._counts[label]) if label in self._counts else 0

    def lines(self, name: str, label_name: str = "") -> list[str]:
        out = [f"# TYPE {name} histogram"]
        for label in sorted(self._counts):
            counts = self._counts[label]
            extra = f'{label_name}="{_escape(label)}",' if label_name else ""
            running = 0
            for bound, n in zip((*self.buckets, float("inf")), counts, strict=True):
                running += n
                le = "+Inf" if bound == float("inf") else repr(bound)
                out.append(f'{name}_bucket{{{extra}le="{le}"}} {running}')
            labels = f"{{{extra.rstrip(',')}}}" if extra else ""
            out.append(f"{name}_sum{labels} {self._sums[label]!r}")
            out.append(f"{name}_count{labels} {running}")
        return out


class Metrics:
    """The service's counters; `render` gives the exposition text."""

    def __init__(self) -> None:
        self.finished: dict[str, int] = defaultdict(int)  # by trajectory status
        self.failures: dict[str, int] = defaultdict(int)  # by failure stage
        self.tokens = 0
        self.tool_latency = Histogram(LATENCY_BUCKETS)
        self.api_latency = Histogram(LATENCY_BUCKETS)
        self.decisions = Histogram(DECISION_BUCKETS)
        self.weight_updates = Histogram(LATENCY_BUCKETS)  # held seconds, by mode
        self.update_calls: dict[str, int] = defaultdict(int)  # kept | aborted
        self.update_timeouts = 0
        self.tokens_discarded = 0  # sampled by trajectories restarted as stale
        self.journal_turns = 0  # completed turns journaled (service.journal)
        self.journal_flushes = Histogram(LATENCY_BUCKETS)  # seconds a batch of writes took
        self.resumes: dict[str, int] = defaultdict(int)  # restarted attempts, by from
        self.resume_discarded_tokens = 0  # journaled, not kept by a resume

    def weight_update(self, mode: str, held_s: float, kept: int, aborted: int) -> None:
        """One weight update that finished."""
        self.weight_updates.observe(held_s, mode)
        self.update_calls["kept"] += kept
        self.update_calls["aborted"] += aborted

    def render(self, *, active: int, queued: int, engines: dict[str, int],
               policy_version: int, unjournaled: int = 0) -> str:
        lines = [
            "# TYPE treadle_trajectories_active gauge", f"treadle_trajectories_active {active}",
            "# TYPE treadle_trajectories_queued gauge", f"treadle_trajectories_queued {queued}",
            "# TYPE treadle_trajectories_finished_total counter",
            *(f'treadle_trajectories_finished_total{{status="{s}"}} {n}'
              for s, n in sorted(self.finished.items())),
            "# TYPE treadle_failures_total counter",
            *(f'treadle_failures_total{{stage="{s}"}} {n}'
              for s, n in sorted(self.failures.items())),
            "# TYPE treadle_tokens_generated_total counter",
            f"treadle_tokens_generated_total {self.tokens}",
            *self.tool_latency.lines("treadle_tool_latency_seconds"),
            *self.api_latency.lines("treadle_api_latency_seconds", "route"),
            *self.decisions.lines("treadle_scheduler_decision_seconds"),
            "# TYPE treadle_engine_calls_in_flight gauge",
            *(f'treadle_engine_calls_in_flight{{engine="{_escape(e)}"}} {n}'
              for e, n in sorted(engines.items())),
            "# TYPE treadle_engines gauge", f"treadle_engines {len(engines)}",
            "# TYPE treadle_policy_version gauge", f"treadle_policy_version {policy_version}",
            *self.weight_updates.lines("treadle_weight_update_seconds", "mode"),
            "# TYPE treadle_weight_update_calls_total counter",
            *(f'treadle_weight_update_calls_total{{outcome="{o}"}} {n}'
              for o, n in sorted(self.update_calls.items())),
            "# TYPE treadle_weight_update_timeouts_total counter",
            f"treadle_weight_update_timeouts_total {self.update_timeouts}",
            "# TYPE treadle_tokens_discarded_total counter",
            f"treadle_tokens_discarded_total {self.tokens_discarded}",
            "# TYPE treadle_journal_turns_total counter",
            f"treadle_journal_turns_total {self.journal_turns}",
            "# TYPE treadle_tokens_unjournaled gauge",
            f"treadle_tokens_unjournaled {unjournaled}",
            *self.journal_flushes.lines("treadle_journal_flush_seconds"),
            "# TYPE treadle_resumes_total counter",
            *(f'treadle_resumes_total{{from="{k}"}} {n}' for k, n in sorted(self.resumes.items())),
            "# TYPE treadle_resume_discarded_tokens_total counter",
            f"treadle_resume_discarded_tokens_total {self.resume_discarded_tokens}",
        ]
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
