"""Client of the emulated engine: vLLM's client, with an abort that keeps the tokens.

The emulated engine (`treadle engine emulate`) speaks vLLM's API and adds
`POST /abort_request {"request_id"}`, which ends a request at once and returns its
tokens so far through the pending `/v1/completions` call (as SGLang's abort does).
`EmulatedEngineClient.abort` uses it, so a preempted turn resumes from what it had
generated instead of starting again; vLLM's own client can only drop the connection,
which loses the partial output. If the engine does not answer the abort within
`abort_grace_s`, the connection is dropped as a fallback. The emulated engine has no
grammar: it decodes under no constraint (structured output is a 400 there).
"""

from __future__ import annotations

from treadle.engines.base import EngineCapabilities
from treadle.engines.vllm import VLLMEngine


class EmulatedEngineClient(VLLMEngine):
    """`VLLMEngine` for an emulated engine; `abort` returns the partial output."""

    abort_grace_s = 5.0  # how long the pending call may take to return after an abort

    async def abort(self, request_id: str) -> None:
        await self._abort_by_endpoint(request_id, "/abort_request",
                                      {"request_id": request_id}, self.abort_grace_s)

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(weight_updates=True)
