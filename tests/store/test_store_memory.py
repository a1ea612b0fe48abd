"""Memory stays flat however many jobs run: nothing per job stays in the process."""

from __future__ import annotations

import gc
import random
import tracemalloc
from pathlib import Path

import pytest
from store_helpers import plan, random_trajectory

from treadle.store import Store
from treadle.store.export import export_jsonl
from treadle.types import TrajectoryStatus


def _one_job(store: Store, job: str, rng: random.Random, out: Path) -> None:
    planned = plan(4, 8, job)
    store.create_job(job, {"job": job, "tasks": list(range(50))}, planned)
    for p in planned:
        store.start(job, p.trajectory_id)
        store.finish(job, random_trajectory(rng, p, TrajectoryStatus.COMPLETED))
        store.add_event(job, "turn", {"p": p.trajectory_id})
    store.finish(job, random_trajectory(rng, planned[0], TrajectoryStatus.COMPLETED))
    assert sum(1 for _ in store.iter_results(job, page_size=10)) == 32
    store.events(job, limit=50)
    store.job(job)
    export_jsonl(store, job, out)


@pytest.mark.slow
def test_traced_memory_is_flat_over_many_jobs(tmp_path: Path) -> None:
    rng = random.Random(0)
    out = tmp_path / "export.jsonl"
    with Store(tmp_path / "m.db") as store:
        for i in range(30):  # warm up: statement cache, interned strings, imports
            _one_job(store, f"warm{i}", rng, out)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(300):
                _one_job(store, f"job{i}", rng, out)
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert store.job("job299").delivered == 32
    # 300 jobs of 32 records (about 9,600 results, several MB on disk) held in Python
    # would be megabytes; the allowance is a fraction of one job's data.
    assert after - before < 64 * 1024, f"traced memory grew by {after - before} bytes"
