"""`treadle run`'s display and report, without a service: the progress lines, the
summary table, the per-trajectory reconstruction and the HTML page."""

from __future__ import annotations

import io
import json
import re
from typing import Any

import pytest

from treadle.page.trajectories import (
    render_report,
    running_row,
    spans,
    summary_rows,
    trajectory_row,
)
from treadle.run.progress import Progress, summary_table
from treadle.types import (
    FailureStage,
    GroupKey,
    Timings,
    ToolCall,
    Trajectory,
    TrajectoryStatus,
    Turn,
)

EVIL = "<script>alert(1)</script>"


def _traj(tid: str, status: TrajectoryStatus = TrajectoryStatus.COMPLETED,
          reward: float | None = 1.0, start: float | None = 0.0, tokens: int = 10,
          reason: str | None = None) -> Trajectory:
    error = status is TrajectoryStatus.ERROR
    return Trajectory(
        tid, GroupKey("g", 0),
        turns=[Turn(0, tokens, "e0", ToolCall("python", {}, 0.5, 3), queued_s=1.0,
                    generating_s=2.0), Turn(1, tokens, "e0", queued_s=0.0, generating_s=3.0)],
        status=status, reward=None if error else reward, reason=reason,
        failure_stage=FailureStage.ENGINE if error else None,
        timings=Timings(llm_s=5.0, tool_s=0.5, queue_s=1.0, started_at=start,
                        finished_at=None if start is None else start + 7.0))


def _rows_of(page: str) -> list[list[Any]]:
    data = re.search(r'<script id="tl-data" type="application/json">(.*?)</script>', page)
    assert data is not None
    rows: list[list[Any]] = json.loads(data.group(1))["rows"]
    return rows


def test_a_row_lays_each_turns_durations_end_to_end_from_the_start() -> None:
    row = trajectory_row(_traj("t", start=10.0))
    assert spans(row) == [("queued", 10.0, 11.0), ("generating", 11.0, 13.0),
                          ("tool", 13.0, 13.5), ("generating", 13.5, 16.5)]
    assert spans(trajectory_row(_traj("u", start=None))) == []


def test_the_page_draws_every_started_trajectory_escaped_and_explains_itself() -> None:
    trajs = [_traj("a", start=0.0), _traj(EVIL, start=2.0),
             _traj("e", TrajectoryStatus.ERROR, start=1.0, reason="engine: gone"),
             _traj("x", TrajectoryStatus.ABORTED, start=None, reason="cancelled")]
    rows = [trajectory_row(t) for t in trajs]
    page = render_report(rows, title=f"run {EVIL}", summary=[("status", "count"), ("x", "1")],
                         facts=[f"job {EVIL}"])
    assert EVIL not in page and "&lt;script&gt;" in page
    drawn = _rows_of(page)
    assert [r[0] for r in drawn] == ["a", "e", EVIL]  # in start order; x never started
    assert drawn[0][8:10] == [0.0, 7.0]  # from the first start, to its finish
    assert "1 never started" in page
    assert "reconstructed from the trajectory record" in page
    assert "engine: gone" in page and "cancelled" in page  # why they did not complete
    # The same rows in another order give the same page.
    again = render_report(list(reversed(rows)), title=f"run {EVIL}",
                          summary=[("status", "count"), ("x", "1")], facts=[f"job {EVIL}"])
    assert again == page


def test_a_running_trajectory_is_a_row_up_to_now_and_no_reason_to_explain() -> None:
    rows = [trajectory_row(_traj("done", start=0.0)), running_row("live", 2.0, 30.0)]
    page = render_report(rows, title="live", summary=[("s",)], facts=[])
    drawn = _rows_of(page)
    assert [(r[0], r[1], r[8], r[9]) for r in drawn] == [("done", "completed", 0.0, 7.0),
                                                         ("live", "running", 2.0, 30.0)]
    assert "completed 1 · running 1" in page and "Every finished trajectory completed." in page
    assert running_row("clock-behind", 5.0, 4.0).finished_at == 5.0


def test_past_max_rows_the_longest_are_drawn_and_the_rest_counted() -> None:
    rows = []
    for i in range(10):
        t = _traj(f"t{i}", start=float(i))
        assert t.timings.finished_at is not None
        t.timings.finished_at += i * 10.0  # t9 is the longest
        rows.append(trajectory_row(t))
    page = render_report(rows, title="r", summary=[("s",)], facts=[], max_rows=3)
    assert sorted(r[0] for r in _rows_of(page)) == ["t7", "t8", "t9"]
    assert "7 shorter trajectories not drawn" in page
    with pytest.raises(ValueError):
        render_report(rows, title="r", summary=[], facts=[], max_rows=0)


def test_an_empty_batch_still_gives_a_page() -> None:
    page = render_report([], title="r", summary=[("status",)], facts=[])
    assert "No trajectory with a start time" in page and page.startswith("<!DOCTYPE html>")


def test_the_summary_table_means_per_status_rewards_only_where_scored() -> None:
    progress = Progress(3, stream=io.StringIO(), tty=False)
    for t in (_traj("a", reward=1.0), _traj("b", reward=0.0),
              _traj("c", TrajectoryStatus.ERROR, reason="engine: x")):
        progress.add(t)
    rows = summary_rows(progress.tally)
    assert rows[1] == ("completed", "2", "0.500", "2.0", "20", "0.50")
    assert rows[2] == ("error", "1", "-", "2.0", "20", "0.50")
    assert rows[3] == ("all", "3", "0.500", "2.0", "20", "0.50")
    lines = summary_table(progress.tally).splitlines()
    assert len({len(line) for line in lines}) == 1  # aligned columns


def test_plain_progress_lines_come_every_tenth_and_after_a_quiet_while() -> None:
    now = [0.0]
    out = io.StringIO()
    with Progress(20, stream=out, tty=False, clock=lambda: now[0],
                  plain_every_s=30.0) as progress:
        for i in range(20):
            now[0] = float(i)
            progress.add(_traj(f"t{i}"))
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("treadle run: 2/20 done (completed 2)")
    assert lines[-1].startswith("treadle run: 20/20 done")
    out = io.StringIO()
    now[0] = 0.0
    with Progress(100, stream=out, tty=False, clock=lambda: now[0],
                  plain_every_s=30.0) as progress:
        progress.add(_traj("a"))
        assert out.getvalue() == ""
        now[0] = 31.0
        progress.add(_traj("b", TrajectoryStatus.ERROR))
        assert "2/100 done (completed 1, error 1)" in out.getvalue()
    assert out.getvalue().count("\n") == 1  # nothing again at the end: it was the last state


def test_on_a_terminal_the_line_is_redrawn_and_messages_go_above_it() -> None:
    out = io.StringIO()
    with Progress(4, stream=out, tty=True, redraw_s=0.01) as progress:
        progress.add(_traj("a"))
        progress.message("WARNING something")
    text = out.getvalue()
    assert "\r\x1b[KWARNING something\n" in text
    final = text.rsplit("\r\x1b[K", 1)[1]
    assert re.fullmatch(r"\[#{6}\.{18}\] 1/4 done \(completed 1\) · [\d,]+ tokens/s · 0:00\n",
                        final), final
