"""What Ray adds to an engine's start: emulated engines started by `LocalLauncher`
and by `RayLauncher` on a one-node local Ray cluster declaring 4 GPUs, each start
timed from `start` to a healthy engine, then stopped (the median of `--repeats`).

    .venv/bin/python benchmarks/ray_startup_bench.py --out benchmarks/ray-startup.json

Needs the `ray` extra. The cluster's own start is timed apart (a service pays it
once, at its start, when it starts a local cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from treadle.runtime.launcher import EmulatedProcess, EngineLauncher, LocalLauncher
from treadle.runtime.ray_launcher import RayLauncher, connect_ray


async def _starts(launcher: EngineLauncher, tp: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        began = time.perf_counter()
        launched = await launcher.start(tp)
        out.append(time.perf_counter() - began)
        await launched.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = EmulatedProcess(time_scale=0.05)
    report: dict[str, object] = {"repeats": args.repeats, "engine": "emulated qwen3-14b h100"}
    local = asyncio.run(_starts(LocalLauncher(spec), 1, args.repeats))
    report["local_tp1_s"] = round(statistics.median(local), 2)
    began = time.perf_counter()
    connect_ray(None, num_gpus=4)
    report["ray_cluster_start_s"] = round(time.perf_counter() - began, 2)
    for tp in (1, 2, 4):
        ray_starts = asyncio.run(_starts(RayLauncher(spec), tp, args.repeats))
        report[f"ray_tp{tp}_first_s"] = round(ray_starts[0], 2)
        report[f"ray_tp{tp}_s"] = round(statistics.median(ray_starts), 2)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
