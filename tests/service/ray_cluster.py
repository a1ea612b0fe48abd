"""The local two-node Ray cluster the Ray tests share (`test_service_ray`), and what
they ask its emulated engines."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ray.cluster_utils import Cluster

from treadle.engines.emulated_client import EmulatedEngineClient


def patient(get_node: Callable[[str, str], Any]) -> Callable[[str, str], Any]:
    """Ray's `services.get_node`, asked again for up to 5 minutes while the node is not
    registered. Ray 2.60.0 gives a starting node's raylet 30 s to register
    (ray/_private/node.py) and then fails the start; on two cores that a whole test
    suite loads it takes longer. It polls the GCS, as Ray does: no event to wait on."""
    def get(gcs_address: str, node_id: str) -> Any:
        deadline = time.monotonic() + 300
        while True:
            try:
                return get_node(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    return get


def two_nodes() -> Cluster:
    """A head node with 6 GPUs, 4 lent to engines, and a node "two" with 3, all lent,
    and room for 2 sandbox servers; each with room for one runner actor."""
    c = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 2, "num_gpus": 6, "resources": {"treadle_engine": 4, "treadle_runner": 1},
        "include_dashboard": False})
    c.add_node(num_cpus=1, num_gpus=3,  # "two"
               resources={"treadle_engine": 3, "treadle_sandbox": 2, "treadle_runner": 1})
    c.wait_for_nodes(timeout=300)
    return c


async def engine_requests(urls: list[str]) -> int:
    """Requests running or waiting on the engines at `urls` now."""
    total = 0
    for url in urls:
        engine = EmulatedEngineClient(url, "any")
        try:
            load = await engine.load()
        finally:
            await engine.aclose()
        total += load.running + load.waiting
    return total
