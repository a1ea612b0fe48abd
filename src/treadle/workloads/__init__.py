"""Workloads: what the trajectories of a batch will do, as data every driver shares.

`spec` (the `Workload` and `TrajectorySpec` records), `synthetic` (the seeded
`coding`, `search`, `math` and `swe` generators), `trace` (the JSONL trace format)
and `load` (either, by name). The simulator, the live runtime's replay and the
service's replay jobs all read them; this package imports nothing of theirs.
"""

from treadle.workloads.spec import Percentiles, TrajectorySpec, TurnSpec, Workload, WorkloadStats
from treadle.workloads.synthetic import WORKLOADS, generate

__all__ = [
    "WORKLOADS", "Percentiles", "TrajectorySpec", "TurnSpec", "Workload", "WorkloadStats",
    "generate",
]  # fmt: skip
