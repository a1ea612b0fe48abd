"""Client of the emulated engine: vLLM's client, with an abort that keeps the tokens.

The emulated engine (`treadle engine emulate`) speaks vLLM's API and adds
`POST /abort_request {"request_id"}`, which ends a request at once and returns its
tokens so far through the pending `/v1/completions` call (as SGLang's abort does).
`EmulatedEngineClient.abort` uses it, so a preempted turn resumes from what it had
generated instead of starting again; vLLM's own client can only drop the connection,
which loses the partial output. If the engine does not answer the abort within
`abort_grace_s`, the connection is dropped as a fallback.
"""

from __future__ import annotations

import asyncio
import contextlib

from treadle.engines.errors import EngineError
from treadle.engines.vllm import VLLMEngine

_ABORT_TIMEOUT_S = 5.0


class EmulatedEngineClient(VLLMEngine):
    """`VLLMEngine` for an emulated engine; `abort` returns the partial output."""

    abort_grace_s = 5.0  # how long the pending call may take to return after an abort

    async def abort(self, request_id: str) -> None:
        task = self._inflight.get(request_id)
        if task is None or task.done():
            return
        with contextlib.suppress(EngineError, TimeoutError):
            await asyncio.wait_for(self._raw(lambda: self._client.post(
                "/abort_request", json={"request_id": request_id})), _ABORT_TIMEOUT_S)
        await asyncio.wait({task}, timeout=self.abort_grace_s)
        if not task.done():
            await super().abort(request_id)
