"""Judging in the simulator (`treadle.sim.judging`, `treadle sim --judge`, `treadle
bench judge`): each mode's semantics — `after` starts no judge call before the last
rollout has finished, `dedicated` keeps judge calls and rollouts on their own pools,
`shared` runs judge calls on the rollout engines at the judge class's rank with no
rollout turn left queued behind one —, the size model, the report's fields and their
consistency, determinism."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from treadle.cli import main
from treadle.core.cost_model import CostModel
from treadle.core.events import Admit, Decision
from treadle.core.policies import build_policy, parse_policy
from treadle.core.predictor import Outcome
from treadle.core.scheduler import JUDGE_RANK, Phase, TrajectoryScheduler
from treadle.sim.judging import (
    JudgedRun,
    JudgeMode,
    JudgeReport,
    JudgeSetup,
    JudgeSizes,
    judge_call,
    parse_judge,
    run_shared_engines,
    simulate_judged,
)
from treadle.sim.runner import MAX_BATCH, history_for, simulate
from treadle.workloads import TrajectorySpec, TurnSpec, Workload
from treadle.workloads.load import generate_named

SHARED, AFTER = JudgeSetup(JudgeMode.SHARED), JudgeSetup(JudgeMode.AFTER)


@functools.cache
def _cost() -> CostModel:
    return CostModel.named("qwen3-14b", "h100")


@functools.cache
def _workload(n: int = 64) -> Workload:
    return generate_named("coding", n, seed=0, max_context=_cost().model.max_context)


@functools.cache
def _history(n: int = 64) -> tuple[Outcome, ...]:
    return tuple(history_for("coding", n, 0, max_context=_cost().model.max_context))


def _run(policy: str, setup: JudgeSetup, gpus: int = 8) -> tuple[JudgeReport, JudgedRun]:
    return simulate_judged(_workload(), policy, _cost(), gpus, setup, history=_history(),
                           record_spans=True)


def _finished(run: JudgedRun, rollout: str) -> float:
    at = run.rollouts.trajs[rollout].finished_at
    assert at is not None
    return at


def _turn_starts(run: JudgedRun, cluster: str) -> dict[str, float]:
    """First turn start of every trajectory that ran on `cluster` (rollouts|judges)."""
    out: dict[str, float] = {}
    for s in getattr(run, cluster).spans:
        if s.kind == "turn":
            out[s.traj_id] = min(s.start, out.get(s.traj_id, s.start))
    return out


# -- the size model and the mode's syntax -----------------------------------------------


def test_a_judge_call_reads_the_context_up_to_the_cap_and_replies_in_range() -> None:
    sizes = JudgeSizes(context_cap=1000, template_tokens=100, output_tokens=(10, 20))
    short = TrajectorySpec("a", "g", 300, (TurnSpec(200, 1.0, 50), TurnSpec(100, 0.0, 0)))
    long = TrajectorySpec("b", "g", 3000, (TurnSpec(5, 0.0, 0),))
    call = judge_call(short, sizes, seed=0)
    assert (call.traj_id, call.group_id, call.num_turns) == ("a/judge", "a/judge", 1)
    assert call.prompt_tokens == 100 + 650  # the whole context: 300 + 200 + 50 + 100
    assert judge_call(long, sizes, seed=0).prompt_tokens == 100 + 1000  # capped
    replies = {judge_call(TrajectorySpec(f"t{i}", "g", 10, (TurnSpec(1, 0.0, 0),)), sizes,
                          seed=0).output_tokens for i in range(200)}
    assert min(replies) >= 10 and max(replies) <= 20 and len(replies) > 5
    assert judge_call(short, sizes, 0) == judge_call(short, sizes, 0)  # seeded
    assert any(judge_call(TrajectorySpec(f"t{i}", "g", 10, (TurnSpec(1, 0.0, 0),)), sizes,
                          1).output_tokens != judge_call(
        TrajectorySpec(f"t{i}", "g", 10, (TurnSpec(1, 0.0, 0),)), sizes, 0).output_tokens
        for i in range(20))


@pytest.mark.parametrize("text", ["", "dedicated", "dedicated:0", "dedicated:x", "shared:2",
                                  "before"])
def test_bad_judge_modes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"dedicated|judge mode"):
        parse_judge(text)


def test_judge_modes_parse() -> None:
    assert parse_judge("shared") == SHARED and parse_judge(" after ") == AFTER
    assert parse_judge("dedicated:8") == JudgeSetup(JudgeMode.DEDICATED, 8)
    assert parse_judge("dedicated:8").label == "dedicated:8"


# -- each mode's semantics ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["verl", "treadle"])
def test_after_starts_no_judge_call_before_the_last_rollout_finished(policy: str) -> None:
    report, run = _run(policy, AFTER)
    starts = _turn_starts(run, "judges")
    calls = {c.traj_id for c in run.calls.values()}
    assert calls <= set(starts)  # every call ran
    assert min(starts[c] for c in calls) >= run.rollout_makespan_s
    assert run.judged_makespan_s > run.rollout_makespan_s
    # Its rollout phase is the rollout phase alone: nothing else ran before its end.
    alone = simulate(_workload(), policy, _cost(), 8, history=_history())[0]
    assert run.rollout_makespan_s == alone.makespan_s
    assert report.rollout_alone_makespan_s == alone.makespan_s


@pytest.mark.parametrize("policy", ["verl@tp2", "treadle"])
def test_dedicated_keeps_judge_calls_and_rollouts_on_their_own_pools(policy: str) -> None:
    report, run = _run(policy, JudgeSetup(JudgeMode.DEDICATED, 2))
    calls = {c.traj_id for c in run.calls.values()}
    assert run.judges is not run.rollouts
    assert {s.traj_id for s in run.judges.spans} == calls  # only judge calls there ...
    assert not calls & {s.traj_id for s in run.rollouts.spans}  # ... and none here
    assert sum(e.tp for e in run.judges.all_engines) <= 2 == run.judges.gpus
    assert sum(e.tp for e in run.rollouts.all_engines) <= 6 == run.rollouts.gpus
    assert (report.rollout_gpus, report.judge_gpus) == (6, 2)
    # Calls start when their rollouts finish, not after the phase: some overlap it.
    starts = _turn_starts(run, "judges")
    assert min(starts.values()) < run.rollout_makespan_s
    for rollout, call in run.calls.items():
        assert starts[call.traj_id] >= _finished(run, rollout)


def _watch(policy: TrajectoryScheduler, calls: set[str],
           monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Record, at every decision, the ranks admitted (judge calls', rollouts'), the
    rollout turns a judge admission left waiting in its engine's queue, and the
    rollout turns queued."""
    seen: dict[str, list[Any]] = {"judge_ranks": [], "rollout_ranks": [], "behind": [],
                                  "rollouts_queued": []}
    decide = policy.decide

    def watched(now: float) -> list[Decision]:
        out = decide(now)
        for d in out:
            if isinstance(d, Admit) and d.traj_id not in calls:
                seen["rollout_ranks"].append(d.priority)
            if isinstance(d, Admit) and d.traj_id in calls:
                seen["judge_ranks"].append(d.priority)
                e = policy.engines[d.engine_id]
                seen["behind"] += [t.traj_id for t in policy.trajs.values()
                                   if t.traj_id not in calls and t.phase is Phase.QUEUED
                                   and t.traj_id in e.queue]
        seen["rollouts_queued"] += [t.traj_id for t in policy.trajs.values()
                                    if t.traj_id not in calls and t.phase is Phase.QUEUED]
        return out

    monkeypatch.setattr(policy, "decide", watched)
    return seen


@pytest.mark.parametrize(("policy", "n", "gpus"), [("verl", 256, 2), ("treadle", 64, 8)])
def test_shared_runs_judge_calls_on_the_rollout_engines_behind_every_rollout_turn(
        policy: str, n: int, gpus: int, monkeypatch: pytest.MonkeyPatch) -> None:
    workload, cost = _workload(n), _cost()
    history = history_for("coding", n, 0, max_context=cost.model.max_context)
    calls = {t.traj_id: judge_call(t, JudgeSizes(), 0) for t in workload.trajectories}
    spec = parse_policy(policy)
    sched = build_policy(spec, cost, batch_size=n, history=history, max_batch=MAX_BATCH)
    seen = _watch(sched, {c.traj_id for c in calls.values()}, monkeypatch)
    run = run_shared_engines(workload.trajectories, calls, sched, cost, gpus,
                             sched.initial_pool(gpus), after=False, record_spans=True)
    judge_ids = {c.traj_id for c in calls.values()}
    engines = {e.engine_id for e in run.rollouts.all_engines}
    assert run.judges is run.rollouts
    assert {s.engine_id for s in run.rollouts.spans if s.traj_id in judge_ids} <= engines
    starts = _turn_starts(run, "judges")
    assert judge_ids <= set(starts)
    for rollout, call in calls.items():  # each call starts once its rollout finished
        assert starts[call.traj_id] >= _finished(run, rollout)
    assert min(starts[c] for c in judge_ids) < run.rollout_makespan_s  # streamed, not after
    assert len(seen["judge_ranks"]) >= len(judge_ids)
    # Ranked as the judge class: after every rollout turn.
    assert min(seen["judge_ranks"]) > max(seen["rollout_ranks"]) + JUDGE_RANK / 2
    assert seen["behind"] == []  # no rollout turn waited while a judge turn was admitted
    if policy == "verl":  # the check had queues to look at
        assert seen["rollouts_queued"]


# -- the report -------------------------------------------------------------------------------


def test_a_judged_run_is_deterministic() -> None:
    a = _run("treadle", SHARED)[0]
    b = _run("treadle", SHARED)[0]
    assert a.trace_digest == b.trace_digest
    assert {**asdict(a), "sim_wall_s": 0} == {**asdict(b), "sim_wall_s": 0}


def test_sim_judge_json_reports_both_makespans_per_policy(
        capsys: pytest.CaptureFixture[str]) -> None:
    for mode in ("shared", "after", "dedicated:2"):
        assert main(["sim", "--judge", mode, "--trajectories", "32", "--gpus", "8",
                     "--policies", "verl@tp2,treadle", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["judge"] == mode and out["judge_sizes"]["context_cap"] == 8192
        assert [r["policy"] for r in out["results"]] == ["verl@tp2", "treadle"]
        for r in out["results"]:
            assert r["judge"] == mode and r["judge_calls"] == 32
            assert r["judged_makespan_s"] >= r["rollout_makespan_s"] > 0
            assert r["judged_over_rollout"] == pytest.approx(
                r["judged_makespan_s"] / r["rollout_makespan_s"])
            assert r["overhead"] == pytest.approx(
                r["judged_makespan_s"] / r["rollout_alone_makespan_s"] - 1)
            assert 0 <= r["judge_latency_p50_s"] <= r["judge_latency_max_s"]
            assert r["rollout_gpus"] + r["judge_gpus"] == 8
            if mode == "after":
                assert r["rollout_makespan_s"] == r["rollout_alone_makespan_s"]


def test_sim_judge_table_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--judge", "dedicated:2", "--trajectories", "16", "--gpus", "4",
                 "--policies", "verl@tp2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["policy", "judge", "alone_s"]
    assert "tp2x1 | tp2x1" in lines[1]
    for argv, words in ((["--judge", "before"], "judge mode"),
                        (["--judge", "dedicated:8", "--gpus", "8"], "no room"),
                        (["--judge", "shared", "--steps", "2"], "one rollout step"),
                        (["--judge", "shared", "--judge-output", "9"], "LO,HI"),
                        (["--judge", "after", "--judge-output", "9,3"], "LO <= HI")):
        assert main(["sim", "--trajectories", "16", "--gpus", "8", "--policies", "verl",
                     *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("treadle: error:") and words in err[-1]


def test_bench_judge_writes_the_three_modes_side_by_side(tmp_path: Path) -> None:
    from argparse import Namespace

    from treadle.bench.judge import run_judge_bench

    out = tmp_path / "judge.json"
    report = run_judge_bench(Namespace(workload="coding", trajectories=32, gpus=16,
                                       judge_gpus=8, policies="verl@tp8,treadle", seed=0,
                                       live=False, out=str(out)), log=lambda _: None)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["modes"] == ["shared", "after", "dedicated:8"]
    for section in ("default", "heavy"):
        for p in report[section]["policies"]:
            rows = {r["judge"]: r for r in p["results"]}
            assert set(rows) == set(report["modes"])
            fastest = min(rows.values(), key=lambda r: r["judged_makespan_s"])
            assert p["summary"]["fastest"] == fastest["judge"]
            assert p["summary"]["shared_beats_after"] == (
                rows["shared"]["judged_makespan_s"] < rows["after"]["judged_makespan_s"])
    goal = report["goal"]
    assert goal["met"] == (goal["shared_under_10pct"] and goal["shared_beats_after"]
                           and goal["shared_beats_dedicated"])
