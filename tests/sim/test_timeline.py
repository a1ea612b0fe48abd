"""The timeline page: structure, escaping, determinism, lane packing and the lane cap."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from treadle.sim.timeline import EngineInfo, Span, _ranks, render_timeline, write_timeline

EVIL = "<script>alert(1)</script>"


def _traj(tid: str, engine: str, t: float, turns: int, dur: float = 8.0, tool: float = 3.0,
          ) -> tuple[list[Span], float]:
    """Alternating turns and tool calls on one engine; returns the spans and the end time."""
    out = []
    for i in range(turns):
        out.append(Span(engine, tid, "turn", t, t + dur))
        t += dur
        if i < turns - 1:
            out.append(Span(engine, tid, "tool", t, t + tool))
            t += tool
    return out, t


def _sample() -> tuple[list[Span], list[EngineInfo], dict[str, int]]:
    spans: list[Span] = []
    for tid, eng, t0, turns in (("a", "e0", 0, 4), ("b", "e0", 1, 2), (EVIL, "e1", 0, 3),
                                ("c", "e1", 40, 2), ("long", "e0", 2, 3)):
        spans += _traj(tid, eng, t0, turns)[0]
    t = max(s.end for s in spans if s.traj_id == "long")
    spans.append(Span("e0", "long", "migrate", t, t + 0.5, dst="e2"))
    spans.append(Span("e2", "long", "preempted", t + 0.5, t + 6))
    spans += _traj("long", "e2", t + 6, 5)[0]
    engines = [EngineInfo("e0", 2), EngineInfo("e1", 1), EngineInfo("e2", 4, start=20.0)]
    return spans, engines, {"a": 100, "b": 50, "long": 9000, "c": 10, EVIL: 300}


def _data(page: str) -> dict[str, Any]:
    m = re.search(r'<script id="tl-data" type="application/json">(.*?)</script>', page, re.S)
    assert m is not None
    data: dict[str, Any] = json.loads(m.group(1))
    return data


def test_page_has_svg_labels_summary_and_legend() -> None:
    spans, engines, tokens = _sample()
    page = render_timeline(spans, engines, title="run 7", trajectory_tokens=tokens)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count('<svg id="tl"') == 1 and "</svg>" in page
    for label in ("e0", "e1", "e2"):
        assert f">{label} <tspan" in page
    assert "TP2" in page and "TP4" in page
    assert "makespan <b>" in page and "trajectories <b>5</b>" in page and "migrations 1" in page
    assert "longest 1%" in page and "by token count" in page
    assert 'class="c7"' in page  # the longest trajectory is drawn in the top colour
    assert '<g class="mig"><path' in page  # one migration arrow
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page


def test_text_from_the_input_is_escaped() -> None:
    spans, engines, _ = _sample()
    spans.append(Span(EVIL, "x", "turn", 0.0, 1.0))  # an engine id with markup, too
    page = render_timeline(spans, engines, title=f"t {EVIL}")
    assert EVIL not in page and "<script>alert" not in page
    assert page.count("<script") == 2  # only the page's own data and code
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the title and the label
    data = _data(page)
    assert EVIL in data["ids"]  # intact for the tooltip, which sets textContent
    assert EVIL in [row[0] for row in data["eng"]]


def test_same_input_gives_identical_output_whatever_the_span_order() -> None:
    spans, engines, tokens = _sample()
    first = render_timeline(spans, engines, title="t", trajectory_tokens=tokens)
    assert render_timeline(spans, engines, title="t", trajectory_tokens=tokens) == first
    shuffled = list(spans)
    random.Random(3).shuffle(shuffled)
    assert render_timeline(shuffled, engines, title="t", trajectory_tokens=tokens) == first


def test_lanes_are_packed_greedily() -> None:
    # Two back-to-back trajectories share a lane; an overlapping third needs a second one.
    spans = (_traj("p", "e", 0, 2)[0] + _traj("q", "e", 100, 2)[0] + _traj("r", "e", 5, 1)[0])
    data = _data(render_timeline(spans, [EngineInfo("e", 1)], title="t"))
    lanes = {data["ids"][s[0]]: s[2] for s in data["seg"]}
    assert lanes == {"p": 0, "q": 0, "r": 1}
    assert data["eng"][0][5] == 2  # lanes used


def test_lane_cap_keeps_the_longest_trajectories_and_counts_the_rest() -> None:
    spans = [Span("e", f"t{i:03d}", "turn", 0.1 * i, 50.0 + i) for i in range(100)]
    tokens = {f"t{i:03d}": 1000 + (i * 37) % 100 for i in range(100)}
    page = render_timeline(spans, [EngineInfo("e", 8)], title="t", trajectory_tokens=tokens,
                           max_lanes_per_engine=8)
    data = _data(page)
    name, _, _, _, _, lanes, peak, hidden, *_ = data["eng"][0]
    assert (name, lanes, peak, hidden) == ("e", 8, 100, 92)
    assert len(data["seg"]) == 8 and {s[2] for s in data["seg"]} == set(range(8))
    drawn = {data["ids"][s[0]] for s in data["seg"]}
    assert drawn == set(sorted(tokens, key=tokens.__getitem__)[-8:])
    assert "92 hidden" in page


def test_empty_input_says_there_is_nothing_to_show() -> None:
    page = render_timeline([], [], title="empty")
    assert "Nothing to show" in page and "<svg" not in page
    assert "Nothing to show: 2 engines" in render_timeline(
        [], [EngineInfo("a", 1), EngineInfo("b", 2)], title="t")


@pytest.mark.parametrize(
    "span",
    [
        Span("e", "t", "turn", 5.0, 4.0),  # ends before it starts
        Span("e", "t", "turn", 0.0, float("nan")),
        Span("e", "t", "decode", 0.0, 1.0),  # unknown kind
        Span("e", "t", "migrate", 0.0, 1.0),  # no destination
    ],
)
def test_bad_spans_are_rejected(span: Span) -> None:
    with pytest.raises(ValueError):
        render_timeline([span], [EngineInfo("e", 1)], title="t")


def test_bad_arguments_are_rejected() -> None:
    spans = _traj("a", "e", 0, 1)[0]
    with pytest.raises(ValueError):
        render_timeline(spans, [EngineInfo("e", 1)], title="t", max_lanes_per_engine=0)
    with pytest.raises(ValueError):
        render_timeline(spans, [EngineInfo("e", 1), EngineInfo("e", 2)], title="t")


def test_unknown_engines_and_unplaced_spans_get_their_own_blocks() -> None:
    spans = [*_traj("a", "ghost", 0, 1)[0], Span("", "a", "preempted", 8.0, 12.0)]
    page = render_timeline(spans, [EngineInfo("e", 1)], title="t")
    assert [row[0] for row in _data(page)["eng"]] == ["e", "ghost", "(no engine)"]
    assert "TP ?" in page and "waiting" in page
    assert "by wall-clock duration" in page  # no token counts given


def test_rank_classes_put_the_longest_one_percent_in_the_top_colour() -> None:
    quant, cls = _ranks([float(v) for v in range(1, 201)] + [None])
    assert cls[-1] == 8 and quant[-1] == -1.0  # unknown: grey class
    assert cls[199] == cls[198] == 7 and cls[197] == 6  # top 1% of 200 = 2
    assert cls[0] == 0 and quant[199] == 1.0
    assert _ranks([5.0, 5.0])[1] == [7, 7]  # ties share a rank


def test_write_timeline_writes_the_page(tmp_path: Path) -> None:
    spans, engines, _ = _sample()
    out = tmp_path / "tl.html"
    write_timeline(out, spans, engines, title="t")
    assert out.read_text(encoding="utf-8") == render_timeline(spans, engines, title="t")


def _big(n_traj: int, n_eng: int, seed: int) -> tuple[list[Span], list[EngineInfo], dict[str, int]]:
    rng = random.Random(seed)
    engines = [EngineInfo(f"engine-{i:02d}", rng.choice((1, 2, 4, 8))) for i in range(n_eng)]
    spans: list[Span] = []
    tokens = {}
    for j in range(n_traj):
        tid, eng, t = f"task{j // 8:04d}/r{j % 8}", j % n_eng, rng.uniform(0, 20)
        turns = max(1, min(40, int(rng.lognormvariate(2.2, 0.55))))
        tokens[tid] = 0
        for k in range(turns):
            gen = rng.lognormvariate(6.3, 0.9)
            tokens[tid] += int(gen)
            spans.append(Span(f"engine-{eng:02d}", tid, "turn", t, t + gen / 25.0))
            t += gen / 25.0
            if k < turns - 1:
                tool = rng.lognormvariate(1.5, 0.8)
                spans.append(Span(f"engine-{eng:02d}", tid, "tool", t, t + tool))
                t += tool
                if rng.random() < 0.01:
                    dst = rng.randrange(n_eng)
                    spans.append(Span(f"engine-{eng:02d}", tid, "migrate", t, t + 0.3,
                                      dst=f"engine-{dst:02d}"))
                    t, eng = t + 0.3, dst
    return spans, engines, tokens


@pytest.mark.slow
def test_a_full_size_run_stays_small_and_fast() -> None:
    spans, engines, tokens = _big(4096, 64, seed=11)
    assert len(spans) > 70_000
    t = time.perf_counter()
    page = render_timeline(spans, engines, title="big", trajectory_tokens=tokens)
    elapsed = time.perf_counter() - t
    assert len(page.encode()) < 10_000_000
    assert elapsed < 15.0  # ~1 s on a laptop core; generous for loaded CI machines
    assert all(row[5] <= 24 for row in _data(page)["eng"])
