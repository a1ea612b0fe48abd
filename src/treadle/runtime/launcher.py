"""Starting and stopping engines: the runtime's way to change its engine pool.

    launcher = LocalLauncher(EmulatedProcess("qwen3-14b", "h100", time_scale=0.05))
    launched = await launcher.start(tp=2)        # a process, up and healthy
    ...
    await launched.stop()

An `EngineLauncher` turns "an engine of TP degree t" into a running engine and its
client (`LaunchedEngine`), and says what a start costs (`startup_s`), which a policy
weighs before reconfiguring. `LocalLauncher` runs engines as child processes of
this machine, from a `ProcessSpec`:

- `EmulatedProcess`: `treadle engine emulate` (vLLM's API, cost-model timing) —
  cluster-scale experiments on CPUs;
- `VLLMProcess`: a real vLLM server (`vllm.entrypoints.openai.api_server`), e.g.
  the CPU build serving a small model.

A launcher on a distributed engine pool (Ray, Slurm, Kubernetes) implements the
same two methods. Engines started elsewhere are registered with the runtime
directly (`Runtime.register_engine`), without a launcher.

Contracts: `start` returns only once the engine answers its health check, and
raises `EngineStartError` (with the tail of the engine's log) if it exits or is not
healthy within `ready_timeout_s`; the process it started is then gone. `stop` ends
the engine's whole process group (SIGTERM, then SIGKILL after `stop_timeout_s`) and
is idempotent. Processes run in their own session, so a Ctrl-C of the runtime does
not reach them; the runtime stops them on close, and on Linux they get SIGTERM if
the runtime's process dies without closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from treadle.engines.base import Engine
from treadle.engines.errors import EngineError, EngineStartError


@dataclass(slots=True)
class LaunchedEngine:
    """A running engine and how to stop it."""

    engine: Engine  # its client
    tp: int  # tensor-parallel degree (GPUs it occupies)
    max_batch: int  # most sequences it runs at once
    kv_capacity_tokens: int  # its KV cache, in tokens
    url: str  # where it listens
    label: str  # for logs, e.g. "emulated qwen3-14b tp2 :8123"
    stop: Callable[[], Awaitable[None]] = field(repr=False)  # stops it; idempotent
    pid: int | None = None  # its process (group leader), when it is a local process


class EngineLauncher(ABC):
    """Starts engines of a given TP degree."""

    @abstractmethod
    async def start(self, tp: int) -> LaunchedEngine:
        """An engine of degree `tp`, healthy; EngineStartError otherwise."""

    @abstractmethod
    def startup_s(self, tp: int) -> float:
        """Typical real seconds from `start` to a healthy engine (a process starts on
        the wall clock, whatever clock the runtime runs on)."""


class ProcessSpec(ABC):
    """How to run one kind of engine as a local process."""

    name: str = "engine"

    @abstractmethod
    def command(self, tp: int, port: int, index: int, host: str = "127.0.0.1") -> list[str]:
        """The argv of an engine listening on `host`:`port` (`index`: n-th start)."""

    def env(self) -> dict[str, str]:
        """Extra environment variables for the process."""
        return {}

    @abstractmethod
    def client(self, url: str) -> Engine:
        """A client for the engine at `url`."""

    @abstractmethod
    async def capacity(self, tp: int, client: Engine) -> tuple[int, int]:
        """(max_batch, kv_capacity_tokens) of a healthy engine."""

    startup_estimate_s: float = 5.0  # typical start-up, real seconds


@dataclass(slots=True)
class EmulatedProcess(ProcessSpec):
    """`treadle engine emulate`: timing from the cost model, synthetic tokens."""

    model: str = "qwen3-14b"  # cost-model entry
    gpu: str = "h100"  # cost-model entry
    time_scale: float = 1.0  # every modelled duration times this
    max_num_seqs: int = 1024  # vLLM's default on 80 GB+ GPUs, as the simulator uses
    seed: int = 0  # engine n gets seed + n
    python: str = sys.executable
    name: str = "emulated"
    startup_estimate_s: float = 2.0

    def command(self, tp: int, port: int, index: int, host: str = "127.0.0.1") -> list[str]:
        return [self.python, "-m", "treadle", "engine", "emulate", "--host", host,
                "--port", str(port),
                "--model", self.model, "--gpu", self.gpu, "--tp", str(tp),
                "--time-scale", repr(self.time_scale), "--max-num-seqs",
                str(self.max_num_seqs), "--seed", str(self.seed + index),
                "--log-level", "warning"]

    def client(self, url: str) -> Engine:
        from treadle.engines.emulated_client import EmulatedEngineClient

        return EmulatedEngineClient(url, model=f"{self.model}-emulated")

    async def capacity(self, tp: int, client: Engine) -> tuple[int, int]:
        from treadle.core.cost_model import CostModel

        return self.max_num_seqs, CostModel.named(self.model, self.gpu).kv_capacity_tokens(tp)


@dataclass(slots=True)
class VLLMProcess(ProcessSpec):
    """A real vLLM server (`python -m vllm.entrypoints.openai.api_server`).

    `python` is the interpreter of the environment vLLM is installed in. The KV
    capacity is read from the server's `vllm:cache_config_info` metric
    (num_gpu_blocks x block_size). TP > 1 is passed as `--tensor-parallel-size`.
    """

    model_dir: str = ""  # a directory vLLM loads (save_pretrained output)
    served_name: str = "model"  # --served-model-name
    python: str = "python3"
    max_model_len: int = 1024
    max_num_seqs: int = 64
    extra_args: tuple[str, ...] = ()  # appended to the command line
    extra_env: tuple[tuple[str, str], ...] = (("VLLM_CPU_KVCACHE_SPACE", "1"),)
    # Off by default: vLLM's CPU build (0.32) kills its engine core on a seeded request
    # whose prefill it splits across steps (it rewinds the request's generator, which
    # CPU generators cannot do). A prompt then prefills in one step; GPU servers with
    # long prompts want it on.
    chunked_prefill: bool = False
    # Structured output (a request's constraint) with no whitespace sampled between
    # JSON tokens (xgrammar's compact JSON): with whitespace free, the small model
    # looped on it until its token budget in 6 of 6 draws at T=1 (measured on vLLM
    # 0.32, 96 tokens); without, 3 of 3 closed a bounded schema in 25 tokens. The
    # reply still matches its schema; the whitespace is only not sampled.
    compact_json: bool = True
    # vLLM's token-in token-out API (`--enable-scale-out`; the client's `tokens_api`):
    # replies say which weights sampled each token, so a "keep" update freezes calls
    # in flight instead of aborting them (whose partial output vLLM does not return).
    tokens_api: bool = False
    name: str = "vllm"
    startup_estimate_s: float = 60.0

    def command(self, tp: int, port: int, index: int, host: str = "127.0.0.1") -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               self.model_dir, "--served-model-name", self.served_name, "--dtype", "float32",
               "--max-model-len", str(self.max_model_len), "--max-num-seqs",
               str(self.max_num_seqs), "--scheduling-policy", "priority",
               "--enable-prompt-tokens-details", "--host", host, "--port", str(port)]
        if tp > 1:
            cmd += ["--tensor-parallel-size", str(tp)]
        if not self.chunked_prefill:
            cmd.append("--no-enable-chunked-prefill")
        if self.compact_json:
            cmd += ["--structured-outputs-config",
                    '{"backend": "xgrammar", "disable_any_whitespace": true}']
        if self.tokens_api:
            cmd.append("--enable-scale-out")
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        return dict(self.extra_env)

    def client(self, url: str) -> Engine:
        from treadle.engines.vllm import VLLMEngine

        return VLLMEngine(url, model=self.served_name, tokens_api=self.tokens_api)

    async def capacity(self, tp: int, client: Engine) -> tuple[int, int]:
        from treadle.engines.vllm import VLLMEngine

        assert isinstance(client, VLLMEngine)
        text = await client._get_text("/metrics")
        return self.max_num_seqs, kv_tokens_from_metrics(text)


_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)


def kv_tokens_from_metrics(text: str) -> int:
    """KV cache size in tokens from vLLM's `vllm:cache_config_info` labels
    (num_gpu_blocks × block_size); EngineError if the metric is missing."""
    m = _CACHE_INFO.search(text)
    if m is not None:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        try:
            return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            pass
    raise EngineError("/metrics: no vllm:cache_config_info with num_gpu_blocks and "
                      "block_size")


class LocalLauncher(EngineLauncher):
    """Engines as child processes on this machine, one port each on loopback."""

    def __init__(self, spec: ProcessSpec, *, log_dir: str | Path | None = None,
                 ready_timeout_s: float = 600.0, stop_timeout_s: float = 10.0) -> None:
        self.spec = spec
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="treadle-engines-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._started = 0

    def startup_s(self, tp: int) -> float:
        return self.spec.startup_estimate_s

    async def start(self, tp: int) -> LaunchedEngine:
        index = self._started
        self._started += 1
        port = free_port()
        log_path = self.log_dir / f"{self.spec.name}-{index:03d}-tp{tp}.log"
        with open(log_path, "wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *self.spec.command(tp, port, index), stdout=log, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, env={**os.environ, **self.spec.env()},
                start_new_session=True, preexec_fn=die_with_parent)
        url = f"http://127.0.0.1:{port}"
        client = self.spec.client(url)

        @once
        async def stop() -> None:
            await client.aclose()
            await _end_process_group(proc, self.stop_timeout_s)

        async def exit_code() -> int | None:
            return proc.returncode

        try:
            await wait_healthy(self.spec.name, client, exit_code,
                               lambda: asyncio.to_thread(tail, log_path), f"log {log_path}",
                               self.ready_timeout_s)
            max_batch, kv = await self.spec.capacity(tp, client)
        except BaseException:
            await stop()
            raise
        return LaunchedEngine(client, tp, max_batch, kv, url,
                              f"{self.spec.name} tp{tp} :{port}", stop, proc.pid)


def once(stop: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """`stop` made idempotent: the first call runs it, later ones return at once (a
    `LaunchedEngine.stop`)."""
    done = False

    async def first() -> None:
        nonlocal done
        if not done:
            done = True
            await stop()
    return first


async def wait_healthy(name: str, client: Engine, exit_code: Callable[[], Awaitable[int | None]],
                       log_tail: Callable[[], Awaitable[str]], where: str,
                       timeout_s: float) -> None:
    """Return once the engine `client` speaks to answers its health check; raise
    EngineStartError with the tail of its log (`where` says where the log is) if its
    process exits first (`exit_code` is then not None) or it is not healthy within
    `timeout_s` real seconds. Every launcher's engines pass this gate."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await client.health():
        code = await exit_code()
        if code is not None:
            raise EngineStartError(f"{name} exited with {code} before it was healthy; "
                                   f"{where}:\n{await log_tail()}")
        if loop.time() > deadline:
            raise EngineStartError(f"{name} not healthy after {timeout_s:.0f}s; "
                                   f"{where}:\n{await log_tail()}")
        await asyncio.sleep(0.2)  # polling a server that is starting: no event to wait on


async def _end_process_group(proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    # Children the engine spawned (vLLM's engine core) share its process group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def stop_process_group(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """`_end_process_group` for a process started with `subprocess.Popen(...,
    start_new_session=True)` (a service, a vLLM server): SIGTERM its group, SIGKILL
    it after `timeout_s`, and SIGKILL what is left of the group (vLLM's engine core)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def die_with_parent() -> None:
    """In the child before exec: SIGTERM it when its parent process dies (Linux's
    PR_SET_PDEATHSIG), so a crashed runtime or trainer leaves no engine behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the runtime's close() is then the only cleanup


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released; another process
    may take it before the caller binds it, which start-up then reports).

    It is drawn below the kernel's ephemeral range, so that no outgoing connection
    (which takes its local port from that range) gets it in the meantime, and at
    random rather than the kernel's next free port, so that processes starting
    servers at once (test workers, launchers) do not draw the same one: the draw
    is unseeded on purpose."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(64 if low > _LOWEST_PORT + 1000 else 0):
        port = draw.randrange(_LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        chosen: int = s.getsockname()[1]
        return chosen


_LOWEST_PORT = 20000  # below: ports well-known services may hold


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of the log at `path` (or why it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(log unreadable: {e})"
