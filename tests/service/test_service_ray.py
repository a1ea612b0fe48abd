"""Engines on a Ray cluster: `RayLauncher` and `treadle serve --ray`, on a local
multi-node cluster (`ray.cluster_utils.Cluster`) whose nodes declare GPUs and a
custom resource, with emulated engines (they only pretend to use the GPUs).

One cluster of two nodes serves the module (a Ray node takes seconds to start): a
head node with 6 GPUs of which it lends 4 to engines (`treadle_engine`), and a node
"two" with 3 GPUs, all lent, which also lends room for 2 sandbox servers
(`treadle_sandbox`: `RaySandboxFleet`). Each node has room for one runner actor
(`treadle_runner`: `RayRunners`). Node "two" is removed by the last test."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import ray._private.services
from ray.cluster_utils import Cluster
from ray_cluster import engine_requests, patient, two_nodes
from service_helpers import running

from sandbox.sandbox_helpers import require_bwrap
from sandbox.sandbox_images import debian_rootfs
from treadle.bench.faults import ServiceProcess
from treadle.clock import ScaledClock
from treadle.core.cost_model import CostModel
from treadle.core.events import EngineAdded, Event
from treadle.core.policies import build_policy, parse_policy
from treadle.core.policies.treadle_policy import Treadle
from treadle.engines.errors import EngineStartError
from treadle.errors import SandboxImageError, SandboxStartError
from treadle.runtime.driver import Runtime
from treadle.runtime.launcher import EmulatedProcess
from treadle.runtime.ray_launcher import RayCluster, RayLauncher
from treadle.runtime.ray_runners import RunnerActors
from treadle.runtime.ray_sandboxes import RaySandboxFleet, SandboxServers
from treadle.runtime.replay import ReplayResult, replay
from treadle.sandbox.autoscale import ScaleDecision, Scaling
from treadle.sandbox.base import Limits, Sandbox
from treadle.sandbox.remote import RemoteBackend
from treadle.service.state import Service, ServiceConfig
from treadle.sim.runner import outcomes
from treadle.testing import FakeClock
from treadle.workloads import TrajectorySpec, TurnSpec, Workload

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LENDS = (("treadle_engine", 1.0),)  # what each engine bundle asks for besides a GPU
SCALE = 0.02
TOKEN = "test-token"


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, dict[str, str]]]:
    """The cluster, connected, and its nodes' Ray ids by name."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray._private.services, "get_node",
                      patient(ray._private.services.get_node))
        c = two_nodes()
    try:
        yield c, {"head": c.head_node.node_id,
                  "two": next(n.node_id for n in c.worker_nodes)}
    finally:
        ray.shutdown()
        c.shutdown()


async def _start_stop(tps: list[int], *, then: int = 0) -> tuple[list[Any], list[int], str]:
    """Start engines of `tps` one after the other, then one of TP `then` (if given:
    there must be no room for it), then stop them all: (placements, TP degrees, the
    refusal of the last one)."""
    launcher = RayLauncher(EmulatedProcess(time_scale=SCALE), resources=dict(LENDS),
                           placement_timeout_s=5.0)
    launched = []
    try:
        for tp in tps:
            launched.append(await launcher.start(tp))
        placements = [launcher.placement(x.url) for x in launched]
        health = [await x.engine.health() for x in launched]
        assert all(health)
        refusal = ""
        if then:
            with pytest.raises(EngineStartError) as refused:
                await launcher.start(then)
            refusal = str(refused.value)
    finally:
        for x in launched:
            await x.stop()
    with pytest.raises(KeyError):  # stopped: no placement any more
        launcher.placement(launched[0].url)
    return placements, [x.tp for x in launched], refusal


def test_engines_of_tp_4_2_1_are_packed_each_on_one_node_with_room(
        cluster: tuple[Cluster, dict[str, str]]) -> None:
    _, nodes = cluster
    placements, tps, refusal = asyncio.run(_start_stop([4, 2, 1], then=2))
    # Each one fits only where it went: 4 GPUs only on the head, then 2 only on "two"
    # (the head has 2 GPUs free but lends none of them), then 1 only on "two"; then no
    # node lends 2 more.
    assert [p.node_id for p in placements] == [nodes["head"], nodes["two"], nodes["two"]]
    assert [len(set(p.gpu_ids)) for p in placements] == tps == [4, 2, 1]
    assert not set(placements[1].gpu_ids) & set(placements[2].gpu_ids)  # one node, apart
    assert "no node of the Ray cluster had 2 free GPUs with treadle_engine=1" in refusal
    # Stopped, the groups are released: the head's four GPUs take a TP-4 engine again.
    again, _, _ = asyncio.run(_start_stop([4]))
    assert again[0].node_id == nodes["head"]


def test_serve_ray_runs_a_job_on_the_engines_it_lays_out_on_the_cluster(
        cluster: tuple[Cluster, dict[str, str]], tmp_path: Path) -> None:
    c, nodes = cluster
    service = ServiceProcess(tmp_path / "s.db", tmp_path / "s.log", TOKEN, [
        "--ray", c.address, "--ray-resource", "treadle_engine=1", "--emulate", "2",
        "--time-scale", str(SCALE), "--policy", "verl@tp1", "--sandbox", "local",
        "--sandbox-servers", "1:2", "--sandbox-server-resource", "treadle_sandbox=1",
        "--runners", "2", "--runner-cpus", "0", "--runner-resource", "treadle_runner=1"])
    service.start()
    try:
        # Its one sandbox server (the minimum: nothing waits for a sandbox) is up on
        # the node that lends room for one, before the service answers.
        assert _sandbox_servers() == [nodes["two"]]
        assert sorted(_actors("treadle-runner-")) == sorted(nodes.values())  # one a node
        with httpx.Client(base_url=service.url, timeout=30,
                          headers={"authorization": f"Bearer {TOKEN}"}) as client:
            engines = client.get("/v1/engines").json()
            r = client.post("/v1/jobs", json={"tasks": {"workload": "math",
                                                        "trajectories": 8,
                                                        "group_size": 4}, "job_id": "s"})
            assert r.status_code == 201, r.text
            records = [x["trajectory"] for x in _stream(client, "s")]
    finally:
        service.stop()
    assert _sandbox_servers() == [] and _actors("treadle-runner-") == []  # stopped with it
    # Of the seven GPUs lent, the two --emulate allows: two TP-1 engines on the
    # cluster's nodes (listening on a node's address, not on loopback).
    ip = ray.util.get_node_ip_address()
    assert sorted(e["tp"] for e in engines) == [1, 1], engines
    assert all(e["url"].startswith(f"http://{ip}:") for e in engines), engines
    assert [t["status"] for t in records] == ["completed"] * 8


def _sandbox_servers() -> list[str]:
    return _actors("treadle-sandbox-server-")


def _actors(prefix: str) -> list[str]:
    """The nodes of the actors alive on the cluster named `prefix`..., read from Ray's
    control store (its state API needs the dashboard, which this cluster runs without)."""
    import ray._private.state

    return [a["Address"]["NodeID"] for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE" and a["Name"].startswith(prefix)]


@pytest.mark.parametrize(("argv", "line"), [
    (["--ray"], "--ray starts the engines of --emulate GPUS or --vllm MODEL_DIR, or runs "
                "beside engines given by --engine URL: give one"),
    (["--ray", "--emulate", "2"], "Ray is not installed (pip install 'treadle[ray]')"),
    (["--emulate", "2", "--ray-resource", "x=1"], "--ray-resource needs --ray"),
    (["--ray", "--emulate", "2", "--ray-resource", "x"],
     "--ray-resource 'x': NAME=AMOUNT, AMOUNT > 0"),
    (["--emulate", "2", "--sandbox-servers", "1:2"],
     "--sandbox-servers starts sandbox servers on a Ray cluster: give --ray too"),
    (["--emulate", "2", "--sandbox-server-resource", "x=1"],
     "--sandbox-server-resource and --sandbox-server-images need --sandbox-servers"),
    (["--ray", "--emulate", "2", "--sandbox", "local", "--sandbox-servers", "1:2",
      "--sandbox-server-images", "/srv/images"],
     "--sandbox-server-images: images run on bwrap servers (--sandbox bwrap)"),
    (["--ray", "--emulate", "2", "--sandbox", "local", "--sandbox-servers", "3:1"],
     "--sandbox-servers '3:1': MIN:MAX, 0 <= MIN <= MAX, MAX >= 1"),
    (["--ray", "--emulate", "2", "--sandbox-servers", "1:2"],
     "--sandbox-servers: the servers' --sandbox is bwrap or local"),
    (["--emulate", "2", "--runners", "2"],
     "--runners starts runner actors on a Ray cluster: give --ray too"),
    (["--emulate", "2", "--runner-resource", "x=1"], "--runner-resource needs --runners"),
])
def test_serve_ray_without_ray_or_with_bad_options_says_so_in_one_line(
        argv: list[str], line: str) -> None:
    # Ray hidden from the interpreter, as in an install without the extra.
    code = ("import sys; sys.modules['ray'] = None; from treadle.cli import main; "
            f"sys.exit(main(['serve', '--sandbox', 'none', *{argv!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.splitlines() == [f"treadle serve: {line}"], out.stderr


def _stream(client: httpx.Client, job: str) -> Iterator[dict[str, Any]]:
    with client.stream("GET", f"/v1/jobs/{job}/trajectories", params={"follow": "true"},
                       timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                yield json.loads(line)


def test_sandbox_servers_follow_demand_on_the_nodes_that_lend_room_for_them(
        cluster: tuple[Cluster, dict[str, str]]) -> None:
    _, nodes = cluster
    token = "sandbox-fleet-token-0123456789"

    async def scenario() -> None:
        clock = FakeClock()
        waiting = 0
        told: list[tuple[str, ...]] = []
        # Run when the fleet asks for demand: after a round has read the servers' load.
        meanwhile: Callable[[], Awaitable[None]] | None = None

        async def demand() -> int:
            if meanwhile is not None:
                await meanwhile()
            return waiting

        backend = RemoteBackend([], token)
        fleet = RaySandboxFleet(
            backend, token, SandboxServers(backend="local", max_live=2, num_cpus=0,
                                           resources=(("treadle_sandbox", 1.0),)),
            Scaling(min_servers=1, max_servers=2, idle_s=30), demand=demand,
            servers_changed=told.append, clock=clock)
        try:
            assert (await fleet.rebalance()).start == 1  # the minimum, at once
            first = fleet.servers()
            assert [s.node_id for s in first] == [nodes["two"]]  # only "two" lends room
            assert list(backend.outstanding()) == [first[0].url]
            sandbox = await backend.start(Limits(memory_mb=256))
            result = await sandbox.exec(["python3", "-c", "print(6 * 7)"], timeout_s=60)
            assert result.stdout.strip() == "42"
            # One open of 2, and 3 starts waiting: over 80% of capacity, so one more
            # server (the cap is 2, however much waits).
            waiting = 3
            assert (await fleet.rebalance()).start == 1
            assert len(fleet.servers()) == 2 and len(backend.outstanding()) == 2
            assert {s.node_id for s in fleet.servers()} == {nodes["two"]}
            assert told == [(first[0].url,), backend.accepting()]  # each change, once
            [second] = [s.url for s in fleet.servers() if s.url != first[0].url]
            assert await fleet.rebalance() == ScaleDecision()  # at the cap
            # Another client of the same servers (as a runner actor's copy of the
            # backend is) opens a sandbox on the second server; the fleet's own
            # backend has nothing open there, and the second server is idle the
            # longest by its count.
            other = RemoteBackend([second], token)
            theirs = await other.start(Limits(memory_mb=256))
            waiting = 0
            clock.advance(5)
            await sandbox.close()
            assert await fleet.rebalance() == ScaleDecision()  # idle, not for long yet
            clock.advance(31)
            # A copy of the backend not told yet (a runner actor's) starts a sandbox on
            # the first server after the round has read it empty.
            late_client = RemoteBackend([first[0].url], token)
            late: list[Sandbox] = []

            async def start_late() -> None:
                late.append(await late_client.start(Limits(memory_mb=256)))

            meanwhile = start_late
            decision = await fleet.rebalance()
            meanwhile = None
            # One at a time, down to the minimum: the one with nothing live on it.
            assert decision.retire == (first[0].url,), decision
            assert told[-1] == (second,) == backend.accepting()
            # Its drain counts the late sandbox: the server is kept, and runs it.
            assert {s.url for s in fleet.servers()} == {first[0].url, second}
            result = await late[0].exec(["python3", "-c", "print(6 * 7)"], timeout_s=60)
            assert result.stdout.strip() == "42"
            # Drained, it refuses every other start, whoever asks.
            with pytest.raises(SandboxStartError, match="draining"):
                await late_client.start(Limits(memory_mb=256))
            result = await theirs.exec(["python3", "-c", "print(6 * 7)"], timeout_s=60)
            assert result.stdout.strip() == "42"  # its server still runs it
            await theirs.close()
            assert await fleet.rebalance() == ScaleDecision()  # the minimum stays
            assert {s.url for s in fleet.servers()} == {first[0].url, second}
            await late[0].close()
            assert await fleet.rebalance() == ScaleDecision()
            # and the retired server, empty by then, is stopped.
            assert [s.url for s in fleet.servers()] == [second] == list(backend.outstanding())
            again = await backend.start(Limits(memory_mb=256))  # on the one left
            await again.close()
        finally:
            await fleet.close()
        assert fleet.servers() == [] and backend.outstanding() == {} and told[-1] == ()

    asyncio.run(scenario())


def test_sandbox_servers_on_the_cluster_run_the_images_under_their_root(
        cluster: tuple[Cluster, dict[str, str]]) -> None:
    """A fleet's bwrap servers started with `--images` (`SandboxServers.images`): a
    sandbox on an image under the root runs on it; one elsewhere is refused."""
    require_bwrap()
    rootfs, _ = debian_rootfs()
    token = "sandbox-fleet-token-images-0123"

    async def scenario() -> tuple[str, str]:
        backend = RemoteBackend([], token)
        fleet = RaySandboxFleet(
            backend, token, SandboxServers(backend="bwrap", max_live=2, num_cpus=0,
                                           resources=(("treadle_sandbox", 1.0),),
                                           images=str(rootfs.parent)),
            Scaling(min_servers=1, max_servers=1), clock=FakeClock())
        try:
            assert (await fleet.rebalance()).start == 1
            async with await backend.with_image(str(rootfs)).start(Limits()) as sb:
                seen = (await sb.exec(["cat", "/etc/os-release"], timeout_s=60)).stdout
            with pytest.raises(SandboxImageError, match="not under"):
                await backend.with_image("/etc").start(Limits())
            async with await backend.start(Limits()) as sb:  # no image: the host's
                host = (await sb.exec(["cat", "/etc/os-release"], timeout_s=60)).stdout
        finally:
            await fleet.close()
        return seen, host

    seen, host = asyncio.run(scenario())
    assert seen == (rootfs / "etc" / "os-release").read_text() != host


RUNNERS = RunnerActors(count=2, num_cpus=0, resources=(("treadle_runner", 1.0),))


RunnerService = tuple[str, Service]


@pytest.fixture(scope="class")
def runner_service(cluster: tuple[Cluster, dict[str, str]],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunnerService]:
    """A service whose replays run in two runner actors, one on each node (each lends
    room for one); shared by `TestRunnerActors` (an engine pool takes seconds to start),
    stopped after them (its engines hold GPUs the later tests lay out)."""
    c, _ = cluster
    config = ServiceConfig(db=str(tmp_path_factory.mktemp("runners") / "r.db"), token=TOKEN,
                           emulate=2, time_scale=SCALE, policy="verl@tp1",
                           ray=RayCluster(c.address, resources=LENDS), runners=RUNNERS)
    with running(config, startup_timeout_s=240) as (url, service):
        yield url, service


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30, headers={"authorization": f"Bearer {TOKEN}"})


class TestRunnerActors:
    """Workload replays in runner actors (`RayRunners`), one service for both tests."""

    def test_replays_run_in_runner_actors_one_per_node_none_lost_or_twice(
            self, cluster: tuple[Cluster, dict[str, str]], runner_service: RunnerService) -> None:
        _, nodes = cluster
        url, service = runner_service
        runners = service.runners
        assert runners is not None
        n = 24
        with _client(url) as client:
            where, before = runners.where(), runners.ran()
            urls = [e["url"] for e in client.get("/v1/engines").json()]
            r = client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": n,
                                                        "group_size": 4}, "job_id": "r"})
            assert r.status_code == 201, r.text
            stream = _stream(client, "r")
            lines = [next(stream)]
            # A pause mid-job holds the actors' calls: once it returns, no engine runs one
            # (each actor had held its calls, and the pool knew of all it had started);
            # tokens sampled after the resume carry the new version.
            assert client.post("/v1/weights/pause", json={"mode": "abort"}).status_code == 200
            assert asyncio.run(engine_requests(urls)) == 0
            assert client.post("/v1/weights/resume", json={"policy_version": 1}).status_code == 200
            lines += list(stream)
            ran = {name: k - before.get(name, 0) for name, k in runners.ran().items()}
            decisions = service.runtime.control.decisions
        assert [x["seq"] for x in lines] == list(range(1, n + 1))  # none lost, none twice
        records = [x["trajectory"] for x in lines]
        assert len({t["trajectory_id"] for t in records}) == n
        assert [t["status"] for t in records] == ["completed"] * n
        assert all(t["turns"] for t in records)
        versions = {turn["policy_version"] for t in records for turn in t["turns"]}
        assert versions == {0, 1}
        # Two actors, one on each node, processes of their own; every trajectory
        # finished in one of them, both had some, and the service's scheduler decided.
        assert sorted(node for _, node in where.values()) == sorted(nodes.values())
        pids = {pid for pid, _ in where.values()}
        assert len(pids) == 2 and os.getpid() not in pids
        assert sum(ran.values()) == n and all(ran.values()), ran
        assert decisions > 0


    def test_a_runner_actor_killed_mid_job_has_its_trajectories_run_again(
            self, runner_service: RunnerService) -> None:
        url, service = runner_service
        runners = service.runners
        assert runners is not None
        n = 32
        with _client(url) as client:
            r = client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": n,
                                                        "group_size": 4}, "job_id": "k"})
            assert r.status_code == 201, r.text
            stream = _stream(client, "k")
            lines = [next(stream)]  # mid-job: every trajectory started, one delivered
            victim = max(runners.runners, key=lambda x: len(x.trajectories))
            ray.kill(victim.actor)
            lines += list(stream)
            view = client.get("/v1/jobs/k").json()
            lost, ran = list(runners.lost_runners), runners.ran()
        assert [x["seq"] for x in lines] == list(range(1, n + 1))  # none lost, none twice
        records = [x["trajectory"] for x in lines]
        assert len({t["trajectory_id"] for t in records}) == n
        assert view["status"] == "completed" and view["delivered"] == n
        assert lost == [victim.name]
        # The killed actor's trajectories ran again, each as a new attempt, on the other
        # actor or its replacement, and completed; the others completed at their first.
        again = [t for t in records if t["attempt"] > 0]
        assert again and all(t["attempt"] == 1 for t in again)
        assert [t["status"] for t in records] == ["completed"] * n
        assert victim.name not in ran and len(ran) == 2  # a replacement took its place


class _HeldTools(ScaledClock):
    """The long trajectory's clock: its `hold_at`-th tool call lasts until `free` is
    set (then its own latency), so the merged engine is up while it is in a tool gap."""

    def __init__(self, scale: float, hold_at: int, free: asyncio.Event) -> None:
        super().__init__(scale)
        self.calls, self.hold_at, self.free = 0, hold_at, free

    async def sleep(self, seconds: float) -> None:
        self.calls += 1
        if self.calls == self.hold_at:
            await self.free.wait()
        await super().sleep(seconds)


async def _merge_live() -> tuple[Treadle, list[ReplayResult], list[tuple[str, int, Any]]]:
    """Three short trajectories and a long one on four TP-1 engines on the cluster;
    treadle's policy with the true lengths (the oracle). (policy, results, each
    merged engine's id, degree and placement as it was added)"""
    short = [TrajectorySpec(f"s{i}", f"g{i}", 200, (TurnSpec(100, 0.0, 0),)) for i in range(3)]
    turns = (*(TurnSpec(1000, 2.0, 50) for _ in range(19)), TurnSpec(1000, 0.0, 0))
    specs = [*short, TrajectorySpec("long", "g9", 200, turns)]
    truth = dict(zip((t.traj_id for t in specs), outcomes(Workload("tail", tuple(specs))),
                     strict=True))
    policy = build_policy(parse_policy("oracle"), CostModel.named("qwen3-14b", "h100"),
                          batch_size=4, truth=truth, layout=(1, 1, 1, 1), max_batch=64)
    assert isinstance(policy, Treadle)
    added = asyncio.Event()
    placed: list[tuple[str, int, Any]] = []
    seen = policy.on_event
    launcher = RayLauncher(EmulatedProcess(time_scale=SCALE), resources=dict(LENDS))
    runtime = Runtime(policy, launcher=launcher, gpus=4, clock=ScaledClock(SCALE))

    def on_event(event: Event, now: float) -> None:
        seen(event, now)
        if isinstance(event, EngineAdded) and event.engine_id in policy.merged_engines:
            launched = runtime.pool.slot(event.engine_id).launched
            assert launched is not None
            placed.append((event.engine_id, event.tp, launcher.placement(launched.url)))
            added.set()

    policy.on_event = on_event  # type: ignore[method-assign]
    await runtime.start()
    try:
        held = _HeldTools(SCALE, 3, added)
        results = await asyncio.gather(*(
            replay(t, runtime.turns(t.traj_id, t.group_id),
                   held if t.traj_id == "long" else runtime.clock) for t in specs))
        return policy, results, placed
    finally:
        await runtime.close()


def test_idle_engines_are_merged_live_and_the_long_tail_moves_to_the_new_engine(
        cluster: tuple[Cluster, dict[str, str]]) -> None:
    policy, results, placed = asyncio.run(_merge_live())
    # The three short ones done, their engines idle: two were stopped and one TP-2
    # engine started in their place (a placement group of two GPUs on one node).
    [merge] = policy.merges
    assert (merge.tp, len(merge.drain), merge.moved) == (2, 2, ("long",))
    [(merged, tp, placement)] = placed
    assert tp == 2 and len(set(placement.gpu_ids)) == 2
    # The long trajectory's turns after its held tool call ran there; every turn ran;
    # then, with no trajectory left, the merged engine was split back.
    [long] = [r for r in results if r.traj_id == "long"]
    assert [t.engine_id == merged for t in long.turn_records] == [False] * 3 + [True] * 17
    assert [len(r.turn_records) for r in results] == [1, 1, 1, 20]
    assert policy.splits == 1
    # Closed mid-split (the TP-1 engines it launches were still starting): nothing of
    # it holds GPUs on the cluster.
    held = [g["name"] for g in ray.util.placement_group_table().values()
            if g["name"].startswith("treadle-") and g["state"] != "REMOVED"]
    assert held == []


def test_a_node_lost_mid_job_moves_its_turns_and_loses_nothing(
        cluster: tuple[Cluster, dict[str, str]], tmp_path: Path) -> None:
    c, nodes = cluster
    # Its replays run in two runner actors, one on each node: the node takes an engine
    # and a runner with it.
    config = ServiceConfig(db=str(tmp_path / "r.db"), token=TOKEN, emulate=7,
                           time_scale=SCALE, policy="verl@tp2",
                           ray=RayCluster(c.address, resources=LENDS), runners=RUNNERS)
    with running(config, startup_timeout_s=240) as (url, service), \
            httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKEN}"},
                         timeout=30) as client:
        runtime, launcher = service.runtime, service.runtime.launcher
        assert isinstance(launcher, RayLauncher)
        # Seven GPUs lent: three TP-2 engines, two on the head (it lends 4) and one on
        # "two" (it lends 3).
        where = {s.engine_id: launcher.placement(s.launched.url).node_id
                 for s in runtime.engines() if s.launched is not None}
        assert sorted(where.values()) == sorted([nodes["head"]] * 2 + [nodes["two"]])
        [lost] = [e for e, node in where.items() if node == nodes["two"]]
        label_of = {s.engine_id: s.label for s in runtime.engines()}
        assert service.runners is not None
        [doomed] = [name for name, (_, node) in service.runners.where().items()
                    if node == nodes["two"]]
        n = 512  # 64 groups of 8
        r = client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": n,
                                                    "group_size": 8}, "job_id": "j"})
        assert r.status_code == 201, r.text
        stream = _stream(client, "j")
        lines = [next(stream) for _ in range(n // 8)]  # mid-job: an eighth delivered
        [slot] = [s for s in runtime.engines() if s.engine_id == lost]
        while not slot.calls:  # and turns running on the engine the node takes down
            time.sleep(0.01)
        c.remove_node(next(x for x in c.list_all_nodes() if x.node_id == nodes["two"]))
        lines += list(stream)
        view = client.get("/v1/jobs/j").json()
        lost_runners = list(service.runners.lost_runners)
    assert [x["seq"] for x in lines] == list(range(1, n + 1))  # none lost, none twice
    records = [x["trajectory"] for x in lines]
    assert len({t["trajectory_id"] for t in records}) == n
    assert all(t["status"] == "completed" for t in records), {t["status"] for t in records}
    assert view["status"] == "completed" and view["delivered"] == n
    # The lost node's engine, busy when the node went, was failed by the runtime: the
    # turns it ran were run again on the others, and every trajectory completed.
    assert [label for label, _ in runtime.failures] == [label_of[lost]]
    # Its runner's trajectories ran again, as new attempts, in the head's.
    assert lost_runners == [doomed]
    assert any(t["attempt"] == 1 for t in records)
