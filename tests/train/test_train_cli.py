"""`treadle train sft | eval`: bad input is one line and exit 2; eval prints a report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.cli import main


@pytest.mark.parametrize("argv", [
    ["train", "eval", "--model", "/nonexistent"],
    ["train", "sft", "--steps", "0"],
    ["train", "sft", "--eval-tasks", "5000"],
    ["train", "sft", "--direct-share", "1"],
    ["train", "grpo", "--sft-direct-share", "-0.1"],
    ["train", "grpo", "--group", "1"],
    ["train", "grpo", "--eval-tasks", "5000"],
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    assert main([*argv, *(["--out", str(tmp_path)] if argv[1] != "eval" else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"treadle train {argv[1]}: ") and "\n" not in err


def test_eval_prints_the_report(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "eval", "--model", str(tiny_dir), "--tasks", "2", "--seed", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trajectories"] == 2 and report["seed"] == 1 and report["temperature"] == 1.0
