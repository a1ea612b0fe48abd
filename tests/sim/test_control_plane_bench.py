"""`treadle bench control-plane` on a small cluster: every decision is timed once, the
re-plans are the decisions during which the policy re-placed the batch, and the
wrapper changes nothing the policy decides (the same simulated run as without it)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

from treadle.bench.control_plane import TimedScheduler, run_control_plane
from treadle.cli import main
from treadle.core.cost_model import CostModel
from treadle.core.events import Decision
from treadle.core.scheduler import TrajectoryScheduler, TrajState
from treadle.sim.runner import history_for, simulate
from treadle.workloads.load import generate_named


def test_every_decision_is_timed_and_the_run_is_the_untimed_one() -> None:
    report = run_control_plane(workload="coding", engines=8, trajectories=64)
    assert report["turns"] > 64 and report["decisions"] >= report["replans"] > 0
    assert 0 < report["decision_p50_ms"] <= report["decision_p99_ms"] <= report["decision_max_ms"]
    assert 0 < report["replan_p50_ms"] <= report["replan_max_ms"]
    assert 0 < report["replan_decide_max_ms"] <= report["replan_max_ms"]
    assert report["scheduler_cpu_per_turn_ms"] > 0
    assert 0 <= report["replan_max_gc_ms"] <= report["replan_max_ms"]
    assert 0 <= report["scheduler_gc_s"] <= report["scheduler_cpu_s"]
    cost = CostModel.named("qwen3-14b", "h100")
    context = cost.model.max_context
    plain, _ = simulate(generate_named("coding", 64, max_context=context), "treadle", cost, 8,
                        layout=[1] * 8, history=history_for("coding", 64, 0, max_context=context))
    assert report["makespan_s"] == plain.makespan_s


def test_the_command_writes_its_report_and_refuses_bad_input(tmp_path: Path) -> None:
    out = tmp_path / "cp.json"
    assert main(["bench", "control-plane", "--engines", "4,8", "--trajectories", "32",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["engines"] for r in report["runs"]] == [4, 8]
    assert set(report["met"]) == {"decision_p99", "replan_max", "replan_decide_max"}
    assert main(["bench", "control-plane", "--trajectories", "33"]) == 2


class CollectingScheduler(TrajectoryScheduler):
    """Test double: a re-plan at every decision, during which the collector runs."""

    def route(self, t: TrajState, now: float) -> str | None:
        return self.least_loaded()

    def decide(self, now: float) -> list[Decision]:
        self.replans += 1
        gc.collect()
        return super().decide(now)


def test_the_collector_is_counted_inside_the_re_plan_it_ran_in() -> None:
    timed = TimedScheduler(CollectingScheduler())
    gc.callbacks.append(timed.on_gc)
    try:
        timed.decide(0.0)
    finally:
        gc.callbacks.remove(timed.on_gc)
    gc.collect()  # outside a timed call: not counted
    assert len(timed.replan_gc_ns) == 1
    assert 0 < timed.replan_gc_ns[0] == timed.gc_ns <= timed.replans_ns[0]
