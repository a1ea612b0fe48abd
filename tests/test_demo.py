"""`treadle demo`, the README's main job, end to end as a newcomer runs it (the model
already built: `trained_checkpoint` is the demo's own, in the same cache)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from treadle.store.export import read_parquet
from vllm_server import ensure_vllm

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_demo_runs_both_jobs_through_the_service(trained_checkpoint: Path,
                                                     tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "treadle", "demo", "--cache", str(trained_checkpoint.parent),
         "--out", str(out), "--vllm-python", str(ensure_vllm())],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fine-tuning steps" not in done.stderr  # the cached model was used
    # One summary table per job (the agent loop's, then the harness's), each ending in
    # its "all" row, then the two side by side.
    assert done.stdout.count("\nall ") == 2, done.stdout
    assert "treadle's agent loop" in done.stdout and "a harness through the gateway" \
        in done.stdout
    # Every trajectory of both doors ran: no harness crash, no infrastructure failure.
    for parquet in out.glob("*.parquet"):
        trajectories = [t for _, t in read_parquet(parquet)]
        assert len(trajectories) == 32
        assert all(not t.infra_failure and t.turns and t.segments for t in trajectories), \
            [(t.status, t.reason) for t in trajectories if t.infra_failure]
    assert len(list(out.glob("*.parquet"))) == 2 and len(list(out.glob("*.html"))) == 2
    assert (out / "demo.db").is_file()
    assert "demo: done in" in done.stderr


def test_the_demo_refuses_a_missing_vllm_interpreter(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "treadle", "demo", "--out", str(tmp_path),
         "--vllm-python", str(tmp_path / "nope" / "python")],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no such interpreter" in done.stderr
