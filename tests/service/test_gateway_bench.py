"""`treadle bench gateway` end to end on a tiny configuration: the report has what
benchmarks/README.md reads from it, and every call of both arms succeeded (no timing
is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle.agent.tokenizer import HFTokenizer
from treadle.bench.gateway import build_tokenizer, run_gateway_bench
from treadle.cli import main
from treadle.engines.emulated import VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_tiny_run_reports_both_arms_at_each_level_with_every_call_answered() -> None:
    report = run_gateway_bench(sessions=[1, 2], calls=3, round_calls=3, rounds=2, warmup=0,
                               max_tokens=8, time_scale=0.01, model="qwen3-14b", gpu="h100",
                               aim_ms=2.0, log=lambda _m: None)
    assert report["setup"]["sessions"] == [1, 2] and report["setup"]["policy"] == "verl"
    assert [level["sessions"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        for arm in ("direct", "gateway"):
            row = level[arm]
            assert row["failures"] == 0
            assert row["calls"] == row["expected_calls"] == level["sessions"] * 3 * 2
            assert 0 < row["p50_ms"] <= row["p99_ms"]
            for key in ("service_cpu_ms_per_call", "engine_cpu_ms_per_call",
                        "client_cpu_ms_per_call", "calls_per_s", "machine_busy_pct"):
                assert row[key] >= 0
        # The direct arm sends the contexts the gateway renders: the same sizes.
        assert level["direct"]["prompt_tokens_mean"] == pytest.approx(
            level["gateway"]["prompt_tokens_mean"], rel=0.01)
        assert set(level["added"]) == {"p50_ms_paired", "p50_ms_pooled", "p99_ms_paired",
                                       "p99_ms_pooled", "service_cpu_ms_per_call"}
        assert [r["first"] for r in level["rounds"]] == ["direct", "gateway"]
    aim = report["aim"]
    assert aim["aim_p50_added_ms"] == 2.0 and aim["at_sessions"] == 2
    assert aim["added_p50_ms"] == report["levels"][1]["added"]["p50_ms_paired"]
    assert aim["met"] is (aim["added_p50_ms"] < 2.0)


def test_the_built_tokenizer_spells_every_engine_id_and_round_trips_text(
        tmp_path: Path) -> None:
    tok = HFTokenizer(build_tokenizer(tmp_path / "tok"))
    assert tok.token_id("<|im_end|>") == VOCAB - 1
    assert tok.decode([VOCAB - 4]).strip()  # the last ordinary id is a word
    text = "<|im_start|>user\nstep 3: the program printed 24 rows<|im_end|>\n"
    assert tok.decode(tok.encode(text)) == text
    again = HFTokenizer(build_tokenizer(tmp_path / "again"))
    assert again.encode(text) == tok.encode(text)  # the same every run


@pytest.mark.parametrize("args", [["--sessions", "0"], ["--sessions", "a,b"],
                                  ["--calls", "0"], ["--time-scale", "0"],
                                  ["--model", "no-such-model"]])
def test_bad_arguments_exit_2_with_one_line(args: list[str], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "gateway", *args, "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treadle bench gateway: ") and "\n" not in err
    assert not (tmp_path / "r.json").exists()
