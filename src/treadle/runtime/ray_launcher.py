"""Engines on a Ray cluster: `RayLauncher`, the `EngineLauncher` of a cluster.

    connect_ray("ray://head:10001")            # or None: $RAY_ADDRESS, else a local one
    launcher = RayLauncher(EmulatedProcess(time_scale=0.05))
    launched = await launcher.start(tp=4)        # 4 GPUs of one node, healthy
    launcher.placement(launched.url)             # EnginePlacement(node_id, node_ip, gpu_ids)
    await launched.stop()                        # the process, its actor, its GPUs freed

An engine of TP degree t is one process owned by one Ray actor (`ProcessHost`) in a
placement group of t bundles of one GPU each (plus `resources`, e.g. a custom
resource that marks the nodes engines may use), STRICT_PACK: all on one node, as
tensor parallelism wants. The host actor holds bundle 0; the GPU ids of the other
bundles are read by a task in each, and the process sees all t
(`CUDA_VISIBLE_DEVICES`). Its command line is the `ProcessSpec`'s, as
`LocalLauncher` runs it (the emulated engine, vLLM), bound to the node's address
instead of loopback; `start` returns once it passes the same health gate
(`launcher.wait_healthy`).

Contracts: as `EngineLauncher`'s. `start` raises EngineStartError if no node has
t free GPUs (and `resources`) within `placement_timeout_s`, or the engine exits or
is not healthy within `ready_timeout_s`; what it reserved is then released.
`stop` ends the process group (SIGTERM, SIGKILL after `stop_timeout_s`), kills the
actor and removes the placement group; it is idempotent and never raises, a node
gone included. The engine dies with its actor (it is the actor's child with
PR_SET_PDEATHSIG): a node lost, or the service's process gone (Ray ends the
actors a driver owns), leaves no engine behind, and the runtime's health checks
fail the engines that were there (their turns go elsewhere; `docs/runtime.md`).

Ray is an optional extra (`pip install 'treadle[ray]'`): it is imported inside
the functions that use it, never at module level, so that treadle installs and
imports without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import logging
import os
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from secrets import token_hex
from typing import Any

from treadle.engines.errors import EngineStartError
from treadle.errors import UsageError
from treadle.runtime.launcher import (
    EngineLauncher,
    LaunchedEngine,
    ProcessSpec,
    die_with_parent,
    free_port,
    once,
    stop_process_group,
    tail,
    wait_healthy,
)

log = logging.getLogger(__name__)
INSTALL_HINT = "Ray is not installed (pip install 'treadle[ray]')"
# Measured real seconds Ray adds to an engine's start (a placement group, the host
# actor's worker process, the GPU-id tasks): docs/deploy.md.
RAY_STARTUP_S = 3.0


def require_ray() -> None:
    """UsageError in one line (how to install it) when Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        raise UsageError(INSTALL_HINT)


def connect_ray(address: str | None = None, *, num_gpus: int | None = None) -> None:
    """Connect this process to the Ray cluster at `address` (None: `$RAY_ADDRESS`, or a
    local cluster started here, declaring `num_gpus` GPUs); nothing if already
    connected. UsageError without Ray; Ray's own error for a cluster it cannot reach."""
    require_ray()
    import ray

    if ray.is_initialized():
        return
    if address is None and "RAY_ADDRESS" not in os.environ:
        ray.init(num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


@dataclass(frozen=True, slots=True)
class RayCluster:
    """Where a service starts its engines on Ray (`treadle serve --ray [ADDRESS]`)."""

    address: str | None = None  # None: $RAY_ADDRESS, else a local cluster started here
    # What each engine's GPU bundle asks for besides its GPU (e.g. a custom resource
    # the engine nodes declare, as many as they have GPUs); only nodes with all of it
    # count towards the GPUs the policy plans for.
    resources: tuple[tuple[str, float], ...] = ()

    def connect(self, num_gpus: int | None = None) -> int:
        """Connect (`connect_ray`; a local cluster declares `num_gpus`); the GPUs of the
        live nodes engines may use: each node's GPUs, at most as many bundles as its
        `resources` hold."""
        connect_ray(self.address, num_gpus=num_gpus)
        import ray

        total = 0
        for node in ray.nodes():  # type: ignore[no-untyped-call]  # (Ray's, untyped)
            if not node.get("Alive"):
                continue
            have: dict[str, float] = node.get("Resources", {})
            bundles = have.get("GPU", 0.0)
            for name, amount in self.resources:
                bundles = min(bundles, have.get(name, 0.0) / amount)
            total += int(bundles)
        return total


@dataclass(frozen=True, slots=True)
class EnginePlacement:
    """Where an engine started by `RayLauncher` runs."""

    node_id: str  # Ray's node id
    node_ip: str  # the address its engine listens on
    gpu_ids: tuple[str, ...]  # its GPUs on that node, one per bundle (CUDA_VISIBLE_DEVICES)


class ProcessHost:
    """One engine process on a node, owned by the Ray actor this class becomes
    (`_host_actor`). Its methods run in the actor, on the engine's node."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    def place(self) -> tuple[str, str, list[str], int]:
        """(node id, node address, this actor's GPU ids, a free port on the node)."""
        import ray

        context = ray.get_runtime_context()
        gpus = [str(g) for g in context.get_accelerator_ids().get("GPU", [])]
        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return context.get_node_id(), ip, gpus, free_port()

    def start(self, argv: list[str], env: dict[str, str], log_name: str) -> str:
        """Start the process (a session of its own, SIGTERMed when this actor's
        process dies); the path of its log on this node."""
        log_dir = Path(tempfile.gettempdir()) / "treadle-ray-engines"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = log_dir / log_name
        with open(self._log, "wb") as out:
            self._proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env={**os.environ, **env},
                                          start_new_session=True, preexec_fn=die_with_parent)
        return str(self._log)

    def exit_code(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def log_tail(self) -> str:
        return "(no log)" if self._log is None else tail(self._log)

    def stop(self, timeout_s: float) -> None:
        if self._proc is not None:
            stop_process_group(self._proc, timeout_s)


@functools.cache
def host_actor() -> Any:
    """`ProcessHost` as a Ray actor class (`.options(...).remote()` makes one)."""
    import ray

    return ray.remote(ProcessHost)


@functools.cache
def _bundle_gpus() -> Any:
    import ray

    def gpu_ids() -> list[str]:
        return [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]

    return ray.remote(gpu_ids)


class RayLauncher(EngineLauncher):
    """Engines of `spec` on the connected Ray cluster (`connect_ray` first); see the
    module docstring. `resources`: what each GPU bundle asks for besides its GPU."""

    def __init__(self, spec: ProcessSpec, *, resources: Mapping[str, float] | None = None,
                 placement_timeout_s: float = 60.0, ready_timeout_s: float = 180.0,
                 stop_timeout_s: float = 10.0) -> None:
        require_ray()
        self.spec = spec
        self.resources = dict(resources or {})
        self.placement_timeout_s = placement_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._started = 0
        self._placements: dict[str, EnginePlacement] = {}

    def startup_s(self, tp: int) -> float:
        return self.spec.startup_estimate_s + RAY_STARTUP_S

    def placement(self, url: str) -> EnginePlacement:
        """Where the running engine at `url` is; KeyError once it is stopped."""
        return self._placements[url]

    async def start(self, tp: int) -> LaunchedEngine:
        from ray.exceptions import RayError
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        index = self._started
        self._started += 1
        bundle = {**self.resources, "GPU": 1.0}
        tag = f"{self.spec.name}-tp{tp}-{token_hex(4)}"  # its group's and its log's name
        group: Any = None
        host: Any = None
        client = None
        url = ""

        @once
        async def stop() -> None:
            self._placements.pop(url, None)
            if client is not None:
                await client.aclose()
            await self._release(group, host, remove_placement_group)

        def in_bundle(i: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)

        try:
            # Named for `ray list placement-groups`; a name is unique among live groups.
            group = placement_group([bundle] * tp, strategy="STRICT_PACK",
                                    name=f"treadle-{tag}")
            await self._placed(group, tp)
            host = host_actor().options(num_cpus=0, num_gpus=1, resources=self.resources,
                                         scheduling_strategy=in_bundle(0)).remote()
            others = [_bundle_gpus().options(num_cpus=0, num_gpus=1, resources=self.resources,
                                             scheduling_strategy=in_bundle(i)).remote()
                      for i in range(1, tp)]
            node_id, node_ip, gpus, port = await host.place.remote()
            for ids in await asyncio.gather(*others):
                gpus += ids
            argv = self.spec.command(tp, port, index, host=node_ip)
            env = {**self.spec.env(), "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
            log_path = await host.start.remote(argv, env, f"{tag}.log")
            url = f"http://{node_ip}:{port}"
            client = self.spec.client(url)
            await wait_healthy(self.spec.name, client, host.exit_code.remote,
                               host.log_tail.remote, f"log {log_path} on node {node_ip}",
                               self.ready_timeout_s)
            max_batch, kv = await self.spec.capacity(tp, client)
        except BaseException as e:
            await stop()
            if isinstance(e, RayError):  # its actor or node gone while it started
                raise EngineStartError(f"{self.spec.name} on Ray: {type(e).__name__}: "
                                       f"{e}") from e
            raise
        self._placements[url] = EnginePlacement(node_id, node_ip, tuple(gpus))
        return LaunchedEngine(client, tp, max_batch, kv, url,
                              f"{self.spec.name} tp{tp} {node_ip}:{port}", stop)

    async def _placed(self, group: Any, tp: int) -> None:
        """Wait for the placement group's bundles to be reserved."""
        import ray

        try:
            await asyncio.wait_for(group.ready(), self.placement_timeout_s)
        except TimeoutError:
            free = ray.available_resources().get("GPU", 0)  # type: ignore[no-untyped-call]
            wanted = "".join(f" {k}={v:g}" for k, v in self.resources.items())
            raise EngineStartError(
                f"no node of the Ray cluster had {tp} free GPUs{' with' + wanted if wanted else ''}"
                f" within {self.placement_timeout_s:.0f}s ({free:g} free in all)") from None

    async def _release(self, group: Any, host: Any, remove: Any) -> None:
        """End the engine's process, its actor and its placement group; never raises
        (the actor is gone with its node, or was never placed)."""
        import ray

        if host is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(host.stop.remote(self.stop_timeout_s),
                                       self.stop_timeout_s + 5.0)
            with contextlib.suppress(Exception):
                ray.kill(host)
        if group is not None:
            with contextlib.suppress(Exception):
                remove(group)
