"""The multi-step benchmark (`treadle.bench.sim_steps`) on a tiny configuration: every
row is at or above its mode's lower bound, the summary compares treadle's best mode
with the best TP-tuned baseline's, and the markdown shows it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from treadle.bench.sim_steps import run_steps_bench


def test_a_tiny_multi_step_bench(tmp_path: Path) -> None:
    out = tmp_path / "sim-steps.json"
    args = argparse.Namespace(sizes="64", workloads="short", seed=0, out=str(out), steps=2,
                              modes="sync,partial", policies="verl,verl@tp8,treadle",
                              train_fraction=0.3, max_staleness=1, jobs=1)
    report = run_steps_bench(args, log=lambda _: None)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))  # tuples: lists
    (w,) = report["workloads"]
    rows = w["results"]
    assert {(r["mode"], r["policy"]) for r in rows} == {
        (m, p) for m in ("sync", "partial") for p in ("verl", "verl@tp8", "treadle")}
    for r in rows:
        assert r["makespan_s"] >= w["lower_bounds"][r["mode"]]["makespan_s"] * (1 - 1e-9)
        assert r["lower_bound_s"] == w["lower_bounds"][r["mode"]]["makespan_s"]
        assert r["staleness_max"] <= 1
        # No run trains more tokens per GPU-second than its mode's ceiling.
        ceiling = w["summary"]["per_mode"][r["mode"]]["ceiling_tokens_per_gpu_s"]
        assert r["trained_tokens_per_gpu_s"] <= ceiling * (1 + 1e-9)
        assert ceiling == w["lower_bounds"][r["mode"]]["tokens_per_gpu_s_ceiling"]
    s = w["summary"]
    best = max((r for r in rows if r["policy"] != "treadle"),
               key=lambda r: r["trained_tokens_per_gpu_s"])
    assert (s["best_tp_tuned"]["policy"], s["best_tp_tuned"]["mode"]) == (best["policy"],
                                                                         best["mode"])
    ours = max((r for r in rows if r["policy"] == "treadle"),
               key=lambda r: r["trained_tokens_per_gpu_s"])
    assert s["treadle_best_over_best_tp_tuned"] == (
        ours["trained_tokens_per_gpu_s"] / best["trained_tokens_per_gpu_s"])
    assert [r["mode"] for r in w["prompt_history"]["treadle_without"]] == ["sync", "partial"]
    assert s["ceiling_over_best_tp_tuned"] == max(
        m["ceiling_tokens_per_gpu_s"] for m in s["per_mode"].values()
    ) / best["trained_tokens_per_gpu_s"]
    markdown = out.with_suffix(".md").read_text()
    assert f"| {best['policy']} ({best['mode']}) |" in markdown


_WALL = ("layout_choice_s", "sim_wall_s")


def _rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    plain = json.loads(json.dumps(report))  # tuples: lists, as the file has them
    return [{k: v for k, v in r.items() if k not in _WALL}
            for w in plain["workloads"] for r in w["results"]]


def test_merge_adds_a_policy_as_a_whole_run_would(tmp_path: Path) -> None:
    """`--merge` runs only the named policies and gives the report a run of all of
    them gives (wall-clock fields aside); the oracle's row is among them."""
    common = {"sizes": "32", "workloads": "short", "seed": 0, "steps": 2,
              "modes": "sync,partial", "train_fraction": 0.3, "max_staleness": 1, "jobs": 1}
    base = tmp_path / "base.json"
    run_steps_bench(argparse.Namespace(**common, out=str(base), policies="verl,treadle"),
                    log=lambda _: None)
    merged = run_steps_bench(argparse.Namespace(**common, out=str(tmp_path / "m.json"),
                                                policies="treadle,oracle", merge=str(base)),
                             log=lambda _: None)
    whole = run_steps_bench(argparse.Namespace(**common, out=str(tmp_path / "w.json"),
                                               policies="verl,treadle,oracle"),
                            log=lambda _: None)
    assert _rows(merged) == _rows(whole)
    assert {r["policy"] for r in _rows(merged)} == {"verl", "treadle", "oracle"}
    (w,) = merged["workloads"]
    assert w["summary"]["oracle_best"] == whole["workloads"][0]["summary"]["oracle_best"]
    assert w["summary"]["oracle_best"] is not None
    assert [r["mode"] for r in w["prompt_history"]["treadle_without"]] == ["sync", "partial"]
    first = json.loads(base.read_text())
    assert merged["wall_s"] == first["wall_s"]  # the report's own run, and the merge's
    assert [m["policies"] for m in merged["merges"]] == [["treadle", "oracle"]]
    with pytest.raises(ValueError, match="steps"):
        run_steps_bench(argparse.Namespace(**{**common, "steps": 3}, out=str(tmp_path / "x"),
                                           policies="oracle", merge=str(base)),
                        log=lambda _: None)
