"""Group commit: the async store's calls from many tasks, batched or one commit each.

    flock -x /tmp/treadle-cpu.lock .venv/bin/python benchmarks/store_group_bench.py \
        --out benchmarks/store-group.json

A service's store traffic in miniature: `--tasks` concurrent tasks run `--trajectories`
trajectories through one `AsyncStore` on a file store (WAL, synchronous=NORMAL), each
trajectory a `start`, `--turns` journal rows of `--body` bytes (one call each), and a
`finish` of a record of 256 response tokens. Arms: `group_commit` on (the calls queued
while the worker ran commit together) and off (a commit a call), alternating, each
repeat on a fresh file. Reported: the process's CPU seconds (user + system, every
thread) and the wall time, per trajectory; medians with min and max. Seeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from treadle.store import AsyncStore, PlannedTrajectory, Store
from treadle.store.journal import JournalRow
from treadle.types import GroupKey, TokenSegment, Trajectory, TrajectoryStatus


def _trajectories(n: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        g, r = divmod(k, 8)
        seg = TokenSegment([rng.randrange(150_000) for _ in range(64)],
                           [rng.randrange(150_000) for _ in range(256)], [1] * 256,
                           [-rng.random() for _ in range(256)], [1] * 256)
        out.append(Trajectory(f"g{g}-r{r}", GroupKey(f"g{g}", r), prompt_tokens=64,
                              segments=[seg], status=TrajectoryStatus.COMPLETED,
                              reward=1.0, task_id=f"task{g}"))
    return out


async def _arm(ts: list[Trajectory], path: Path, *, group_commit: bool, tasks: int,
               turns: int, body: bytes) -> tuple[float, float]:
    astore = AsyncStore(Store(path), group_commit=group_commit)
    await astore.create_job("j", {}, [PlannedTrajectory(t.trajectory_id, t.key.group_id,
                                                        t.task_id, t.key.repetition)
                                      for t in ts])
    slots = asyncio.Semaphore(tasks)

    async def one(t: Trajectory) -> None:
        async with slots:
            attempt = await astore.start("j", t.trajectory_id)
            assert attempt is not None
            for n in range(turns):
                await astore.write_journal([JournalRow("j", t.trajectory_id, attempt, n,
                                                       64, body)])
            await astore.finish("j", t)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(t) for t in ts))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert (await astore.job("j")).delivered == len(ts)
    await astore.aclose()
    return cpu, wall


def run(trajectories: int, tasks: int, turns: int, body_bytes: int,
        repeats: int) -> dict[str, Any]:
    ts = _trajectories(trajectories, seed=0)
    body = bytes(random.Random(1).randrange(256) for _ in range(body_bytes))
    got: dict[str, dict[str, list[float]]] = {}
    for rep in range(repeats):
        for group_commit in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                cpu, wall = asyncio.run(_arm(ts, Path(tmp) / "s.db", group_commit=group_commit,
                                             tasks=tasks, turns=turns, body=body))
            arm = got.setdefault("group_commit" if group_commit else "commit_per_call",
                                 {"cpu_ms_per_trajectory": [], "wall_ms_per_trajectory": []})
            arm["cpu_ms_per_trajectory"].append(1000 * cpu / trajectories)
            arm["wall_ms_per_trajectory"].append(1000 * wall / trajectories)
        print(f"repeat {rep + 1}/{repeats} done", flush=True)
    arms = {name: {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                   for k, v in values.items()} for name, values in got.items()}
    ratio = {k: arms["group_commit"][k]["median"] / arms["commit_per_call"][k]["median"]
             for k in ("cpu_ms_per_trajectory", "wall_ms_per_trajectory")}
    return {"setup": {"trajectories": trajectories, "tasks": tasks, "turns": turns,
                      "body_bytes": body_bytes, "repeats": repeats},
            "arms": arms, "group_over_per_call": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=4000)
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--body", type=int, default=600, help="journal row bytes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = run(args.trajectories, args.tasks, args.turns, args.body, args.repeats)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"arms": report["arms"], "ratio": report["group_over_per_call"]},
                     indent=2))


if __name__ == "__main__":
    main()
