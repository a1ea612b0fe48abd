"""The multi-step benchmark (`treadle.bench.sim_steps`) on a tiny configuration: every
row is at or above its mode's lower bound, the summary compares treadle's best mode
with the best TP-tuned baseline's, and the markdown shows it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
