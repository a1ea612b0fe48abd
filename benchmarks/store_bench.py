"""Store throughput: finishing trajectories, reading results back, exporting.

    flock -x /tmp/treadle-cpu.lock .venv/bin/python benchmarks/store_bench.py \
        --out benchmarks/store.json

One job of `--groups` x 16 trajectories, each with one segment of `--tokens`
response tokens, in a file store in a
temporary directory, and the record's JSON encoding and decoding on their own
(`encode`: trajectory_to_record + dumps_record; `json_loads`: plain json.loads;
`loads_record`: json.loads + the strict reader). Each measurement runs `--repeats`
times (store ones on a fresh file); the report gives the median and the spread of
each rate. Seeded: the same arguments write the same records.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treadle.store import (
    PlannedTrajectory,
    Store,
    dumps_record,
    loads_record,
    trajectory_to_record,
)
from treadle.store.export import export_jsonl, export_parquet
from treadle.types import GroupKey, TokenSegment, Trajectory, TrajectoryStatus


def _trajectories(groups: int, tokens: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for r in range(16):
            mask = [1 if i % 5 else 0 for i in range(tokens)]
            seg = TokenSegment([rng.randrange(150_000) for _ in range(512)],
                               [rng.randrange(150_000) for _ in range(tokens)], mask,
                               [-rng.random() * 5 if m else 0.0 for m in mask], [1] * tokens)
            out.append(Trajectory(f"g{g}-r{r}", GroupKey(f"g{g}", r), prompt_tokens=512,
                                  segments=[seg], status=TrajectoryStatus.COMPLETED,
                                  reward=float(rng.random() < 0.5), task_id=f"task{g}"))
    return out


def _plan(ts: list[Trajectory]) -> list[PlannedTrajectory]:
    return [PlannedTrajectory(t.trajectory_id, t.key.group_id, t.task_id, t.key.repetition)
            for t in ts]


def _timed(rates: dict[str, list[float]], name: str, n: int, fn: Callable[[], Any]) -> Any:
    """Run `fn` once, add n / seconds to rates[name], return what `fn` returned."""
    start = time.perf_counter()
    value = fn()
    rates.setdefault(name, []).append(n / (time.perf_counter() - start))
    return value


def _codec(ts: list[Trajectory], rates: dict[str, list[float]]) -> None:
    n = len(ts)
    texts = _timed(rates, "encode_per_s", n,
                   lambda: [dumps_record(trajectory_to_record(t)) for t in ts])
    _timed(rates, "json_loads_per_s", n, lambda: [json.loads(x) for x in texts])
    _timed(rates, "loads_record_per_s", n, lambda: [loads_record(x) for x in texts])


def _store(ts: list[Trajectory], tmp: Path, sync: str, rates: dict[str, list[float]]) -> None:
    n = len(ts)
    with Store(tmp / f"{sync}.db", synchronous=sync) as store:  # type: ignore[arg-type]
        store.create_job("j", {}, _plan(ts))
        _timed(rates, f"finish_per_s[{sync}]", n, lambda: [store.finish("j", t) for t in ts])
        if sync != "NORMAL":
            return
        _timed(rates, "results_per_s", n, lambda: sum(1 for _ in store.iter_results("j")))
        _timed(rates, "decode_per_s", n,
               lambda: [d.trajectory() for d in store.iter_results("j")])
        _timed(rates, "export_jsonl_per_s", n,
               lambda: export_jsonl(store, "j", tmp / "x.jsonl"))
        _timed(rates, "export_parquet_per_s", n,
               lambda: export_parquet(store, "j", tmp / "x.parquet"))


def run(groups: int, tokens: int, repeats: int) -> dict[str, Any]:
    ts = _trajectories(groups, tokens, seed=0)
    rates: dict[str, list[float]] = {}
    for rep in range(repeats):
        _codec(ts, rates)
        for sync in ("NORMAL", "FULL"):
            with tempfile.TemporaryDirectory() as tmp:
                _store(ts, Path(tmp), sync, rates)
        print(f"repeat {rep + 1}/{repeats} done", flush=True)
    record_bytes = statistics.mean(len(dumps_record(trajectory_to_record(t)).encode())
                                   for t in ts[:16])
    return {
        "setup": {"trajectories": len(ts), "response_tokens": tokens, "prompt_tokens": 512,
                  "repeats": repeats, "mean_record_bytes": round(record_bytes)},
        "rates": {name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                  for name, v in rates.items()},
        "unit": "trajectories per second",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = run(args.groups, args.tokens, args.repeats)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["rates"], indent=2))


if __name__ == "__main__":
    main()
