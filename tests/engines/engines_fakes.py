"""Fakes of the engines' HTTP servers, following their documented wire formats.

`FakeVLLMServer` answers `/v1/completions`, `/metrics`, `/health` as vLLM's
OpenAI-compatible server does (a token-id prompt, `return_token_ids`, `logprobs`);
`FakeSGLangServer` answers `/generate`, `/abort_request`, `/metrics`, `/health` as
SGLang's native server does. Output tokens are `prompt[-1] + 1, + 2, ...` and each
logprob is `-0.1 * (i + 1)`, so tests can check what came back. `mode` picks a
misbehaviour. Neither is a real engine: they check the clients' wire handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse


def _outputs(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    return [prompt[-1] + i + 1 for i in range(n)], [-0.1 * (i + 1) for i in range(n)]


class _FakeServer:
    """Common parts: recorded requests, a `mode`, serving in a thread."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []  # JSON bodies received
        self.headers: list[dict[str, str]] = []  # their headers
        self.mode = "ok"
        self.disconnects = 0  # requests whose client went away before the reply
        self.app = FastAPI()

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """Serve on 127.0.0.1 (a free port) in a thread; yields the base URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                               http="h11", loop="asyncio", ws="none"))
        thread = threading.Thread(target=lambda: asyncio.run(server.serve([sock])),
                                  daemon=True)
        # Listening before the thread starts: a client's connection waits in the
        # kernel's backlog until uvicorn accepts it, so nothing here waits for startup.
        sock.listen(128)
        thread.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(10)
            sock.close()

    async def _hang_until_disconnect(self, request: Request) -> Response:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.disconnects += 1
        return Response(status_code=499)


class FakeVLLMServer(_FakeServer):
    """vLLM's `/v1/completions` wire format. Modes: ok, old_shape (no `usage`, token ids
    per choice), no_token_ids, bad_logprobs, hang, error500, reject400, not_json,
    old_metrics (`vllm:gpu_cache_usage_perc`), no_metrics. With `reply_ids` set, every
    completion is those ids (cut at max_tokens), finish reason "stop" when they fit:
    a scripted reply for tests that need one in a tokenizer's vocabulary; `script`
    gives each completion its own reply, in order."""

    def __init__(self, reply_ids: list[int] | None = None,
                 script: list[list[int]] | None = None) -> None:
        super().__init__()
        self.reply_ids = reply_ids
        # Replies in order, one per completion (then `reply_ids`, if set).
        self.script = list(script or [])
        self.replies: list[list[int]] = []  # the ids each completion returned
        self.received = threading.Event()  # a completion request has arrived

        @self.app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            self.received.set()
            if self.mode == "hang":
                return await self._hang_until_disconnect(request)
            if self.mode == "error500":
                return JSONResponse({"error": {"message": "engine dead"}}, 500)
            if self.mode == "reject400":
                return JSONResponse({"error": {"message": "priority not enabled"}}, 400)
            if self.mode == "not_json":
                return PlainTextResponse("<html>")
            prompt = body["prompt"]
            ids, lps = _outputs(prompt, body["max_tokens"])
            finish = "length"
            scripted = self.script.pop(0) if self.script else self.reply_ids
            if scripted is not None:
                ids = scripted[:body["max_tokens"]]
                lps = lps[:len(ids)]
                finish = "stop" if len(ids) == len(scripted) else "length"
            self.replies.append(list(ids))
            choice: dict[str, Any] = {
                "index": 0, "text": "x" * len(ids), "finish_reason": finish,
                "stop_reason": None,
                "logprobs": {"tokens": [str(t) for t in ids], "token_logprobs": lps,
                             "top_logprobs": [{str(t): lp} for t, lp in zip(ids, lps, strict=True)],
                             "text_offset": list(range(len(ids)))},
            }
            if body.get("return_token_ids") and self.mode != "no_token_ids":
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = prompt
            if self.mode == "bad_logprobs":
                choice["logprobs"]["token_logprobs"] = lps[:-1]
            reply: dict[str, Any] = {"id": f"cmpl-{body.get('request_id')}",
                                     "object": "text_completion", "model": body["model"],
                                     "choices": [choice]}
            if self.mode != "old_shape":
                reply["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                  "total_tokens": len(prompt) + len(ids),
                                  "prompt_tokens_details": {"cached_tokens": 16}}
            return JSONResponse(reply)

        @self.app.get("/metrics")
        async def metrics() -> Response:
            kv = "gpu_cache_usage_perc" if self.mode == "old_metrics" else "kv_cache_usage_perc"
            text = (
                "# HELP vllm:num_requests_running Number of requests in model execution.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
                'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
                'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
                f'vllm:{kv}{{engine="0",model_name="m"}} 0.25\n'
                'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0\n'
            )
            if self.mode == "no_metrics":
                text = "# nothing\n"
            return PlainTextResponse(text)

        @self.app.get("/health")
        async def health() -> Response:
            return Response(status_code=503 if self.mode == "error500" else 200)


class FakeSGLangServer(_FakeServer):
    """SGLang's native `/generate` wire format. Modes: ok, wait_abort (the request runs
    until `/abort_request` names its rid, then returns its 3 tokens so far with finish
    type "abort"), hang (ignores aborts; only a disconnect ends it), mismatch
    (logprob ids differ from output_ids), error500."""

    def __init__(self) -> None:
        super().__init__()
        self.aborts: list[str] = []
        self._abort_events: dict[str, asyncio.Event] = {}

        @self.app.post("/generate")
        async def generate(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            if self.mode == "error500":
                return JSONResponse({"error": "boom"}, 500)
            if self.mode == "hang":
                return await self._hang_until_disconnect(request)
            prompt = body["input_ids"]
            params = body["sampling_params"]
            n, finish = params["max_new_tokens"], "length"
            if self.mode == "wait_abort":
                event = self._abort_events.setdefault(body["rid"], asyncio.Event())
                await event.wait()
                n, finish = 3, "abort"
            ids, lps = _outputs(prompt, n)
            entries = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
            if self.mode == "mismatch":
                entries[0][1] = -1
            meta: dict[str, Any] = {
                "id": body["rid"], "prompt_tokens": len(prompt), "completion_tokens": n,
                "cached_tokens": 8, "finish_reason": {"type": finish}, "e2e_latency": 0.5,
            }
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = entries
            return JSONResponse({"text": "", "output_ids": ids, "meta_info": meta})

        @self.app.post("/abort_request")
        async def abort(request: Request) -> Response:
            rid = (await request.json())["rid"]
            self.aborts.append(rid)
            self._abort_events.setdefault(rid, asyncio.Event()).set()
            return Response(status_code=200)

        @self.app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(
                "# TYPE sglang:num_running_reqs gauge\n"
                'sglang:num_running_reqs{model_name="m",tp_rank="0"} 7.0\n'
                'sglang:num_queue_reqs{model_name="m",tp_rank="0"} 1.0\n'
                'sglang:token_usage{model_name="m",tp_rank="0"} 0.5\n')

        @self.app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)
