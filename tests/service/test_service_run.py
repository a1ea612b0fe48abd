"""`treadle run` end to end: a replayed workload on emulated engines (a service
started in-process, and one already running at --url), suite tasks on a fake engine
(`FakeVLLMServer`, scripted replies: it checks the suite path's plumbing, not a
model), and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.cli import main
from treadle.client import RolloutClient
from treadle.engines.base import derived_seed
from treadle.service.state import ServiceConfig
from treadle.store.export import read_parquet
from treadle.types import TrajectoryStatus

pytestmark = [pytest.mark.integration]
TOKEN = "run-token"


def _report_rows(html: str) -> list[list[Any]]:
    data = re.search(r'<script id="tl-data" type="application/json">(.*?)</script>', html)
    assert data is not None
    rows: list[list[Any]] = json.loads(data.group(1))["rows"]
    return rows


def test_a_replayed_workload_on_a_service_started_here(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--workload", "math", "--trajectories", "32", "--group", "8",
                 "--time-scale", "0.01", "--policy", "verl", "--job-id", "w1",
                 "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    table = out.splitlines()
    assert table[0].split() == ["status", "count", "reward", "turns", "tokens", "tool_s"]
    assert table[1].split()[:3] == ["completed", "32", "-"]  # a replay has no reward
    assert table[-1].split()[:2] == ["all", "32"]
    # Progress: plain lines (stderr is no terminal here), the last one the whole batch.
    lines = [x for x in err.splitlines() if x.startswith("treadle run: ") and "done" in x]
    assert len(lines) >= 2 and "32/32 done (completed 32)" in lines[-1]
    assert "tokens/s" in lines[-1]
    back = list(read_parquet(tmp_path / "w1.parquet"))
    assert [seq for seq, _ in back] == list(range(1, 33))
    assert {t.key.group_id for _, t in back} == {f"w1/math-s0-g{g:04d}" for g in range(4)}
    assert all(t.status is TrajectoryStatus.COMPLETED for _, t in back)
    html = (tmp_path / "w1.html").read_text(encoding="utf-8")
    assert "reconstructed from the trajectory record" in html
    assert "modelled seconds" in html
    rows = _report_rows(html)
    assert sorted(r[0] for r in rows) == sorted(t.trajectory_id for _, t in back)
    by_id = {t.trajectory_id: t for _, t in back}
    for r in rows:  # tokens, turns and the time split are the record's
        t = by_id[r[0]]
        assert (r[3], r[4]) == (t.output_tokens, len(t.turns))
        assert r[5] == round(t.timings.llm_s, 2) and r[6] == round(t.timings.tool_s, 2)


def test_a_running_service_at_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = ServiceConfig(db=str(tmp_path / "s.db"), token=TOKEN, emulate=2, time_scale=0.01,
                           policy="verl")
    with running_service(config) as url:
        code = main(["run", "--workload", "coding", "--trajectories", "32", "--url", url,
                     "--token", TOKEN, "--job-id", "u1", "--out", str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 0, err
        with RolloutClient(url, token=TOKEN) as client:
            streamed = [(d.seq, d.trajectory) for d in client.trajectories("u1")]
        bad = main(["run", "--workload", "coding", "--trajectories", "32", "--url", url,
                    "--token", "wrong", "--out", str(tmp_path)])
        assert bad == 1 and "401" in capsys.readouterr().err
    assert list(read_parquet(tmp_path / "u1.parquet")) == streamed
    assert f"the service at {url}" in (tmp_path / "u1.html").read_text(encoding="utf-8")


def test_suite_tasks_from_a_file_on_a_fake_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = build_tokenizer(tmp_path / "tok")
    reply = [*tokenizer.encode("the answer is \\boxed{3}"), tokenizer.token_id("<|im_end|>")]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(r) for r in (
        {"id": "q1", "question": "What is 1 + 2?", "answer": "3"},
        {"id": "q2", "question": "What is 2 + 2?", "answer": "4"},
        {"id": "q3", "question": "What is 6 / 2?", "answer": "3"})) + "\n", encoding="utf-8")
    fake = FakeVLLMServer(reply_ids=reply)
    with fake.serve() as engine:
        code = main(["run", str(tasks), "--suite", "math", "--group", "2", "--suite-options",
                     '{"python_tool": false}', "--engine", engine, "--served-model", "m",
                     "--tokenizer", str(tmp_path / "tok"), "--max-turns", "2",
                     "--sampling-seed", "3", "--job-id", "s1", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines()[1].split()[:3] == ["completed", "6", "0.667"]
    back = [t for _, t in read_parquet(tmp_path / "s1.parquet")]
    assert sorted((t.task_id, t.reward) for t in back) == [
        ("q1", 1.0), ("q1", 1.0), ("q2", 0.0), ("q2", 0.0), ("q3", 1.0), ("q3", 1.0)]
    assert all(t.segments and t.segments[0].response_ids == reply for t in back)
    # Each (task, sample)'s one turn reached the engine with its own derived seed.
    assert sorted(b["seed"] for b in fake.requests) == sorted(
        derived_seed(3, task, sample, 0) for task in ("q1", "q2", "q3") for sample in (0, 1))


@pytest.mark.parametrize(("argv", "message"), [
    ([], "no tasks"),
    (["TASKS"], "say which suite's records these are"),
    (["TASKS", "--suite", "math", "--n", "3"], "--n generates tasks"),
    (["--workload", "math", "--suite", "math"], "--workload replays a workload"),
    (["--workload", "no-such.jsonl"], "cannot read it"),
    (["--workload", "math", "--group", "0"], "--group must be >= 1"),
    (["--suite", "math", "--n", "2"], "no engines"),
    (["--workload", "math", "--url", "http://x", "--emulate", "2"], "not with --url"),
    (["--workload", "math", "--suite-options", "[1]"], "--workload replays"),
    (["--suite", "math", "--n", "2", "--suite-options", "{", "--url", "http://x"],
     "--suite-options: not JSON"),
    (["BAD", "--suite", "math", "--url", "http://x"], "bad.jsonl:2: not JSON"),
])
def test_bad_input_is_one_line_and_exit_code_2(
        argv: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n{nope\n', encoding="utf-8")
    argv = [str(tmp_path / "tasks.jsonl") if a == "TASKS" else str(bad) if a == "BAD" else a
            for a in argv]
    assert main(["run", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("treadle run: "), err
    assert message in err


def test_a_bad_record_is_named_by_its_file_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer_dir = tmp_path / "tok"
    build_tokenizer(tokenizer_dir)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "question": "?", "answer": "1"}\n\n'
                     '{"id": "b", "question": "?"}\n', encoding="utf-8")
    config = ServiceConfig(db=":memory:", tokenizer=str(tokenizer_dir))
    with running_service(config) as url:
        code = main(["run", str(tasks), "--suite", "math", "--suite-options",
                     '{"python_tool": false}', "--url", url, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{tasks}:3: " in err and "answer" in err
