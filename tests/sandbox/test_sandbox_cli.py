"""`sandbox exec` through the CLI hook, called with an argv list."""

from __future__ import annotations

import argparse
import json
import os

import pytest
from sandbox_helpers import require_bwrap, run

from treadle.sandbox import exec_once
from treadle.sandbox.cli import add_parser, main


def test_local_exec_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sandbox", "exec", "--backend", "local", "--timeout", "5", "--memory-mb", "256",
                 "--", "sh", "-c", "echo out; echo err >&2; exit 3"])
    captured = capsys.readouterr()
    assert code == 0
    payload = json.loads(captured.out)
    assert payload["exit_code"] == 3 and payload["stdout"] == "out\n"
    assert payload["stderr"] == "err\n" and payload["killed"] is None
    assert payload["timed_out"] is False and isinstance(payload["duration_s"], float)


def test_timeout_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sandbox", "exec", "--backend", "local", "--timeout", "0.5", "--",
                 "sleep", "30"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["timed_out"] is True and payload["killed"] == "timeout"
    assert payload["exit_code"] is None


@pytest.mark.parametrize("argv", [
    ["sandbox", "exec", "--backend", "local"],  # no command
    ["sandbox", "exec", "--backend", "docker", "--", "true"],
    ["sandbox", "exec", "--timeout", "soon", "--", "true"],
    ["sandbox", "exec", "--memory-mb", "-1", "--", "true"],
])
def test_bad_input_exits_2_with_one_line(argv: list[str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1


def test_missing_bwrap_exits_2(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["sandbox", "exec", "--backend", "bwrap", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "bwrap" in err and "system-deps.sh" in err and len(err.strip().splitlines()) == 1


def test_add_parser_plugs_into_a_main_parser() -> None:
    parser = argparse.ArgumentParser(prog="treadle")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sandbox", "exec", "--backend", "local", "--", "echo", "hi"])
    assert callable(args.func) and args.argv[-2:] == ["echo", "hi"]


@pytest.mark.integration
def test_bwrap_exec_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    require_bwrap()
    assert main(["sandbox", "exec", "--backend", "bwrap", "--timeout", "5", "--",
                 "sh", "-c", "id -u; ls /home 2>&1"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["exit_code"] != 0  # /home does not exist inside
    assert "No such file" in payload["stdout"]


def test_exec_once_runs_and_cleans_up() -> None:
    result = run(exec_once("local", ["sh", "-c", "echo $HOME"], timeout_s=5, memory_mb=128))
    assert result.ok and "treadle-sb-" in result.stdout
    assert not os.path.exists(result.stdout.strip())
