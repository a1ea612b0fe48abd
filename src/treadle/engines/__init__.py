"""Inference engine clients behind one small interface (`treadle.engines.base.Engine`).

- `vllm.VLLMEngine`: vLLM's OpenAI-compatible server (`/v1/completions`, token ids in/out).
- `sglang.SGLangEngine`: SGLang's native `/generate`.
- `emulated`: an engine server speaking vLLM's API whose timing follows the cost model
  (`treadle engine emulate`), for tests and experiments without GPUs.

Clients need the `server` extra (httpx, pydantic); the emulator also needs fastapi/uvicorn.
See docs/engines.md.
"""

from treadle.engines.base import Engine, EngineLoad, FinishReason, GenerateRequest, GenerateResult
from treadle.engines.errors import (
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)

__all__ = [
    "Engine",
    "EngineError",
    "EngineLoad",
    "EngineProtocolError",
    "EngineRequestError",
    "EngineTimeout",
    "EngineUnavailable",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
]
