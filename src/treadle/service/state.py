"""The service's parts, built from a configuration, started and closed together.

    service = build_service(ServiceConfig(db="treadle.db", token="s3cret",
                                          engines=[EngineRequest(url=..., model=...)]))
    app = create_app(service)          # treadle.service.app; its lifespan starts it

`Service` owns one store (SQLite, its calls on one worker thread), one runtime
(the scheduler of `policy` over the engine pool) and the job runner. Engines come
from `engines` (already running, registered at start), `emulate` (emulated engine
processes the runtime starts, laid out by the policy on that many GPUs), or later
through `POST /v1/engines`. Suite tasks need `tokenizer` (the served model's
`tokenizer.json` directory) and, for suites that run code, a sandbox backend.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from treadle.agent.tokenizer import HFTokenizer
from treadle.core.cost_model import CostModel
from treadle.core.policies import build_policy, parse_policy
from treadle.core.policies.progressive import Staleness
from treadle.engines.base import Engine
from treadle.errors import TreadleError
from treadle.gateway.harness import Harness
from treadle.runtime.clock import ScaledClock, WallClock
from treadle.runtime.driver import Runtime
from treadle.runtime.launcher import (
    EmulatedProcess,
    EngineLauncher,
    LocalLauncher,
    ProcessSpec,
    VLLMProcess,
)
from treadle.runtime.ray_launcher import RayCluster, RayLauncher
from treadle.runtime.ray_runners import RayRunners, RunnerActors, RunnerKit
from treadle.runtime.ray_sandboxes import RaySandboxFleet, SandboxServers
from treadle.runtime.suite_pools import SuitePools
from treadle.sandbox.autoscale import Scaling
from treadle.sandbox.base import SandboxBackend
from treadle.sandbox.pool import PoolSettings
from treadle.sandbox.remote import RemoteBackend
from treadle.service.attempts import Attempts
from treadle.service.continuous import ContinuousJobs
from treadle.service.gateway import Gateway
from treadle.service.job_records import JobRecords
from treadle.service.jobs import Rollouts
from treadle.service.journal import JournalWriter
from treadle.service.judging import Judging
from treadle.service.keys import FileKey, KeyRing, SessionKeys
from treadle.service.metrics import Metrics
from treadle.service.monitor import Monitor
from treadle.service.outbox import Outbox
from treadle.service.planning import Planner
from treadle.service.schemas import EngineRequest
from treadle.service.session_journal import SessionJournal
from treadle.service.weight_schemas import WeightsView
from treadle.store.aio import AsyncStore
from treadle.store.db import Store
from treadle.store.process import StoreProcess

log = logging.getLogger(__name__)
_RESTART_BASE_S = 10.0  # opening the store and recovering its jobs, with margin


@dataclass(slots=True)
class ServiceConfig:
    """How `treadle serve` (or a test, or the demo) sets a service up."""

    db: str = "treadle.db"  # SQLite file (":memory:" for throwaway runs)
    # The store in a process of its own (`store.process`): SQLite and the records'
    # encoding off this process's cores, where the scheduler runs. A file only.
    store_process: bool = False
    token: str | None = None  # the admin's bearer token; None = no auth (loopback use only)
    # Trainer keys of a keys file (`service.keys.read_keys_file`; needs a token). More
    # come through POST /v1/keys, kept in the store.
    trainer_keys: tuple[FileKey, ...] = ()
    policy: str = "treadle"  # scheduling policy (treadle.core.policies)
    model: str = "qwen3-14b"  # cost-model entry the policy plans with
    gpu: str = "h100"  # cost-model entry
    engines: list[EngineRequest] = field(default_factory=list)  # registered at start
    emulate: int = 0  # GPUs of emulated engines to start (0: none)
    # Of the emulated engines (started here or registered), and so of the runtime's
    # clock; refused with real engines, whose seconds are real.
    time_scale: float = 1.0
    tokenizer: str | None = None  # tokenizer.json directory; None: replay tasks only
    sandbox: SandboxBackend | None = None  # for suites that run code
    # Each suite's sandbox pool: 64 sandboxes at once (in use, warm, starting), 2 warm,
    # 64 starts a second (bursts of 16). bwrap sustains ~77 fresh sandboxes a second on
    # 2 cores (benchmarks/sandbox.json), so the rate guards against start storms on
    # remote backends without pacing a local one.
    sandbox_pool: PoolSettings = field(default_factory=lambda: PoolSettings(
        warm=2, max_live=64, create_rate_per_s=64.0, create_burst=16))
    max_live: int = 4096  # trajectories running at once
    # Where a trajectory a restart interrupted starts again: its last journaled turn
    # ("turn"), or its prompt ("prompt": to measure what the journal saves; its turns
    # are journaled still, and the records count what was discarded).
    resume_from: Literal["turn", "prompt"] = "turn"
    # How the `treadle` policy weighs staleness across weight updates (asynchronous
    # RL: `core.policies.progressive.Staleness`): older trajectories first, and with
    # its gate none started that would go stale before it could finish. None: not at
    # all (each job's own `max_staleness` still bounds what it delivers as fresh).
    staleness: Staleness | None = None
    # Whether the `treadle` policy merges idle engines into one of a larger TP degree
    # for a job's long tail (`core.policies.tail_merge`; split back once no trajectory
    # is left, or once its tail has ended and new trajectories have arrived). Off by
    # default: it needs a launcher (emulate, vllm_model), and each merge and split
    # restarts engines, which pays for a long tail, not for every job.
    reconfigure: bool = False
    max_queued: int = 262_144  # trajectories waiting for a slot (a fuller submit is a 503)
    max_body_bytes: int = 64 << 20  # request body limit
    body_timeout_s: float = 60.0  # a request body must arrive within this (else a 408)
    max_requests: int = 256  # API requests at once (streams apart)
    max_streams: int = 256  # NDJSON streams at once
    # A followed stream silent this long gets a blank line, so that a client can tell
    # a job with nothing new from a dead connection (its read timeout: a few of these).
    stream_heartbeat_s: float = 15.0
    request_timeout_s: float | None = 600.0  # per engine call
    # The grace a waiting turn gets while no engine is live (none yet, or the last one
    # failed and a replacement may come): it fails with NoEngineAvailable after this
    # many seconds of the runtime's clock (modelled seconds with emulated engines).
    engine_wait_s: float = 60.0
    vllm_model: str | None = None  # start vLLM engines serving this model directory
    vllm_engines: int = 1  # how many (each a TP-1 process of its own)
    vllm_python: str = "python3"  # the interpreter vLLM is installed in
    vllm_max_model_len: int = 1024  # --max-model-len of the started engines
    # Start the engines (`emulate` or `vllm_model`) on a Ray cluster (the `ray` extra),
    # the pool the policy plans for the GPUs it reports, instead of on this machine.
    ray: RayCluster | None = None
    # With `ray`: run tools on sandbox servers started on the cluster, as many as the
    # suites' pools need within `sandbox_scaling` (runtime.ray_sandboxes); `sandbox`
    # is then theirs (a remote backend with a token of this service's own).
    sandbox_servers: SandboxServers | None = None
    sandbox_scaling: Scaling = field(default_factory=Scaling)
    # With `ray`: run workload replays and suite tasks in these runner actors on the
    # cluster (runtime.ray_runners), the scheduler staying here; None: in this
    # process.
    runners: RunnerActors | None = None
    # Directories a job's suite options may name files under (e.g. nemo_gym's
    # rows_path); a path outside them, or any path when there are none, is refused.
    data_roots: tuple[str, ...] = ()
    max_data_file_bytes: int = 256 << 20  # largest file such an option may name
    # The harness gateway (docs/gateway.md): the chat format the served model's
    # template is (agent.chat), the sessions open at once, how long a session the
    # gateway ended waits for its owner to score it, the model name
    # `GET .../openai/v1/models` lists, and the service's URL as harnesses reach it
    # (None: the URL each session's creation came to).
    chat_format: str = "hermes"
    max_sessions: int = 4096
    session_grace_s: float = 300.0
    served_model: str = "policy"
    public_url: str | None = None
    # Harness commands jobs may name (`JobRequest.harness`), by name.
    harnesses: dict[str, Harness] = field(default_factory=dict)
    # The frozen pool: engines serving a pinned policy version for frozen sub-agents
    # (sessions with trainable false), scheduled by a runtime of their own that weight
    # updates never reach; their tokens carry `frozen_policy_version`.
    frozen_engines: list[EngineRequest] = field(default_factory=list)
    frozen_policy_version: int = 0
    # The dashboard's history (`service.monitor`): a sample of the service's counters
    # every this many real seconds, the latest 600 kept (ten minutes at 1 s).
    monitor_interval_s: float = 1.0


class Service:
    """The parts of a running service; see the module docstring."""

    def __init__(self, config: ServiceConfig, runtime: Runtime, store: AsyncStore,
                 rollouts: Rollouts, gateway: Gateway, keys: KeyRing, sandboxes: SuitePools,
                 *, restart_s: float = _RESTART_BASE_S, frozen: Runtime | None = None,
                 fleet: RaySandboxFleet | None = None,
                 runners: RayRunners | None = None) -> None:
        self.config = config
        self.runners = runners  # runner actors on Ray (ServiceConfig.runners)
        self.fleet = fleet  # sandbox servers on Ray (ServiceConfig.sandbox_servers)
        self._fleet_task: asyncio.Task[None] | None = None
        self.keys = keys  # who each request speaks for (service.keys)
        self.runtime = runtime
        self.frozen = frozen  # the frozen pool's runtime (ServiceConfig.frozen_engines)
        # The served model's tokenizer (None without one), shown in job and session views.
        self.tokenizer_fingerprint = gateway.tokenizer_fingerprint
        self.store = store
        self.rollouts = rollouts
        self.gateway = gateway
        self.sandboxes = sandboxes  # each suite's sandbox pool
        # What the dashboard shows: the service's recent history and its engines'
        # load, and each job's timeline, groups and records.
        self.monitor = Monitor(rollouts, lambda: [rt for _, rt in self.pools()],
                               interval_s=config.monitor_interval_s)
        self.records = JobRecords(store, rollouts)
        self.continuous = ContinuousJobs(rollouts)  # continuous jobs' groups, on rollouts
        # How long this service takes to answer again after a restart (seconds): what
        # it announces on /healthz and in the `x-treadle-restart-s` header, and what
        # the client's retries wait for at least. Engines started here dominate it.
        self.restart_s = restart_s

    async def start(self) -> None:
        # Engines started here from a model directory are TP-1 processes, whatever
        # layout the policy would plan for GPUs it does not have (on Ray: its plan).
        pool = ([1] * self.config.vllm_engines if self.config.vllm_model
                and self.config.ray is None else None)
        await self.keys.load()
        if self.fleet is not None:  # the first servers before the first trajectory
            await self.fleet.rebalance()
            self._fleet_task = asyncio.create_task(self.fleet.run())
        await self.runtime.start(pool)
        if self.runners is not None:  # they mirror the engines started above
            await self.runners.start()
        if self.frozen is not None:
            await self.frozen.start()
        for request in [*self.config.engines, *self.config.frozen_engines]:
            engine = engine_client(request)
            if not await engine.health():
                log.warning("engine %s is not healthy; registering it anyway (the runtime "
                            "fails it if it stays down)", request.url)
            elif (problem := await engine.model_problem()) is not None:
                # Every turn on it would fail: refuse to start rather than serve errors.
                await engine.aclose()
                flag = "--engine" if request.pool == "policy" else "--frozen-engine"
                raise ValueError(f"{flag} {request.url}: {problem} (--served-model)")
            self.pool_runtime(request.pool).register_engine(
                engine, tp=request.tp, max_batch=request.max_batch,
                kv_capacity_tokens=request.kv_capacity_tokens, label=request.url)
        self.monitor.start()
        recovered = await self.rollouts.start()
        recovered += await self.continuous.start()
        if recovered:
            log.info("resumed %d unfinished job(s): %s", len(recovered), ", ".join(recovered))

    async def close(self) -> None:
        await self.monitor.close()
        await self.gateway.close()
        await self.continuous.close()
        await self.rollouts.close()
        if self.runners is not None:
            await self.runners.close()
        await self.runtime.close()
        if self.frozen is not None:
            await self.frozen.close()
        if self.fleet is not None:  # after the pools: their sandboxes are closed
            if self._fleet_task is not None:
                self._fleet_task.cancel()
                await asyncio.gather(self._fleet_task, return_exceptions=True)
            await self.fleet.close()
        await self.store.aclose()

    def pool_runtime(self, pool: str) -> Runtime:
        """The runtime of engine pool `pool` (policy | frozen)."""
        if pool == "policy":
            return self.runtime
        if self.frozen is None:
            raise ValueError(f"no engine pool {pool!r}")
        return self.frozen

    def pools(self) -> list[tuple[str, Runtime]]:
        """Every engine pool of the service, by name."""
        return [("policy", self.runtime)] + ([] if self.frozen is None
                                              else [("frozen", self.frozen)])

    def metrics_text(self) -> str:
        m = self.rollouts.metrics
        return m.render(active=self.rollouts.live, queued=self.rollouts.queued,
                        engines={s.label: s.calls for _, rt in self.pools()
                                 for s in rt.engines()},
                        policy_version=self.runtime.policy_version,
                        unjournaled=self.rollouts.attempts.journal.unjournaled)

    async def check_engine(self, engine: Engine, request: EngineRequest,
                           ) -> tuple[str, str] | None:
        """Why an engine offered for registration cannot join the pool, as (field,
        message), or None: it must answer its health check and serve `request.model`."""
        if not await engine.health():
            return "url", f"no healthy engine at {request.url}"
        problem = await engine.model_problem()
        if problem is not None:
            return "model", problem
        return None

    def weights_view(self) -> WeightsView:
        frozen = self.frozen
        return WeightsView(policy_version=self.runtime.policy_version,
                           trainer_run=self.runtime.trainer_run, paused=self.runtime.paused,
                           frozen_policy_version=None if frozen is None or not frozen.engines()
                           else frozen.policy_version)


def build_service(config: ServiceConfig) -> Service:
    """The parts, not started (the app's lifespan starts them)."""
    cost = CostModel.named(config.model, config.gpu)
    scheduler = build_policy(parse_policy(config.policy), cost, batch_size=1024,
                             staleness=config.staleness, reconfigure=config.reconfigure)
    if config.emulate and config.vllm_model:
        raise ValueError("emulate and vllm_model exclude each other: one kind of engine")
    if config.time_scale != 1.0 and (config.vllm_model or any(
            e.kind != "emulated" for e in config.engines)):
        # Only emulated engines run on a scaled clock; real engines' seconds are real.
        raise ValueError("time_scale applies to emulated engines only (--emulate, or "
                         "--engine-kind emulated)")
    launcher, gpus = _launcher(config)
    if config.reconfigure and launcher is None:
        raise ValueError("reconfigure merges engines the service launches: give emulate or "
                         "vllm_model")
    # Emulated engines run `time_scale` times real; the scheduler and the replays'
    # tool latencies must see the same modelled seconds, or a replay sleeps its tools
    # in real seconds between turns that run 1/time_scale times faster.
    clock = ScaledClock(config.time_scale) if config.time_scale != 1.0 else WallClock()
    runtime = Runtime(scheduler, launcher=launcher, gpus=gpus, clock=clock,
                      request_timeout_s=config.request_timeout_s,
                      engine_wait_s=config.engine_wait_s)
    store = AsyncStore(StoreProcess(config.db) if config.store_process else Store(config.db))
    tokenizer = HFTokenizer(config.tokenizer) if config.tokenizer else None
    metrics = Metrics()
    outbox = Outbox(store, metrics)
    # The fleet's demand is the pools' waiting starts (the pools use its servers), the
    # runner actors' pools included; the actors' copies of its backend follow it.
    async def demand() -> int:
        return sandboxes.waiting() + (0 if runners is None else await runners.sandbox_waiting())

    def servers_changed(accepting: tuple[str, ...]) -> None:
        if runners is not None:
            runners.sandbox_servers(accepting)

    fleet = _sandbox_fleet(config, demand, servers_changed)
    sandbox = fleet.backend if fleet is not None else config.sandbox
    sandboxes = SuitePools(sandbox, config.sandbox_pool)
    planner = Planner(tokenizer=tokenizer, sandbox_backend=sandbox,
                      max_context=cost.model.max_context, data_roots=config.data_roots,
                      max_data_file_bytes=config.max_data_file_bytes,
                      harnesses=list(config.harnesses), chat_format=config.chat_format)
    runtime.control.observer = metrics.decisions.observe
    restart_s = _RESTART_BASE_S + (launcher.startup_s(1) if launcher is not None else 0.0)
    if any(e.pool != "frozen" for e in config.frozen_engines):
        raise ValueError("frozen_engines: every engine of the frozen pool has pool frozen")
    # Always there (empty unless configured), so that `POST /v1/engines` can add to it.
    frozen = Runtime(build_policy(parse_policy(config.policy), cost, batch_size=1024,
                                  reconfigure=False),
                     clock=clock, request_timeout_s=config.request_timeout_s,
                     engine_wait_s=config.engine_wait_s, engine_ids="f")
    frozen.policy_version = config.frozen_policy_version
    session_keys = SessionKeys()
    journal = JournalWriter(store, metrics, from_prompt=config.resume_from == "prompt")
    judging = Judging(runtime, frozen, tokenizer, sandboxes)
    # Workload replays, suite tasks and gateway sessions' turns run in the runner
    # actors (with copies of the tokenizer and the sandbox backend, for suite tasks).
    # Each actor keeps its share of the sandbox pools' settings, so that together they
    # keep to the service's (`PoolSettings.shared`).
    pools = config.sandbox_pool.shared(config.runners.count) if config.runners \
        else config.sandbox_pool
    runners = _runners(config, runtime, RunnerKit(tokenizer, sandbox, pools))
    gateway = Gateway(runtime, store, outbox, sandboxes, tokenizer,
                      default_format=config.chat_format, max_sessions=config.max_sessions,
                      grace_s=config.session_grace_s, harnesses=config.harnesses,
                      url=config.public_url, keys=session_keys, frozen=frozen,
                      journal=SessionJournal(journal, store), judging=judging, turns=runners)
    attempts = Attempts(runtime, sandboxes, judging, journal,
                        tokenizer=tokenizer, harnesses=gateway, runners=runners)
    rollouts = Rollouts(runtime, store, planner, outbox, attempts, harnesses=gateway,
                        max_live=config.max_live, max_queued=config.max_queued)
    keys = KeyRing(config.token, store, session_keys, _open_sessions(gateway),
                   file_keys=config.trainer_keys)
    return Service(config, runtime, store, rollouts, gateway, keys, sandboxes,
                   restart_s=restart_s, frozen=frozen, fleet=fleet, runners=runners)


def _launcher(config: ServiceConfig) -> tuple[EngineLauncher | None, int]:
    """The launcher of the engines the service starts, and the GPUs it may use."""
    spec: ProcessSpec
    if config.emulate:
        spec = EmulatedProcess(config.model, config.gpu, time_scale=config.time_scale)
        gpus = config.emulate
    elif config.vllm_model:
        # Dev mode for the RL endpoints: the weight-update barrier reloads weights.
        spec = VLLMProcess(
            model_dir=config.vllm_model, served_name="policy", python=config.vllm_python,
            max_model_len=config.vllm_max_model_len,
            extra_env=(("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_SERVER_DEV_MODE", "1")))
        gpus = config.vllm_engines
    elif config.ray is not None and not config.engines:
        raise ValueError("ray starts the engines of emulate or vllm_model, or runs beside "
                         "engines given by URL (engines): give one")
    else:  # engines given by URL (beside a Ray cluster's runners and sandboxes, or not)
        return None, 0
    if config.ray is None:
        return LocalLauncher(spec), gpus
    # A local cluster declares the emulated GPUs; of a running one's, at most `emulate`.
    reported = config.ray.connect(num_gpus=config.emulate or None)
    gpus = min(gpus, reported) if config.emulate else reported
    if not gpus:
        raise ValueError("the Ray cluster has no GPUs engines may use (nodes with GPUs "
                         "and every resource of ray.resources)")
    return RayLauncher(spec, resources=dict(config.ray.resources)), gpus


def _sandbox_fleet(config: ServiceConfig, demand: Callable[[], Awaitable[int]],
                   servers_changed: Callable[[tuple[str, ...]], None]
                   ) -> RaySandboxFleet | None:
    """Sandbox servers on the Ray cluster (`sandbox_servers`), with a token of their own."""
    if config.sandbox_servers is None:
        return None
    if config.ray is None:
        raise ValueError("sandbox_servers start on a Ray cluster: give ray too")
    config.ray.connect(num_gpus=config.emulate or None)
    token = secrets.token_urlsafe(32)
    return RaySandboxFleet(RemoteBackend([], token), token, config.sandbox_servers,
                           config.sandbox_scaling, demand=demand,
                           servers_changed=servers_changed)


def _runners(config: ServiceConfig, runtime: Runtime, kit: RunnerKit) -> RayRunners | None:
    """The runner actors on the Ray cluster (`runners`)."""
    if config.runners is None:
        return None
    if config.ray is None:
        raise ValueError("runners start on a Ray cluster: give ray too")
    config.ray.connect(num_gpus=config.emulate or None)
    return RayRunners(runtime, config.runners, kit)


def _open_sessions(gateway: Gateway) -> Callable[[str], bool]:
    """Whether a session is open (its key opens it only then)."""
    def live(session_id: str) -> bool:
        try:
            return not gateway.session(session_id).ended
        except TreadleError:  # ended and forgotten, or a service without sessions
            return False
    return live


def engine_client(request: EngineRequest) -> Engine:
    """The client for a registered engine of `request.kind`."""
    if request.kind == "sglang":
        from treadle.engines.sglang import SGLangEngine

        return SGLangEngine(request.url)
    if request.kind == "emulated":
        from treadle.engines.emulated_client import EmulatedEngineClient

        return EmulatedEngineClient(request.url, model=request.model)
    from treadle.engines.vllm import VLLMEngine

    return VLLMEngine(request.url, model=request.model, tokens_api=request.api == "tokens")
