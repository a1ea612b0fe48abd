"""A job's per-trajectory timeline as HTML: the batch's summary and one row per
trajectory. `treadle run` writes it when its job ends (`write_report`); the service
serves it for a job at any time (`GET /v1/jobs/{id}/timeline`, the dashboard's view
of a job), with the trajectories still running drawn up to now (`running_row`).

One self-contained page (no network, no libraries; the page shell, style, time axis
and tooltip are those of the simulator's timeline, `treadle.page`): a summary
line, the summary table by status, a legend, then one row per trajectory, in start
order, and a table of why trajectories ended other than completed.

A row is reconstructed from the trajectory's record, which keeps durations, not
timestamps, per turn: from `timings.started_at`, each turn's `queued_s` (waiting
for an engine), `generating_s` (prefill and decode) and its tool call's
`latency_s` are laid end to end. What the record does not time — the sandbox's
start, the reward, the agent loop's own work between events — is not drawn; it
shows as the faint line running on to the row's end mark at `timings.finished_at`,
coloured by status. The page says so. A running trajectory has no record yet: its
row is that faint line from its start to now. Times are the service's clock
(modelled seconds when it runs emulated engines), relative to the first start.
Hover a row for the trajectory's id, status, reward, tokens and time split
(JavaScript: `TIMELINE_SCRIPT`, the page's one script).

Past `max_rows` trajectories the longest (by first start to end) are drawn and the
page says how many shorter ones are not; a trajectory with no start time (cancelled
before it ran) is counted, not drawn.

`Tally` and `summary_rows` make the summary table (by status: count, mean reward
over the scored ones, turns, tokens, tool seconds) from the same rows.
"""

from __future__ import annotations

import html
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from treadle.page import PLOT_W, WIDTH, X0, hover_script, html_page, time_ticks
from treadle.types import Trajectory, TrajectoryStatus

_K = TypeVar("_K", str, tuple[str, str])
RUNNING = TrajectoryStatus.RUNNING.value  # a row of a trajectory not finished yet
STATUS_ORDER = [s.value for s in TrajectoryStatus if s.terminal]

BAR_KINDS = (("queued", "#e9c46a"), ("generating", "#3d5a80"), ("tool", "#98a1ab"))
END_COLOURS = {"completed": "#2a9d4b", "truncated": "#f07c12", "max_turns": "#f07c12",
               "timeout": "#f07c12", "aborted": "#6c757d", "error": "#d4001a",
               RUNNING: "#7b2cbf"}
ROW_BUDGET, ROW_H_MIN, ROW_H_MAX = 1800.0, 2.0, 12.0  # total row height to aim for
TOP = 6.0  # above the first row


@dataclass(frozen=True, slots=True)
class TrajectoryRow:
    """What the report needs of one trajectory (not its tokens)."""

    trajectory_id: str
    status: str
    reward: float | None
    reason: str | None
    output_tokens: int
    started_at: float | None  # the record's clock
    finished_at: float | None
    turns: tuple[tuple[float, float, float], ...]  # per turn: queued, generating, tool s
    llm_s: float
    tool_s: float
    queue_s: float


def trajectory_row(t: Trajectory) -> TrajectoryRow:
    return TrajectoryRow(
        t.trajectory_id, t.status.value, t.reward, t.reason, t.output_tokens,
        t.timings.started_at, t.timings.finished_at,
        tuple((turn.queued_s, turn.generating_s,
               turn.tool_call.latency_s if turn.tool_call is not None else 0.0)
              for turn in t.turns),
        t.timings.llm_s, t.timings.tool_s, t.timings.queue_s)


def running_row(trajectory_id: str, started_at: float, now: float) -> TrajectoryRow:
    """A trajectory still running, started at `started_at` (the records' clock): its
    row runs to `now`, with nothing drawn on it (its record does not exist yet)."""
    return TrajectoryRow(trajectory_id, RUNNING, None, None, 0, started_at,
                         max(now, started_at), (), 0.0, 0.0, 0.0)


def spans(row: TrajectoryRow) -> list[tuple[str, float, float]]:
    """(kind, start, end) of the row's queued, generating and tool stretches, laid end
    to end from its start (see the module docstring); [] without a start time."""
    if row.started_at is None:
        return []
    out = []
    t = row.started_at
    for queued, generating, tool in row.turns:
        for kind, length in (("queued", queued), ("generating", generating), ("tool", tool)):
            if length > 0:
                out.append((kind, t, t + length))
                t += length
    return out


def render_report(rows: Sequence[TrajectoryRow], *, title: str, summary: Sequence[Sequence[str]],
                  facts: Sequence[str], max_rows: int = 1500) -> str:
    """The page. `summary`: the summary table (header first); `facts`: short lines for
    the top (job, service, engines, wall time). Input text is escaped."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    timed = [r for r in rows if r.started_at is not None]
    unstarted = len(rows) - len(timed)
    ends = {r.trajectory_id: _end(r) for r in timed}
    if len(timed) > max_rows:
        keep = sorted(timed, key=lambda r: (-(ends[r.trajectory_id] - _start(r)),
                                            r.trajectory_id))[:max_rows]
        timed = keep
    timed.sort(key=lambda r: (_start(r), r.trajectory_id))
    body = [_head(rows, summary, facts)]
    if timed:
        body.append(_chart(timed, ends, len(rows) - len(timed) - unstarted, unstarted))
    else:
        body.append('<p class="empty">No trajectory with a start time to draw.</p>')
    body.append(_reasons(rows))
    return html_page(title, "".join(body), _CSS)


def write_report(path: str | Path, rows: Sequence[TrajectoryRow], *, title: str,
                 summary: Sequence[Sequence[str]], facts: Sequence[str],
                 max_rows: int = 1500) -> None:
    Path(path).write_text(render_report(rows, title=title, summary=summary, facts=facts,
                                        max_rows=max_rows), encoding="utf-8")


def _start(r: TrajectoryRow) -> float:
    assert r.started_at is not None
    return r.started_at


def _end(r: TrajectoryRow) -> float:
    drawn = spans(r)
    last = drawn[-1][2] if drawn else _start(r)
    return max(last, r.finished_at if r.finished_at is not None else last)


def _head(rows: Sequence[TrajectoryRow], summary: Sequence[Sequence[str]],
          facts: Sequence[str]) -> str:
    counts = Counter(r.status for r in rows)
    by_status = " · ".join(f"{s} {n}" for s, n in _by_count(counts))
    cells = ["".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row)
             for tag, row in ((("th" if i == 0 else "td"), row) for i, row in enumerate(summary))]
    table = "".join(f"<tr>{c}</tr>" for c in cells)
    return (f'<p class="sum"><b>{len(rows)}</b> trajectories · {html.escape(by_status)}</p>'
            + "".join(f'<p class="sum">{html.escape(f)}</p>' for f in facts)
            + f'<table class="tab">{table}</table>')


def _chart(rows: list[TrajectoryRow], ends: dict[str, float], hidden: int,
           unstarted: int) -> str:
    t0 = min(_start(r) for r in rows)
    t1 = max(max(ends[r.trajectory_id] for r in rows), t0 + 1e-3)
    k = PLOT_W / (t1 - t0)
    h = math.floor(2 * min(ROW_H_MAX, max(ROW_H_MIN, ROW_BUDGET / len(rows)))) / 2

    def x(t: float) -> float:
        return X0 + (t - t0) * k

    paths: dict[str, list[str]] = {kind: [] for kind, _ in BAR_KINDS}
    life: list[str] = []
    marks: dict[str, list[str]] = {}
    labels: list[str] = []
    table = []
    prefix = _common_prefix([r.trajectory_id for r in rows])
    for i, r in enumerate(rows):
        y = TOP + (i + 0.5) * h
        end = ends[r.trajectory_id]
        life.append(f"M{x(_start(r)):.1f} {y:.1f}H{x(end):.1f}")
        for kind, a, b in spans(r):
            paths[kind].append(f"M{x(a):.1f} {y:.1f}h{max(0.6, (b - a) * k):.1f}")
        marks.setdefault(r.status, []).append(f"M{x(end):.1f} {y - h / 2:.1f}v{h:.1f}")
        if h >= 9:
            name = r.trajectory_id[len(prefix):]
            name = name if len(name) <= 28 else "…" + name[-27:]
            labels.append(f'<text class="rl" x="{X0 - 6}" y="{y + 3:.1f}" text-anchor="end">'
                          f"{html.escape(name)}</text>")
        table.append([r.trajectory_id, r.status, r.reward, r.output_tokens, len(r.turns),
                      round(r.llm_s, 2), round(r.tool_s, 2), round(r.queue_s, 2),
                      round(_start(r) - t0, 2), round(end - t0, 2), r.reason])
    height = TOP + len(rows) * h + 4
    done = sorted(ends[r.trajectory_id] for r in rows)
    at = [done[max(0, math.ceil(q * len(done)) - 1)] for q in (0.5, 0.9, 1.0)]
    quantiles = "".join(f'<path class="qm" d="M{x(t):.1f} 0V{height:.1f}"/>' for t in at)
    ticks = time_ticks(0.0, t1 - t0)
    grid = "".join(f'<path class="grid" d="M{x(t0 + v):.1f} 0V{height:.1f}"/>' for v, _ in ticks)
    axis = "".join(f'<text class="tk" x="{x(t0 + v):.1f}" y="13" text-anchor="middle">{lab}'
                   f"</text>" for v, lab in ticks)
    bar_w = h - (0.5 if h < 4 else 1.0)
    svg = [f'<path class="life" d="{"".join(life)}"/>']
    svg += [f'<path stroke="{colour}" stroke-width="{bar_w:.2f}" fill="none" '
            f'd="{"".join(paths[kind])}"/>' for kind, colour in BAR_KINDS if paths[kind]]
    svg += [f'<path stroke="{END_COLOURS.get(status, "#222")}" stroke-width="1.6" '
            f'd="{"".join(ds)}"/>' for status, ds in sorted(marks.items())]
    p50, p90 = at[0] - t0, at[1] - t0
    left_out = []
    if hidden:
        left_out.append(f"{hidden} shorter trajectories not drawn (at most {len(rows)} rows)")
    if unstarted:
        left_out.append(f"{unstarted} never started (no start time)")
    legend = "".join(f'<span><i style="background:{c}"></i>{k}</span>' for k, c in BAR_KINDS)
    legend += '<span><i style="height:1px;background:#c9ced6"></i>untimed</span>'
    by_colour: dict[str, list[str]] = {}
    for status, colour in END_COLOURS.items():
        by_colour.setdefault(colour, []).append(status)
    legend += "".join(f'<span><i style="width:3px;background:{c}"></i>end: {", ".join(ss)}'
                      "</span>" for c, ss in by_colour.items())
    data = json.dumps({"top": TOP, "h": h, "rows": table}, separators=(",", ":"),
                      ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e") \
        .replace("&", "\\u0026")
    return (
        f'<p class="sum">per trajectory, in start order · 50% ended at {p50:.1f} s, 90% at '
        f'{p90:.1f} s, all at {t1 - t0:.1f} s (dashed lines)'
        + (f" · {html.escape('; '.join(left_out))}" if left_out else "") + "</p>"
        + '<p class="note">Each row is reconstructed from the trajectory record, which keeps '
        "per-turn durations, not timestamps: from its start time, each turn's queued, "
        "generating and tool seconds are laid end to end. Time the record does not split "
        "(sandbox start-up, scoring, the agent loop's own work) is not drawn: it shows as "
        "the faint line up to the end mark, at the trajectory's finish time. Times are the "
        "service's clock, from the first start.</p>"
        f'<div class="legend">{legend}</div>'
        f'<div class="axis"><svg viewBox="0 0 {WIDTH:.0f} 24"><text class="sub" x="8" y="14">'
        f"time (s)</text>{axis}</svg></div>"
        f'<svg id="tl" viewBox="0 0 {WIDTH:.0f} {height:.0f}">{grid}{quantiles}'
        f'{"".join(labels)}{"".join(svg)}</svg><div id="tip"></div>'
        '<noscript>Row details need JavaScript.</noscript>'
        f'<script id="tl-data" type="application/json">{data}</script>'
        f"<script>{TIMELINE_SCRIPT}</script>")


def _by_count(counts: Counter[_K]) -> list[tuple[_K, int]]:
    """Most first, ties by key: the page must not depend on the rows' order."""
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def _common_prefix(ids: list[str]) -> str:
    """The ids' shared leading part up to a "/" (the job id), to leave out of labels."""
    common = ids[0]
    for tid in ids[1:]:
        while not tid.startswith(common):
            common = common[:-1]
    return common[:common.rfind("/") + 1]


def _reasons(rows: Sequence[TrajectoryRow]) -> str:
    counts = Counter((r.status, r.reason or "") for r in rows
                     if r.status not in ("completed", RUNNING))
    if not counts:
        which = "finished trajectory" if any(r.status == RUNNING for r in rows) else "trajectory"
        return f'<p class="sum">Every {which} completed.</p>'
    lines = "".join(f"<tr><td>{html.escape(s)}</td><td>{n}</td><td>{html.escape(why)}</td></tr>"
                    for (s, why), n in _by_count(counts)[:20])
    more = len(counts) - 20
    return ("<h2>Ended other than completed</h2><table class=\"tab\"><tr><th>status</th>"
            f"<th>count</th><th>reason</th></tr>{lines}</table>"
            + (f'<p class="sum">and {more} more reasons</p>' if more > 0 else ""))


@dataclass(slots=True)
class _Totals:
    """Sums over the trajectories of one status."""

    count: int = 0
    rewards: list[float] = field(default_factory=list)  # the scored ones
    turns: int = 0
    tokens: int = 0  # output tokens
    tool_s: float = 0.0


class Tally:
    """Finished trajectories, by status."""

    def __init__(self) -> None:
        self.by_status: dict[str, _Totals] = {}
        self.done = 0
        self.tokens = 0  # output tokens of everything finished

    def add(self, row: TrajectoryRow) -> None:
        totals = self.by_status.setdefault(row.status, _Totals())
        totals.count += 1
        if row.reward is not None:
            totals.rewards.append(row.reward)
        totals.turns += len(row.turns)
        totals.tokens += row.output_tokens
        totals.tool_s += row.tool_s
        self.done += 1
        self.tokens += row.output_tokens

    def counts(self) -> list[tuple[str, int]]:
        return [(s, self.by_status[s].count) for s in _ordered(self.by_status)]


def _ordered(statuses: dict[str, _Totals]) -> list[str]:
    return sorted(statuses, key=lambda s: (STATUS_ORDER.index(s) if s in STATUS_ORDER
                                           else len(STATUS_ORDER), s))


def summary_rows(tally: Tally) -> list[tuple[str, ...]]:
    """The summary table's rows, header first: per status and for all, the count and
    the means of reward (over the scored ones), turns, output tokens and tool seconds."""
    rows: list[tuple[str, ...]] = [("status", "count", "reward", "turns", "tokens", "tool_s")]
    every = _Totals()
    for status in _ordered(tally.by_status):
        t = tally.by_status[status]
        rows.append(_row(status, t))
        every.count += t.count
        every.rewards += t.rewards
        every.turns += t.turns
        every.tokens += t.tokens
        every.tool_s += t.tool_s
    rows.append(_row("all", every))
    return rows


def _row(name: str, t: _Totals) -> tuple[str, ...]:
    n = max(t.count, 1)
    reward = f"{math.fsum(t.rewards) / len(t.rewards):.3f}" if t.rewards else "-"
    return (name, str(t.count), reward, f"{t.turns / n:.1f}", f"{t.tokens / n:,.0f}",
            f"{t.tool_s / n:.2f}")


_CSS = (".note{color:#555;font-size:12px;max-width:70em;margin:2px 0 6px}"
        "h2{font-size:15px;margin:14px 0 4px}.tab{border-collapse:collapse;margin:4px 0 8px;"
        "font-size:12px}.tab td,.tab th{padding:1px 10px;text-align:right;border-bottom:1px "
        "solid #eee}.tab td:first-child,.tab th:first-child{text-align:left}"
        "#tl .life{fill:none;stroke:#c9ced6;stroke-width:1}.rl{font-size:9px;fill:#555}")

# Hover: the row under the pointer, from its drawing coordinates and the JSON table.
TIMELINE_SCRIPT = hover_script(r"""const s=v=>v.toFixed(2)+' s';
function find(x,y){const r=D.rows[Math.floor((y-D.top)/D.h)];if(!r)return null;
 return[r[0],r[1]+(r[2]==null?'':'  reward '+r[2])+(r[10]?'  ('+r[10]+')':''),
  r[3]+' tokens, '+r[4]+' turns','generating '+s(r[5])+', tool '+s(r[6])+', queued '+s(r[7]),
  'from '+s(r[8])+' to '+s(r[9])];}""")


__all__ = ["RUNNING", "STATUS_ORDER", "TIMELINE_SCRIPT", "Tally", "TrajectoryRow", "render_report",
           "running_row", "spans", "summary_rows", "trajectory_row", "write_report"]
