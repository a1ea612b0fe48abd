"""The service's parts, built from a configuration, started and closed together.

    service = build_service(ServiceConfig(db="treadle.db", token="s3cret",
                                          engines=[EngineRequest(url=..., model=...)]))
    app = create_app(service)          # treadle.service.app; its lifespan starts it

`Service` owns one store (SQLite, its calls on one worker thread), one runtime
(the scheduler of `policy` over the engine pool) and the job runner. Engines come
from `engines` (already running, registered at start), `emulate` (emulated engine
processes the runtime starts, laid out by the policy on that many GPUs; the
runtime's clock then runs at their `time_scale`, so trajectory timings are modelled
seconds, as in `treadle bench live`), or later through `POST /v1/engines`. Suite
tasks need `tokenizer` (the served model's `tokenizer.json` directory) and, for
suites that run code, a sandbox backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from treadle.agent.chat import HFTokenizer
from treadle.core.cost_model import CostModel
from treadle.core.policies import build_policy, parse_policy
from treadle.engines.base import Engine
from treadle.runtime.clock import ScaledClock
from treadle.runtime.driver import Runtime
from treadle.runtime.launcher import EmulatedProcess, EngineLauncher, LocalLauncher
from treadle.sandbox.base import SandboxBackend
from treadle.service.jobs import Rollouts
from treadle.service.schemas import EngineRequest, WeightsView
from treadle.store.aio import AsyncStore
from treadle.store.db import Store

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServiceConfig:
    """How `treadle serve` (or a test, or the demo) sets a service up."""

    db: str = "treadle.db"  # SQLite file (":memory:" for throwaway runs)
    token: str | None = None  # bearer token; None = no auth (loopback use only)
    policy: str = "treadle"  # scheduling policy (treadle.core.policies)
    model: str = "qwen3-14b"  # cost-model entry the policy plans with
    gpu: str = "h100"  # cost-model entry
    engines: list[EngineRequest] = field(default_factory=list)  # registered at start
    emulate: int = 0  # GPUs of emulated engines to start (0: none)
    time_scale: float = 1.0  # of the emulated engines and, with them, the runtime's clock
    tokenizer: str | None = None  # tokenizer.json directory; None: replay tasks only
    sandbox: SandboxBackend | None = None  # for suites that run code
    max_live: int = 4096  # trajectories running at once
    max_body_bytes: int = 64 << 20  # request body limit
    max_requests: int = 256  # API requests at once (streams apart)
    max_streams: int = 256  # NDJSON streams at once
    request_timeout_s: float | None = 600.0  # per engine call
    engine_wait_s: float = 60.0  # a turn with no engine at all gives up after this


class Service:
    """The parts of a running service; see the module docstring."""

    def __init__(self, config: ServiceConfig, runtime: Runtime, store: AsyncStore,
                 rollouts: Rollouts) -> None:
        self.config = config
        self.runtime = runtime
        self.store = store
        self.rollouts = rollouts
        self.token = config.token
        self.max_body_bytes = config.max_body_bytes
        self.max_requests = config.max_requests
        self.max_streams = config.max_streams

    async def start(self) -> None:
        await self.runtime.start()
        for request in self.config.engines:
            engine = engine_client(request)
            if not await engine.health():
                log.warning("engine %s is not healthy; registering it anyway (the runtime "
                            "fails it if it stays down)", request.url)
            self.runtime.register_engine(engine, tp=request.tp, max_batch=request.max_batch,
                                         kv_capacity_tokens=request.kv_capacity_tokens,
                                         label=request.url)
        recovered = await self.rollouts.start()
        if recovered:
            log.info("resumed %d unfinished job(s): %s", len(recovered), ", ".join(recovered))

    async def close(self) -> None:
        await self.rollouts.close()
        await self.runtime.close()
        await self.store.aclose()

    def metrics_text(self) -> str:
        m = self.rollouts.metrics
        return m.render(active=self.rollouts.live, queued=self.rollouts.queued,
                        engines={s.label: s.calls for s in self.runtime.engines()},
                        policy_version=self.runtime.policy_version)

    def weights_view(self) -> WeightsView:
        return WeightsView(policy_version=self.runtime.policy_version,
                           paused=self.runtime.paused)


def build_service(config: ServiceConfig) -> Service:
    """The parts, not started (the app's lifespan starts them)."""
    cost = CostModel.named(config.model, config.gpu)
    scheduler = build_policy(parse_policy(config.policy), cost, batch_size=1024)
    launcher: EngineLauncher | None = None
    if config.emulate:
        launcher = LocalLauncher(EmulatedProcess(config.model, config.gpu,
                                                 time_scale=config.time_scale))
    # Emulated engines run `time_scale` times the modelled durations; the runtime's
    # clock must run at the same speed, or replayed tool latencies (slept on it) and the
    # scheduler's time would stay at modelled speed while the engines do not.
    clock = ScaledClock(config.time_scale) if config.emulate else None
    runtime = Runtime(scheduler, launcher=launcher, gpus=config.emulate, clock=clock,
                      request_timeout_s=config.request_timeout_s,
                      engine_wait_s=config.engine_wait_s)
    store = AsyncStore(Store(config.db))
    tokenizer = HFTokenizer(config.tokenizer) if config.tokenizer else None
    rollouts = Rollouts(runtime, store, tokenizer=tokenizer, sandbox_backend=config.sandbox,
                        max_live=config.max_live)
    runtime.control.observer = rollouts.metrics.decisions.observe
    return Service(config, runtime, store, rollouts)


def engine_client(request: EngineRequest) -> Engine:
    """The client for a registered engine of `request.kind`."""
    if request.kind == "sglang":
        from treadle.engines.sglang import SGLangEngine

        return SGLangEngine(request.url)
    if request.kind == "emulated":
        from treadle.engines.emulated_client import EmulatedEngineClient

        return EmulatedEngineClient(request.url, model=request.model)
    from treadle.engines.vllm import VLLMEngine

    return VLLMEngine(request.url, model=request.model)
