"""Per-engine Gantt chart of a rollout, as one self-contained HTML page.

`render_timeline` draws recorded `Span`s as inline SVG with a little CSS and script; no
network or libraries, so it opens offline. Under a summary line and legend come a cluster
overview (trajectories generating, in a tool call, preempted, migrating, stacked over
time; dashed marks where 50/90/99/100% had finished, so the long tail is the stretch
between the last marks) and one block per engine (`engines` in order, then engines only
spans name, then "(no engine)" for engine_id ""), its lifetime shaded.

A block is an occupancy strip (trajectories resident, darker: generating; one scale for
all engines, so imbalance shows) over lanes of *stays*: runs of one trajectory's spans on
the engine, up to a migration or a move. Turns are bars coloured by length rank, tool
calls thin grey lines, preemptions hatched bars, migrations faint magenta arrows. Lanes
are packed greedily in start order into the lowest free lane, which needs fewest lanes.
An engine may run 100+ trajectories at once, which no lane layout shows readably, so past
`max_lanes_per_engine` the block keeps that many lanes and fills them first-fit by length
rank, longest first: stragglers are always drawn, the strip counts everyone, and the label
says how many stays were left out. Capped lanes plus the strip read better than the strip
alone, which hides single stragglers. Block height is proportional to the lanes used.

Colour: by rank of `trajectory_tokens` (blues for the shortest 90%, then gold, orange,
and red for the longest 1%, which always holds the longest; grey if missing) or, without
it, by rank of wall-clock duration (first start to last end); the legend says which.

Size and speed: a stay's turns closer than a pixel merge and sub-pixel bars widen to a
visible minimum; all bars of one class on one engine are one `<path>`; tooltips (span
kind, start/end/duration; column occupancy) come from a mouse handler over a JSON table,
not from an element per span. 4,096 trajectories x ~10 turns on 64 engines: 80k spans in
~0.8 s to 2.4 MB (3.5 MB with the lane cap lifted); 120k spans in ~1.1 s to 3.1 MB.

Limits: 1,600 units wide, scaled to the window, so time resolution is a pixel (makespan /
1,400) and occupancy is averaged over two-pixel columns; hovering needs JavaScript.
"""

from __future__ import annotations

import heapq
import html
import json
import math
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from treadle.page import PLOT_W, WIDTH, X0, hover_script, html_page, time_ticks

KINDS = ("turn", "tool", "preempted", "migrate")  # index = kind code in the tooltip table


@dataclass(frozen=True, slots=True)
class Span:
    """One thing a trajectory did over [start, end], in seconds."""

    engine_id: str  # engine row ("" for spans not on an engine)
    traj_id: str
    kind: str  # one of KINDS; "tool": engine_id is the home engine; "migrate": the source
    start: float
    end: float
    dst: str = ""  # for "migrate": destination engine


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """An engine row: its TP degree and lifetime (engines can come and go mid-run)."""

    engine_id: str
    tp: int  # tensor-parallel degree (GPUs)
    start: float = 0.0  # when the engine came up
    end: float | None = None  # when it went away; None: up until the end


COL_PX = 2.0  # occupancy is averaged over columns this wide
OV_TOP, OV_H, STRIP_H = 8.0, 84.0, 14.0  # cluster overview; per-engine strip
PAD, GAP = 3.0, 4.0  # inside a block above the strip and below the lanes; between blocks
MIN_BLOCK_H = 27.0  # room for the two label lines
LANE_BUDGET, LANE_H_MIN, LANE_H_MAX = 2400.0, 2.0, 10.0  # total lane height to aim for
MERGE_PX, MIN_BAR_PX = 1.0, 0.8  # a stay's turns closer than this merge; thinner bars widen

# (upper quantile, colour, legend): cool for the bulk, warm for the tail.
PALETTE = (
    (0.10, "#1f3f73", "shortest 10%"), (0.25, "#2f5f9a", "10–25%"),
    (0.50, "#4a80bb", "25–50%"), (0.75, "#77a5d2", "50–75%"), (0.90, "#a5c6e2", "75–90%"),
    (0.95, "#f0c419", "90–95%"), (0.99, "#f07c12", "95–99%"), (1.00, "#d4001a", "longest 1%"),
)
UNKNOWN_COLOUR = "#b0b0b0"
_CLASSES = (*(f"c{i}" for i in range(len(PALETTE))), "cu", "tool", "pre")  # path classes
OVERVIEW_FILL = ("#3d5a80", "#b7bdc6", "url(#hatch)", "#c51b8a")  # in KINDS order


@dataclass(slots=True)
class _Stay:
    traj: int  # index into the sorted trajectory ids
    engine: str
    spans: list[Span]
    start: float
    end: float
    lane: int = -1  # -1: not drawn (over the lane cap)
    y: float = -1.0  # lane centre once drawn


# A migration: (trajectory index, span, source stay, index in stays of the stay after it).
_Migration = tuple[int, Span, _Stay | None, int]


@dataclass(frozen=True, slots=True)
class _Frame:
    t0: float
    t1: float
    k: float  # drawing units per second
    dt: float  # seconds per occupancy column
    ncols: int

    def x(self, t: float) -> float:
        return X0 + (t - self.t0) * self.k


def render_timeline(spans: Sequence[Span], engines: Sequence[EngineInfo], *, title: str,
                    trajectory_tokens: Mapping[str, int] | None = None,
                    max_lanes_per_engine: int = 24) -> str:
    """The HTML page (a complete document) for these spans; see the module docstring.

    Raises ValueError for a span ending before it starts, with a non-finite time, an unknown
    kind or a migration without `dst`; for duplicate engine ids; for a lane cap < 1. Output
    depends only on the arguments (not the order of `spans`); all input text is escaped."""
    _validate(spans, engines, max_lanes_per_engine)
    if not spans:
        what = f"{len(engines)} engines but no spans were" if engines else "no spans were"
        return _page(title, f'<p class="empty">Nothing to show: {what} recorded.</p>', 4.0)
    tids = sorted({s.traj_id for s in spans})
    stays, migs, first, last = _stays(spans, tids)
    info = {e.engine_id: e for e in engines}
    seen = {s.engine_id for s in spans} | {s.dst for s in spans if s.kind == "migrate"}
    order = [*info, *sorted(seen - info.keys() - {""}), *([""] if "" in seen else [])]
    t0 = min(first + [e.start for e in engines])
    t1 = max(max(last), t0 + 1e-3)
    ncols = int(PLOT_W / COL_PX)
    fr = _Frame(t0, t1, PLOT_W / (t1 - t0), (t1 - t0) / ncols, ncols)
    tok = trajectory_tokens
    values: list[float | None] = ([b - a for a, b in zip(first, last, strict=True)] if tok is None
                                  else [float(tok[t]) if t in tok else None for t in tids])
    quant, colour = _ranks(values)
    by_engine: dict[str, list[_Stay]] = defaultdict(list)
    for st in stays:
        by_engine[st.engine].append(st)
    packed = {e: _pack(by_engine[e], max_lanes_per_engine, 1.0 / fr.k, quant) for e in order}
    total_lanes = max(1, sum(n for n, _ in packed.values()))
    lane_h = math.floor(2 * min(LANE_H_MAX, max(LANE_H_MIN, LANE_BUDGET / total_lanes))) / 2
    ivs: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for s in spans:  # per kind; per engine: resident (all but migrations) and generating
        ivs["kind", s.kind].append((s.start, s.end))
        if s.kind != "migrate":
            ivs["res", s.engine_id].append((s.start, s.end))
        if s.kind == "turn":
            ivs["gen", s.engine_id].append((s.start, s.end))
    occ = {e: (_columns(ivs["res", e], fr), _columns(ivs["gen", e], fr)) for e in order}
    strip_max = max([1.0] + [max(r[0]) for r, _ in occ.values()])
    ov = [_columns(ivs["kind", kd], fr)[0] for kd in KINDS]
    svg = [_overview(ov, fr, sorted(last))]
    y = OV_TOP + OV_H + 14.0
    strip_mid: dict[str, float] = {}  # where arrows of undrawn stays end
    rows: list[list[object]] = []
    for eid in order:
        strip_mid[eid] = y + PAD + STRIP_H / 2
        y = _block(svg, rows, fr, eid, info.get(eid), by_engine[eid], packed[eid], occ[eid],
                   strip_max, lane_h, colour, y)
    eidx = {e: i for i, e in enumerate(order)}
    arrows, mig_rows = [], []
    for ti, s, src, nxt in migs:  # the arrow ends on the next stay if it is where it went
        dst = stays[nxt] if nxt < len(stays) and stays[nxt].traj == ti else None
        x1, x2 = fr.x(s.start), max(fr.x(s.end), fr.x(s.start) + 0.5)
        y1 = src.y if src and src.y >= 0 else strip_mid[s.engine_id]
        y2 = dst.y if dst and dst.engine == s.dst and dst.y >= 0 else strip_mid[s.dst]
        arrows.append(f'<path d="M{x1:.1f} {y1:.1f}L{x2:.1f} {y2:.1f}"/>')
        mig_rows.append([ti, eidx[s.engine_id], eidx[s.dst], round(s.start, 2),
                         round(s.end, 2), round(x1, 1), round(y1, 1), round(x2, 1), round(y2, 1)])
    svg.append(f'<g class="mig">{"".join(arrows)}</g>')
    height = y + 4.0
    ticks = time_ticks(t0, t1)
    grid = "".join(f'<path class="grid" d="M{fr.x(v):.1f} {OV_TOP}V{height:.1f}"/>'
                   for v, _ in ticks)
    axis = "".join(f'<path class="grid" d="M{fr.x(v):.1f} 16v6"/><text class="tk" '
                   f'x="{fr.x(v):.1f}" y="13" text-anchor="middle">{lab}</text>'
                   for v, lab in ticks)
    data = {
        "t0": t0, "k": fr.k, "dt": fr.dt, "n": ncols, "x0": X0, "x1": X0 + PLOT_W,
        "lh": lane_h, "ov": [OV_TOP, OV_TOP + OV_H, [[round(v, 1) for v in c] for c in ov]],
        "ids": tids, "tok": [None if tok is None else tok.get(t) for t in tids],
        "eng": rows, "mig": mig_rows,
        "seg": [[st.traj, eidx[st.engine], st.lane, [x for sp in st.spans for x in (
            KINDS.index(sp.kind), round(sp.start, 2), round(sp.end, 2))]]
            for st in stays if st.lane >= 0],
    }
    # Escaped so that no id can close the <script> element or start markup.
    js_data = json.dumps(data, separators=(",", ":"), ensure_ascii=False).replace(
        "<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    body = (
        _summary(spans, tids, last, engines, order, fr, tok)
        + f'<div class="axis"><svg viewBox="0 0 {WIDTH:.0f} 24"><text class="sub" x="8" y="14">'
        f'time (s)</text>{axis}</svg></div><svg id="tl" viewBox="0 0 {WIDTH:.0f} {height:.0f}">'
        f'{_DEFS}{grid}{"".join(svg)}</svg><div id="tip"></div>'
        "<noscript>Hover details need JavaScript.</noscript>"
        f'<script id="tl-data" type="application/json">{js_data}</script>'
        f"<script>{_JS}</script>"
    )
    return _page(title, body, lane_h)


def write_timeline(path: str | Path, spans: Sequence[Span], engines: Sequence[EngineInfo], *,
                   title: str, trajectory_tokens: Mapping[str, int] | None = None,
                   max_lanes_per_engine: int = 24) -> None:
    """`render_timeline` written to `path` as UTF-8."""
    page = render_timeline(spans, engines, title=title, trajectory_tokens=trajectory_tokens,
                           max_lanes_per_engine=max_lanes_per_engine)
    Path(path).write_text(page, encoding="utf-8")


def _validate(spans: Sequence[Span], engines: Sequence[EngineInfo], cap: int) -> None:
    if cap < 1:
        raise ValueError(f"max_lanes_per_engine must be >= 1, got {cap}")
    if len({e.engine_id for e in engines}) != len(engines):
        raise ValueError("duplicate engine ids in engines")
    for s in spans:
        bad = ("an unknown kind" if s.kind not in KINDS
               else "a non-finite time" if not math.isfinite(s.start + s.end)
               else "an end before its start" if s.end < s.start
               else "no dst" if s.kind == "migrate" and not s.dst else "")
        if bad:
            raise ValueError(f"{s!r} has {bad}")


def _stays(
    spans: Sequence[Span], tids: list[str]
) -> tuple[list[_Stay], list[_Migration], list[float], list[float]]:
    """Cut each trajectory's spans, in time order, into stays at engine changes and
    migrations; also each trajectory's first start and last end (in `tids` order)."""
    by_traj: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_traj[s.traj_id].append(s)
    stays: list[_Stay] = []
    migs: list[_Migration] = []
    first: list[float] = []
    last: list[float] = []
    for ti, tid in enumerate(tids):
        seq = sorted(by_traj[tid], key=lambda s: (s.start, s.end, s.kind, s.engine_id, s.dst))
        first.append(seq[0].start)
        last.append(max(s.end for s in seq))
        cur: _Stay | None = None
        for s in seq:
            if s.kind == "migrate":
                migs.append((ti, s, cur, len(stays)))
                cur = None
            elif cur is None or cur.engine != s.engine_id:
                cur = _Stay(ti, s.engine_id, [s], s.start, s.end)
                stays.append(cur)
            else:
                cur.spans.append(s)
                cur.end = max(cur.end, s.end)
    return stays, migs, first, last


def _ranks(values: list[float | None]) -> tuple[list[float], list[int]]:
    """Per trajectory: the quantile of its value (ties share one; the largest is 1.0)
    and its PALETTE class; unknown values get quantile -1 and class len(PALETTE)."""
    known = sorted(v for v in values if v is not None)
    quant = [-1.0 if v is None else bisect_right(known, v) / len(known) for v in values]
    bounds = [hi for hi, _, _ in PALETTE]
    return quant, [len(PALETTE) if q < 0 else bisect_left(bounds, q - 1e-12) for q in quant]


def _pack(stays: list[_Stay], cap: int, slack: float, quant: list[float]) -> tuple[int, int]:
    """Set each `stay.lane`; returns (lanes used, stays left undrawn)."""
    free: list[int] = []
    busy: list[tuple[float, int]] = []
    n = 0
    for st in sorted(stays, key=lambda s: (s.start, s.end, s.traj)):
        while busy and busy[0][0] + slack <= st.start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        st.lane = heapq.heappop(free) if free else n
        n = max(n, st.lane + 1)
        heapq.heappush(busy, (st.end, st.lane))
    if n <= cap:
        return n, 0
    # Over the cap: longest trajectories first, each into the lowest lane it fits.
    lanes: list[list[tuple[float, float]]] = [[] for _ in range(cap)]  # disjoint, sorted
    hidden = 0
    for st in sorted(stays, key=lambda s: (-quant[s.traj], s.start - s.end, s.start, s.traj)):
        st.lane = -1
        for lane, ivs in enumerate(lanes):
            i = bisect_left(ivs, (st.start, st.end))
            if (i == 0 or ivs[i - 1][1] + slack <= st.start) and (
                    i == len(ivs) or st.end + slack <= ivs[i][0]):
                ivs.insert(i, (st.start, st.end))
                st.lane = lane
                break
        hidden += st.lane < 0
    return cap, hidden


def _columns(intervals: list[tuple[float, float]], fr: _Frame) -> tuple[list[float], int]:
    """Mean number of open intervals in each occupancy column, and the peak number
    (intervals that only touch do not overlap)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    means = [0.0] * fr.ncols
    count = peak = i = 0
    tc, area, prev = fr.t0, 0.0, 0.0
    for col in range(fr.ncols):
        edge = fr.t0 + (col + 1) * fr.dt
        while i < len(events) and (events[i][0] <= edge or col == fr.ncols - 1):
            t, d = events[i]
            area += count * (t - tc)
            tc, count, i = t, count + d, i + 1
            peak = count if count > peak else peak  # not max(): this loop is the hot spot
        area += count * (edge - tc)
        tc = edge
        means[col], prev = (area - prev) / fr.dt, area
    return means, peak


def _area(values: list[float], base: float, h: float, vmax: float) -> str:
    """Step-area path of column values standing on y=`base`, `h` tall at `vmax`."""
    out, prev = [f"M{X0:.1f} {base:.1f}"], f"{base:.1f}"
    for i, v in enumerate(values):
        yv = f"{base - h * min(1.0, v / vmax):.1f}"
        if yv != prev:
            out.append(f"H{X0 + i * COL_PX:.1f}V{yv}")
            prev = yv
    out.append(f"H{X0 + len(values) * COL_PX:.1f}V{base:.1f}Z")
    return "".join(out)


def _overview(ov: list[list[float]], fr: _Frame, done: list[float]) -> str:
    """Stacked occupancy of the whole cluster, with quantile-of-completion marks."""
    stacked = [[sum(c) for c in zip(*ov[: i + 1], strict=True)] for i in range(len(ov))]
    vmax, base = max([1.0, *stacked[-1]]), OV_TOP + OV_H
    out = [f'<rect x="{X0}" y="{OV_TOP}" width="{PLOT_W:.1f}" height="{OV_H}" fill="#f4f6f9"/>']
    for fill, col in reversed(list(zip(OVERVIEW_FILL, stacked, strict=True))):
        out.append(f'<path fill="{fill}" d="{_area(col, base, OV_H, vmax)}"/>')  # top layer first
    lab_x = -99.0
    for q, lab in ((0.5, "50%"), (0.9, "90%"), (0.99, "99%"), (1.0, "all")):
        xq = fr.x(done[max(0, math.ceil(q * len(done)) - 1)])
        out.append(f'<path class="qm" d="M{xq:.1f} {OV_TOP}V{base:.1f}"/>')
        if xq - lab_x > 40:  # labels of close quantiles would overlap: keep the first
            right = xq > X0 + PLOT_W - 50  # near the right edge the label goes left
            out.append(f'<text class="sub" x="{xq - 2 if right else xq + 2:.1f}" y="{OV_TOP + 9}" '
                       f'text-anchor="{"end" if right else "start"}">{lab} done</text>')
            lab_x = xq
    out.append(f'<text class="lab" x="8" y="24">cluster</text><text class="sub" x="8" y="38">'
               f'trajectories by state</text><text class="sub" x="{X0 - 6}" y="17" '
               f'text-anchor="end">{vmax:.0f}</text>')
    return "".join(out)


def _block(svg: list[str], rows: list[list[object]], fr: _Frame, eid: str, e: EngineInfo | None,
           stays: list[_Stay], packed: tuple[int, int], occ: tuple[tuple[list[float], int], ...],
           strip_max: float, lane_h: float, colour: list[int], top: float) -> float:
    """Draw one engine block at `top` and append its tooltip row; returns the next top."""
    nl, hidden = packed
    height = max(MIN_BLOCK_H, PAD + STRIP_H + 2 + nl * lane_h + PAD)
    lanes_top = top + PAD + STRIP_H + 2
    a = e.start if e is not None else fr.t0
    b = min(fr.t1, e.end if e is not None and e.end is not None else fr.t1)
    svg.append(f'<rect x="{X0}" y="{top:.1f}" width="{PLOT_W:.1f}" height="{height:.1f}" '
               f'fill="#fafbfc"/><rect x="{fr.x(a):.1f}" y="{top:.1f}" width="'
               f'{max(0.0, (b - a) * fr.k):.1f}" height="{height:.1f}" fill="#eaeef4"/>')
    (res, peak), (gen, _) = occ
    base = top + PAD + STRIP_H
    svg.append(f'<path fill="#c3cad6" d="{_area(res, base, STRIP_H, strip_max)}"/>'
               f'<path fill="#3d5a80" d="{_area(gen, base, STRIP_H, strip_max)}"/>')
    name = eid or "(no engine)"
    tp = "waiting" if not eid else (f"TP{e.tp}" if e is not None else "TP ?")
    short = name if len(name) <= 18 else name[:17] + "…"
    sub = f"peak {peak} · {nl} lane{'s' * (nl != 1)}"
    sub += f" · {hidden} hidden" if hidden else ""  # the tooltip says more; the gutter is narrow
    svg.append(f'<text class="lab" x="8" y="{top + 13:.1f}"><title>{html.escape(name)}'
               f'</title>{html.escape(short)} <tspan class="tp">{tp}</tspan></text>'
               f'<text class="sub" x="8" y="{top + 24:.1f}">{sub}</text>')
    cmds: list[list[str]] = [[] for _ in _CLASSES]  # colours, unknown, tool, pre
    for st in stays:
        if st.lane >= 0:
            st.y = lanes_top + (st.lane + 0.5) * lane_h
            _draw_stay(st, fr, cmds[colour[st.traj]], cmds[-2], cmds[-1])
    for i in (-2, *range(len(_CLASSES) - 2), -1):  # tool lines under the bars, hatch on top
        if cmds[i]:
            svg.append(f'<path class="{_CLASSES[i]}" d="{"".join(cmds[i])}"/>')
    rows.append([name, tp, round(top, 1), round(top + height, 1), round(lanes_top, 1), nl, peak,
                 hidden, [round(v, 1) for v in res], [round(v, 1) for v in gen]])
    return top + height + GAP


def _draw_stay(st: _Stay, fr: _Frame, bars: list[str], tools: list[str], pre: list[str]) -> None:
    """Append a stay's path commands: turns and preemptions as bars, merged when closer
    than a pixel and widened to a visible minimum; tool calls as lines, unless sub-pixel."""
    for kind, out in (("turn", bars), ("preempted", pre), ("tool", tools)):
        runs: list[list[float]] = []
        for sp in st.spans:
            if sp.kind == kind:
                a, b = fr.x(sp.start), fr.x(sp.end)
                if runs and kind != "tool" and a - runs[-1][1] < MERGE_PX:
                    runs[-1][1] = max(runs[-1][1], b)
                else:
                    runs.append([a, b])
        for a, b in runs:
            if kind != "tool" or b - a >= 0.5:  # shorter tool gaps vanish between bars anyway
                out.append(f"M{a:.1f} {st.y:.1f}h{max(MIN_BAR_PX, b - a):.1f}")


def _summary(spans: Sequence[Span], tids: list[str], last: list[float],
             engines: Sequence[EngineInfo], order: list[str], fr: _Frame,
             tok: Mapping[str, int] | None) -> str:
    n = Counter(s.kind for s in spans)
    done = sorted(last)
    p50, p90 = (done[max(0, math.ceil(q * len(done)) - 1)] - fr.t0 for q in (0.5, 0.9))
    by = "token count" if tok is not None else "wall-clock duration (no token counts given)"
    keys = [(f"background:{c}", lab) for _, c, lab in PALETTE]
    if tok is not None and any(t not in tok for t in tids):
        keys.append((f"background:{UNKNOWN_COLOUR}", "no token count"))
    keys += [("height:2px;background:#8d949e", "tool call"), ("height:2px;background:#c51b8a",
             "migration"), ("background:repeating-linear-gradient(45deg,#222 0 2px,#fff 2px 4px)",
             "preempted"), ("background:linear-gradient(#c3cad6 50%,#3d5a80 50%)",
             "strip: resident / generating")]
    return (
        f'<p class="sum">makespan <b>{fr.t1 - fr.t0:.1f} s</b> · engines '
        f'{len(order) - ("" in order)} ({sum(e.tp for e in engines)} GPUs) · trajectories '
        f'<b>{len(tids)}</b> · turns {n["turn"]} · tool calls {n["tool"]} · migrations '
        f'{n["migrate"]} · preemptions {n["preempted"]} · 50% of trajectories done at {p50:.1f} s,'
        f' 90% at {p90:.1f} s, all at {fr.t1 - fr.t0:.1f} s</p><div class="legend"><span>colour '
        f"= trajectory length rank by {by}:</span>"
        + "".join(f'<span><i style="{st}"></i>{lab}</span>' for st, lab in keys) + "</div>"
    )


def _page(title: str, body: str, lane_h: float) -> str:
    bar = lane_h - (0.5 if lane_h < 4 else 1.0)  # bars leave a sliver between lanes
    bars = ",".join(f"#tl .{c}" for c in _CLASSES if c != "tool")
    colours = "".join(f".c{i}{{stroke:{c}}}" for i, (_, c, _) in enumerate(PALETTE))
    return html_page(title, body, (
        f"{bars}{{fill:none;stroke-width:{bar:.2f}}}{colours}.cu{{stroke:"
        f"{UNKNOWN_COLOUR}}}#tl .tool{{fill:none;stroke:#8d949e;stroke-width:"
        f"{max(0.6, lane_h / 4):.2f}}}#tl .pre{{stroke:url(#hatch)}}"))


_DEFS = ('<defs><pattern id="hatch" width="4" height="4" patternUnits="userSpaceOnUse" '
         'patternTransform="rotate(45)"><rect width="4" height="4" fill="#fff"/><rect '
         'width="2" height="4" fill="#222"/></pattern><marker id="arr" viewBox="0 0 6 6" '
         'refX="5" refY="3" markerWidth="5" markerHeight="5" orient="auto"><path '
         'd="M0 0L6 3L0 6z" fill="#c51b8a"/></marker></defs>')

# Hover: find what is under the pointer from its drawing coordinates and the JSON table:
# a migration line, an overview or strip column, or the nearest span in the lane.
_JS = hover_script(r"""const K=['turn','tool','preempted'],
f=x=>x.toFixed(1)+' s',iv=(a,b)=>f(a)+' – '+f(b)+'  ('+(b-a).toFixed(1)+' s)',
tr=i=>D.ids[i]+(D.tok[i]==null?'':'  ('+D.tok[i]+' tokens)'),
L=D.eng.map(e=>Array.from({length:e[5]},()=>[]));D.seg.forEach(s=>L[s[1]][s[2]].push(s));
function find(x,y){if(x<D.x0||x>D.x1)return null;const t=D.t0+(x-D.x0)/D.k,
 c=Math.max(0,Math.min(D.n-1,Math.floor((t-D.t0)/D.dt)));for(const m of D.mig){
 const dx=m[7]-m[5],dy=m[8]-m[6],u=Math.max(0,Math.min(1,((x-m[5])*dx+(y-m[6])*dy)/(dx*dx+dy*dy)));
 if(Math.hypot(x-m[5]-u*dx,y-m[6]-u*dy)<3)return[tr(m[0]),'migrate '+D.eng[m[1]][0]+' → '+
  D.eng[m[2]][0],iv(m[3],m[4])];}
 if(y>=D.ov[0]&&y<=D.ov[1])return['cluster at '+f(t)+' (column mean)'].concat(['generating',
  'in a tool call','preempted','migrating'].map((k,i)=>k+': '+D.ov[2][i][c].toFixed(1)));
 const i=D.eng.findIndex(e=>y>=e[2]&&y<=e[3]),e=D.eng[i];if(!e)return null;
 if(y<e[4])return[e[0]+' '+e[1]+' at '+f(t)+' (column mean)','resident '+e[8][c].toFixed(1)+
  ', generating '+e[9][c].toFixed(1),'peak '+e[6]+(e[7]?', '+e[7]+' stays not drawn (cap)':'')];
 let b=null,bd=2/D.k;for(const s of L[i][Math.floor((y-e[4])/D.lh)]||[])for(let j=0;
  j<s[3].length;j+=3){const d=Math.max(s[3][j+1]-t,t-s[3][j+2],0);if(d<bd){bd=d;b=[s,j];}}
 if(!b)return null;const[s,j]=b,v=s[3];
 return[tr(s[0]),'on '+e[0]+': '+K[v[j]],iv(v[j+1],v[j+2])];}""")
