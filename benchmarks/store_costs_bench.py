"""Store costs against the size of what a call does not concern, this tree against a baseline.

    flock /tmp/treadle-bench.lock .venv/bin/python benchmarks/store_costs_bench.py \
        --baseline f85cbc8 --out benchmarks/store-costs.json

Three costs that should not grow with the job: a `finish` with a job whose spec is
`--spec-mib` MiB (and one with an empty spec), a `cancel` of a job of each `--cancel`
size (its spec empty, or listing its tasks: one per group of 16, with a 1 KiB
prompt), and a `job()` read of a job of `--plan` trajectories. Every measurement
runs in a fresh process on a fresh file store (WAL, synchronous=NORMAL) in a
temporary directory, alternating this tree's `src` and the baseline's (the
`--baseline` revision's `src`, taken with `git archive`), `--repeats` times; the
report gives each one's median, min and max, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TREE = HERE.parent


def _plan(n: int) -> list[Any]:
    from treadle.store import PlannedTrajectory

    return [PlannedTrajectory(f"t{i}", f"g{i // 16}", f"task{i // 16}", i % 16) for i in range(n)]


def _finish_ms(tmp: Path, spec_mib: float) -> float:
    """Median time of a finish (a minimal record) with a spec of `spec_mib` MiB."""
    from treadle.store import Store
    from treadle.types import GroupKey, Trajectory, TrajectoryStatus

    planned = _plan(64)
    times = []
    with Store(tmp / "finish.db") as store:
        store.create_job("j", {"blob": "x" * int(spec_mib * (1 << 20))}, planned)
        for p in planned:
            t = Trajectory(p.trajectory_id, GroupKey(p.group_id, p.repetition),
                           status=TrajectoryStatus.COMPLETED, task_id=p.task_id)
            start = time.perf_counter()
            store.finish("j", t)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _cancel_s(tmp: Path, n: int, spec: str) -> float:
    """Time of cancelling a job of `n` trajectories, none started."""
    from treadle.store import Store

    body: dict[str, Any] = {}
    if spec == "tasks":
        body = {"tasks": [{"id": f"task{g}", "prompt": "x" * 1024} for g in range(n // 16)]}
    with Store(tmp / "cancel.db") as store:
        store.create_job("j", body, _plan(n))
        start = time.perf_counter()
        store.cancel("j")
        return time.perf_counter() - start


def _job_ms(tmp: Path, n: int) -> float:
    """Median time of a job() read of a job of `n` trajectories."""
    from treadle.store import Store

    with Store(tmp / "job.db") as store:
        store.create_job("j", {}, _plan(n))
        times = []
        for _ in range(50):
            start = time.perf_counter()
            store.job("j")
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _worker(what: str, arg: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        if what == "finish":
            return _finish_ms(Path(tmp), float(arg))
        if what == "cancel":
            n, spec = arg.split(":")
            return _cancel_s(Path(tmp), int(n), spec)
        return _job_ms(Path(tmp), int(arg))


def _measure(src: Path, what: str, arg: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, __file__, "--worker", what, arg], env=env,
                         check=True, capture_output=True, text=True).stdout
    imported, value = out.strip().splitlines()[-2:]
    if not Path(imported).resolve().is_relative_to(src.resolve()):
        raise RuntimeError(f"the worker for {src} imported treadle from {imported}")
    return float(value)


def _baseline_src(rev: str, into: Path) -> Path:
    tar = subprocess.run(["git", "-C", str(TREE), "archive", rev, "src"], check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    return into / "src"


def run(baseline: str, spec_mib: float, cancels: list[int], plan: int,
        repeats: int) -> dict[str, Any]:
    cases = [("finish", "0", "finish_ms[spec=0]"),
             ("finish", f"{spec_mib:g}", f"finish_ms[spec={spec_mib:g}MiB]")]
    for n in cancels:
        cases += [("cancel", f"{n}:empty", f"cancel_s[{n},spec=empty]"),
                  ("cancel", f"{n}:tasks", f"cancel_s[{n},spec=tasks]")]
    cases.append(("job", str(plan), f"job_ms[{plan}]"))
    values: dict[str, dict[str, list[float]]] = {name: {"baseline": [], "this": []}
                                                 for _, _, name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"baseline": _baseline_src(baseline, Path(tmp)), "this": TREE / "src"}
        for rep in range(repeats):
            for what, arg, name in cases:
                for side, src in sources.items():  # side by side, one after the other
                    values[name][side].append(_measure(src, what, arg))
            print(f"repeat {rep + 1}/{repeats} done", flush=True)
    results = {}
    for name, sides in values.items():
        summary = {side: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                   for side, v in sides.items()}
        results[name] = {**summary, "baseline_over_this":
                         summary["baseline"]["median"] / summary["this"]["median"]}
    return {"setup": {"baseline": baseline, "spec_mib": spec_mib, "cancel": cancels,
                      "plan": plan, "repeats": repeats,
                      "sqlite": __import__("sqlite3").sqlite_version},
            "results": results,
            "unit": "the name's suffix: ms or s; finish and job are medians over a run"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="git revision to compare against")
    parser.add_argument("--spec-mib", type=float, default=10.0)
    parser.add_argument("--cancel", type=int, nargs="+", default=[10_000, 20_000])
    parser.add_argument("--plan", type=int, default=65_536)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", nargs=2, metavar=("WHAT", "ARG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import treadle

        print(treadle.__file__)
        print(_worker(*args.worker))
        return
    if not args.baseline or not args.out:
        parser.error("--baseline and --out are required")
    report = run(args.baseline, args.spec_mib, args.cancel, args.plan, args.repeats)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["results"], indent=2))


if __name__ == "__main__":
    main()
