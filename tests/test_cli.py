"""The command line (`treadle.cli`): `sim` output as JSON, as a table and as a
timeline, and bad input ending in exit code 2 with one line on stderr."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from treadle.cli import main
from treadle.core.cost_model import CostModel
from treadle.core.policies import build_policy, parse_policy
from treadle.sim.runner import outcomes
from treadle.workloads import generate

SMALL = ["--trajectories", "32", "--gpus", "8"]
REPORT_KEYS = ("makespan_s", "tokens_per_s", "lower_bound_s", "ratio_to_lower_bound")


def _line(**over: object) -> str:
    record: dict[str, object] = {
        "id": "t0", "group": "g0", "prompt_tokens": 300,
        "turns": [{"output_tokens": 200, "tool_latency_s": 0.5, "tool_output_tokens": 40},
                  {"output_tokens": 100, "tool_latency_s": 0.0, "tool_output_tokens": 0}],
    }
    record.update(over)
    return json.dumps(record)


def _trace(tmp_path: Path, lines: list[str], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _one_error_line(capsys: pytest.CaptureFixture[str], after_progress: bool = False) -> str:
    """The single error line on stderr. With `after_progress` (an error found while
    simulating) progress lines may come before it, but the error is still one line
    and the last."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == ""
    if after_progress:
        assert [ln for ln in lines if ln.startswith("treadle: error: ")] == lines[-1:]
    else:
        assert len(lines) == 1, captured.err
    assert lines[-1].startswith("treadle: error: ")
    return lines[-1]


# -- success ---------------------------------------------------------------------------------


def test_sim_json_reports_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "--workload", "search", *SMALL, "--policies", "slime,verl,treadle",
               "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"] == "search"
    assert out["gpus"] == 8
    assert out["model"] == "qwen3-14b"
    assert out["trajectories"] == 32
    results = out["results"]
    assert [r["policy"] for r in results] == ["slime", "verl", "treadle"]
    for r in results:
        for key in REPORT_KEYS:
            assert isinstance(r[key], float) and r[key] > 0, key
        assert r["ratio_to_lower_bound"] >= 1.0
        assert r["ratio_to_lower_bound"] == pytest.approx(r["makespan_s"] / r["lower_bound_s"])
    assert len({r["lower_bound_s"] for r in results}) == 1


def test_sim_table_lists_each_policy(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "--workload", "math", *SMALL, "--policies", "verl-star,verl@tp8,oracle"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["policy", "makespan_s"]
    assert [line.split()[0] for line in lines[1:]] == ["verl-star", "verl@tp8", "oracle"]


def test_sim_replays_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path, [_line(id=f"t{i}") for i in range(5)], "mine.jsonl")
    rc = main(["sim", "--workload", str(path), "--gpus", "2", "--policies", "verl", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"] == "mine" and out["trajectories"] == 5


def _flat_short(tmp_path: Path, name: str, seed: int) -> Path:
    """512 one-turn trajectories of 250-450 tokens in groups of 16."""
    rng = random.Random(seed)
    return _trace(tmp_path, [_line(id=f"s{seed}-g{g}-r{r}", group=f"s{seed}-g{g}",
                                   turns=[{"output_tokens": rng.randint(250, 450),
                                           "tool_latency_s": 0.0, "tool_output_tokens": 0}])
                             for g in range(32) for r in range(16)], name)


def test_sim_history_of_a_trace_informs_treadles_pool(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Cold, treadle takes the largest TP degree; told the previous step (short, flat
    trajectories), it scores the pools by simulation and takes the fastest one."""
    step, previous = _flat_short(tmp_path, "step.jsonl", 0), _flat_short(tmp_path, "prev.jsonl", 1)
    runs = {}
    for label, extra in (("cold", []), ("warm", ["--history", str(previous)])):
        rc = main(["sim", "--workload", str(step), "--gpus", "16", "--json",
                   "--policies", "verl@tp4,verl@tp8,treadle", *extra])
        assert rc == 0
        runs[label] = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert runs["cold"]["treadle"]["layout"] == "tp8x2"
    assert runs["warm"]["treadle"]["layout"] == "tp4x4"
    assert runs["warm"]["verl@tp4"]["makespan_s"] < runs["warm"]["verl@tp8"]["makespan_s"]
    assert runs["warm"]["treadle"]["makespan_s"] <= runs["warm"]["verl@tp4"]["makespan_s"] * 1.01


def test_sim_timeline_writes_an_svg_page(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "timeline.html"
    rc = main(["sim", "--workload", "coding", "--trajectories", "16", "--gpus", "8",
               "--policies", "slime,verl", "--timeline", str(target)])
    assert rc == 0
    html = target.read_text()
    assert "<svg" in html
    assert "verl on coding" in html  # the last policy's run
    assert "timeline written" in capsys.readouterr().err


# -- bad input: exit 2, one line on stderr ------------------------------------------------------


def test_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--workload", "search", *SMALL, "--policies", "slime,fifo"]) == 2
    line = _one_error_line(capsys)
    assert "fifo" in line and "verl-star" in line


def test_tp_suffix_on_a_planning_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--workload", "search", *SMALL, "--policies", "heddle@tp4"]) == 2
    assert "@tp" in _one_error_line(capsys)


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--workload", "search", *SMALL, "--model", "llama-70b"]) == 2
    line = _one_error_line(capsys)
    assert "llama-70b" in line and "qwen3-14b" in line
    assert not line.endswith(('"', "'"))


def test_unknown_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--workload", "search", *SMALL, "--gpu", "a100"]) == 2
    line = _one_error_line(capsys)
    assert "a100" in line and "h100" in line and "h200" in line


def test_missing_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert main(["sim", "--workload", str(missing), "--gpus", "8"]) == 2
    line = _one_error_line(capsys)
    assert "nope.jsonl" in line and "coding" in line


def test_missing_history_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "before.jsonl"
    assert main(["sim", "--workload", "math", "--history", str(missing), *SMALL]) == 2
    assert "before.jsonl" in _one_error_line(capsys)


def test_trace_with_a_malformed_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path, [_line(id="a"), _line(id="b", prompt_tokens="many"), _line(id="c")])
    assert main(["sim", "--workload", str(path), "--gpus", "8", "--policies", "verl"]) == 2
    line = _one_error_line(capsys)
    assert f"{path}:2:" in line
    assert "prompt_tokens" in line


def test_trace_with_broken_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path, [_line(id="a"), _line(id="b"), '{"id": "c", '])
    assert main(["sim", "--workload", str(path), "--gpus", "8", "--policies", "verl"]) == 2
    line = _one_error_line(capsys)
    assert f"{path}:3:" in line and "JSON" in line


def test_trace_with_a_negative_latency(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    turns = [{"output_tokens": 10, "tool_latency_s": -1.0, "tool_output_tokens": 5},
             {"output_tokens": 10, "tool_latency_s": 0.0, "tool_output_tokens": 0}]
    path = _trace(tmp_path, [_line(id="ok"), _line(id="bad", turns=turns)])
    assert main(["sim", "--workload", str(path), "--gpus", "8", "--policies", "verl"]) == 2
    line = _one_error_line(capsys)
    assert ":2:" in line and "turns[0].tool_latency_s" in line and ">= 0" in line


@pytest.mark.parametrize(("args", "needle"), [
    (["--gpus", "0"], "--gpus"),
    (["--trajectories", "33"], "multiple"),
    (["--policies", ","], "--policies"),
])
def test_other_bad_arguments(args: list[str], needle: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--workload", "search", "--trajectories", "32", "--gpus", "8"]
    assert main([*argv, *args]) == 2
    assert needle in _one_error_line(capsys)


def test_cluster_too_small_for_a_baseline_engine(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--workload", "search", "--trajectories", "32", "--model", "qwen3-32b",
            "--gpus", "1", "--policies", "slime"]
    assert main(argv) == 2
    assert "TP-2" in _one_error_line(capsys, after_progress=True)


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("policy", ["treadle", "heddle", "oracle"])
def test_planning_policies_reject_a_cluster_too_small_for_one_engine(policy: str,
                                                                     warm: bool) -> None:
    """Regression: with fewer GPUs than the model's smallest TP degree, heddle and
    treadle planned an empty pool, and `treadle sim` spun 50M events (~2.5 min)
    before dying with a traceback instead of exiting 2."""
    cost = CostModel.named("qwen3-32b", "h100")  # needs TP >= 2
    workload = generate("search", 16, seed=0)
    truth = {t.traj_id: o for t, o in zip(workload.trajectories, outcomes(workload),
                                          strict=True)}
    sched = build_policy(parse_policy(policy), cost, batch_size=16,
                         history=outcomes(workload) if warm else (),
                         truth=truth if policy == "oracle" else None)
    with pytest.raises(ValueError, match="TP-2"):
        sched.initial_pool(1)  # type: ignore[attr-defined]


def test_too_small_cluster_for_a_planning_policy_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path, [_line(id="a")])
    argv = ["sim", "--workload", str(path), "--model", "qwen3-32b", "--gpus", "1",
            "--policies", "treadle,heddle"]
    assert main(argv) == 2
    assert "TP-2" in _one_error_line(capsys, after_progress=True)


def test_workload_that_is_a_directory(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    assert main(["sim", "--workload", str(folder), "--gpus", "8", "--policies", "verl"]) == 2
    assert "traces" in _one_error_line(capsys)


def test_sim_steps_without_a_staleness_bound(capsys: pytest.CaptureFixture[str]) -> None:
    """`--max-staleness none` lifts the bound (nothing is restarted as stale); a bound
    that is not a count of versions is refused."""
    argv = ["sim", "--workload", "coding", *SMALL, "--steps", "3", "--mode", "partial",
            "--policies", "verl@tp8", "--prompts", "4", "--overprovision", "1.0", "--json"]
    assert main([*argv, "--max-staleness", "1"]) == 0
    bounded = json.loads(capsys.readouterr().out)["results"][0]
    assert bounded["staleness_max"] <= 1 and bounded["groups_restarted"] > 0
    assert main([*argv, "--max-staleness", "none"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_staleness"] is None
    assert out["results"][0]["staleness_max"] > 1
    assert out["results"][0]["groups_restarted"] == 0
    for bad in ("-1", "x"):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--max-staleness", bad])
        assert exc.value.code == 2
        assert "versions >= 0 or none" in capsys.readouterr().err


def test_bench_merge_refuses_a_report_it_cannot_add_to_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sim", "--merge", str(tmp_path / "r.json")]) == 2
    assert "--steps" in _one_error_line(capsys)
    (tmp_path / "r.json").write_text("{not json")
    args = ["bench", "sim", "--steps", "2", "--sizes", "32", "--workloads", "short",
            "--policies", "oracle", "--merge", str(tmp_path / "r.json"),
            "--out", str(tmp_path / "out.json")]
    assert main(args) == 2
    assert "not a multi-step report" in _one_error_line(capsys, after_progress=True)
    assert main([*args[:-4], "--merge", str(tmp_path / "none.json"),
                 "--out", str(tmp_path / "out.json")]) == 2
    assert "not a multi-step report" in _one_error_line(capsys, after_progress=True)
