"""Judge lanes: where a rubric's judge calls go (`treadle.rewards.JudgeLane`).

- `EngineLane`: a runtime's engines — the policy's own (the model judging with its
  current weights) or the frozen pool's (a pinned version). Each call is a one-turn
  trajectory of the scheduler's judge class (`Runtime.turns(..., judge=True)`): it
  is ranked after every rollout turn, so it fills the gaps rollouts leave, and a
  policy that preempts pauses it first. Its reply is decoded under the verdict's
  JSON schema (structured output). The prompt is one user message in the
  runtime's chat format; the reply's ids and logprobs are the engine's. It gives no
  top logprobs (the engines' token-level API returns the sampled token's only), so
  a logprob verdict needs an `EndpointLane`. It also runs agentic judges
  (`ask_agent`: `runtime.agent_judges`) in sandboxes of the pool it is given.
- `EndpointLane`: an OpenAI-compatible chat endpoint elsewhere (``/chat/completions``
  under its base URL), the same spec, so a team can start external and move the
  judge onto its engines. The reply is asked in the verdict's JSON schema
  (``response_format``); top logprobs come as the endpoint writes the tokens
  (text); it returns no ids. It runs no agentic judge (treadle's agent loop is
  token-level: it needs the engines).

Both raise `JudgeCallError` for a call that fails (engine errors, no engine, an
unreachable endpoint, an error status, a reply off the OpenAI shape).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import httpx

from treadle.agent.chat import Message, chat_format
from treadle.agent.runner import Sampling
from treadle.agent.tokenizer import Tokenizer
from treadle.engines.base import derived_seed
from treadle.engines.errors import EngineError
from treadle.rewards import AgentSpec, JudgeCallError, JudgeReply
from treadle.runtime.agent_judges import run_agent_judge
from treadle.runtime.driver import Runtime
from treadle.sandbox.pool import SandboxPool
from treadle.types import JsonSchemaConstraint


class EngineLane:
    """Judge calls on a runtime's engines, as the judge class (module docstring)."""

    def __init__(self, runtime: Runtime, tokenizer: Tokenizer, *, pool: str,
                 chat: str, max_tokens: int = 256, temperature: float = 0.0,
                 seed: int | None = 0, sandboxes: SandboxPool | None = None) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.pool = pool  # policy | frozen: named in its identity
        self.sandboxes = sandboxes  # where agentic judges run (None: none do)
        self.chat = chat
        self.format = chat_format(chat)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self._stop = tokenizer.token_id(self.format.stop_token)

    @property
    def identity(self) -> str:
        # The policy version is part of it: a new policy's verdicts are not the old's.
        return (f"{self.pool} engines, policy version {self.runtime.policy_version}, "
                f"{self.format.name}, max_tokens {self.max_tokens}, "
                f"temperature {self.temperature}, seed {self.seed}")

    def prompt_ids(self, prompt: str) -> list[int]:
        """The judge's context: `prompt` as one user message, generation prompt on."""
        return self.tokenizer.encode(self.format.prompt([Message("user", prompt)], []))

    async def ask(self, prompt: str, *, call_id: str, top_logprobs: int,
                  schema: Mapping[str, Any]) -> JudgeReply:
        ids = self.prompt_ids(prompt)
        turns = self.runtime.turns(call_id, call_id, judge=True)
        seed = None if self.seed is None else derived_seed(self.seed, call_id)
        try:
            out = await turns.generate(ids, self.max_tokens,
                                       Sampling(self.temperature, seed=seed,
                                                constraint=JsonSchemaConstraint(
                                                    schema, "verdict")), [self._stop])
            turns.turn_finished(len(out.output_ids), len(ids) + len(out.output_ids),
                                final=True)
        except EngineError as e:
            raise JudgeCallError(f"{self.pool} engines: {type(e).__name__}: {e}") from e
        finally:
            turns.ended("judge call ended")
        said = [i for i in out.output_ids if i != self._stop]
        return JudgeReply(text=self.tokenizer.decode(said),
                          tokens=[self.tokenizer.decode([i]) for i in said],
                          output_ids=list(out.output_ids), logprobs=list(out.logprobs))


    async def ask_agent(self, prompt: str, *, call_id: str, spec: AgentSpec,
                        files: Mapping[str, str],
                        read: Callable[[str], float]) -> JudgeReply:
        """An agentic judgement on these engines (`runtime.agent_judges`)."""
        seed = None if self.seed is None else derived_seed(self.seed, call_id)
        return await run_agent_judge(self.runtime, self.tokenizer, self.sandboxes, prompt,
                                     call_id=call_id, spec=spec, files=files, read=read,
                                     chat=self.chat, max_tokens=self.max_tokens,
                                     temperature=self.temperature, seed=seed)


class EndpointLane:
    """Judge calls to an OpenAI-compatible endpoint (module docstring). `timeout_s`:
    real seconds per HTTP call."""

    def __init__(self, base_url: str, model: str, *, max_tokens: int = 256,
                 temperature: float = 0.0, seed: int | None = 0, api_key: str | None = None,
                 timeout_s: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self.api_key = api_key
        self.timeout_s = timeout_s

    @property
    def identity(self) -> str:
        return (f"endpoint {self.base_url} model {self.model}, max_tokens {self.max_tokens}, "
                f"temperature {self.temperature}, seed {self.seed}")

    def body(self, prompt: str, call_id: str, top_logprobs: int,
             schema: Mapping[str, Any]) -> dict[str, Any]:
        """The chat completion request of one call."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens,
                                "messages": [{"role": "user", "content": prompt}],
                                "temperature": self.temperature,
                                "response_format": {"type": "json_schema", "json_schema": {
                                    "name": "verdict", "schema": dict(schema)}}}
        if self.seed is not None:
            body["seed"] = derived_seed(self.seed, call_id)
        if top_logprobs:
            body.update(logprobs=True, top_logprobs=top_logprobs)
        return body

    async def ask(self, prompt: str, *, call_id: str, top_logprobs: int,
                  schema: Mapping[str, Any]) -> JudgeReply:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                reply = await client.post(f"{self.base_url}/chat/completions", headers=headers,
                                          json=self.body(prompt, call_id, top_logprobs,
                                                         schema))
        except httpx.HTTPError as e:
            raise JudgeCallError(f"{self.base_url}: {type(e).__name__}: {e}") from e
        if reply.status_code != 200:
            raise JudgeCallError(f"{self.base_url}: HTTP {reply.status_code}: "
                                 f"{reply.text[:300]}")
        try:
            return _read(reply.json(), top_logprobs)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise JudgeCallError(f"{self.base_url}: a reply off the chat completion shape: "
                                 f"{type(e).__name__}: {e}") from e


def _read(data: Any, top_logprobs: int) -> JudgeReply:
    choice = data["choices"][0]
    text = choice["message"]["content"]
    if not isinstance(text, str):
        raise TypeError("choices[0].message.content is not a string")
    if not top_logprobs:
        return JudgeReply(text=text)
    content = choice["logprobs"]["content"]
    tokens = [str(item["token"]) for item in content]
    top = [{str(alt["token"]): float(alt["logprob"]) for alt in item["top_logprobs"]}
           for item in content]
    return JudgeReply(text=text, tokens=tokens, top=top)
