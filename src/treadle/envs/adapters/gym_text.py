"""An adapter for gymnasium-style text environments: reset/step as a suite with one tool.

Any object with the gymnasium signatures, with text observations and actions,
works (gymnasium itself is not needed)::

    reset(*, seed=None, options=None) -> (observation: str, info: dict)
    step(action: str) -> (observation: str, reward: float, terminated: bool,
                          truncated: bool, info: dict)
    close() -> None   # optional

`GymTextSuite(make_env)` calls `make_env()` once per episode. `setup` resets the
env with the task's seed and options and returns the first observation (the agent
loop shows it after the prompt). The model acts through one tool (default name
``act``, argument ``action``): each call is one `step`; the observation is the
tool output, and the step reward is added to the episode return. When the env
reports terminated or truncated, the call's result has ``done=True`` and later
calls are refused. The suite's reward is the return (sum of step rewards), with
``terminated``, ``truncated`` and ``steps`` as metrics; its range is the env's.

Env code runs in a worker thread (`asyncio.to_thread`), so a slow or blocking env
never stalls other trajectories; one episode's calls are sequential, so the env
need not be thread-safe. An exception raised by the env is an infrastructure
failure and propagates (it is not the model's doing); a `ValueError` from `step`
is taken as an invalid action and shown to the model.

Task format::

    {"id": "ep-1", "seed": 7, "options": {"level": 2}, "instructions": "optional text"}

``seed`` (integer, optional) and ``options`` (object, optional) go to `reset`;
``instructions`` (optional) replaces the suite's default prompt text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from treadle.envs.base import RewardResult, Suite
from treadle.envs.errors import TaskFormatError
from treadle.envs.records import check_keys, opt_str, req_str, rng_for
from treadle.envs.tools.base import Tool, ToolContext, ToolInputError, ToolReplay, ToolResult
from treadle.types import Task

_ENV = "gym_text.env"
_RETURN = "gym_text.return"
_STEPS = "gym_text.steps"
_FLAGS = "gym_text.flags"


class TextEnv(Protocol):
    """The gymnasium methods the adapter calls (observations and actions are text)."""

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...


class ActTool(Tool):
    """One `step` of the episode's env."""

    # Resumed: the env is reset with the task's seed and stepped again with the same
    # actions (an env whose steps follow from its seed and actions, as Gymnasium's do).
    replay = ToolReplay.RERUN

    def __init__(self, name: str, description: str) -> None:
        self._name = name
        self._description = description

    @property
    def name(self) -> str:
        return self._name

    @property
    def description(self) -> str:
        return self._description

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"action": {"type": "string", "description": "your action"}},
                "required": ["action"], "additionalProperties": False}

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        env: TextEnv = ctx.state[_ENV]
        try:
            observation, reward, terminated, truncated, _info = await asyncio.to_thread(
                env.step, arguments["action"])
        except ValueError as e:  # gymnasium envs signal an invalid action this way
            raise ToolInputError(f"invalid action: {e}") from None
        ctx.state[_RETURN] += float(reward)
        ctx.state[_STEPS] += 1
        ctx.state[_FLAGS] = (bool(terminated), bool(truncated))
        done = bool(terminated or truncated)
        return ToolResult(output=str(observation), done=done)


class GymTextSuite(Suite):
    """Episodes of a gymnasium-style text env; see the module docstring."""

    name = "gym_text"

    def __init__(self, make_env: Callable[[], TextEnv], *,
                 instructions: str = "Interact with the environment by calling the `act` tool "
                                     "with your action. Its observations tell you what "
                                     "happened. Keep acting until the episode ends.",
                 tool_name: str = "act",
                 tool_description: str = "Take one action in the environment and see the "
                                         "resulting observation.") -> None:
        self.make_env = make_env
        self.instructions = instructions
        self.tool_name = tool_name
        self.tool_description = tool_description

    def needs_sandbox(self, task: Task) -> bool:
        return False

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        """`n` (default 10) episodes with reset seeds drawn from `seed`."""
        count = 10 if n is None else n
        rng = rng_for(self.name, seed)
        return [self.task_from_record({"id": f"gym-{seed}-{i:05d}",
                                       "seed": rng.randrange(2**31)}) for i in range(count)]

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        check_keys(record, {"seed", "options", "instructions"})
        task_id = req_str(record, "id")
        seed = record.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TaskFormatError("field 'seed' must be an integer")
        options = record.get("options")
        if options is not None and not isinstance(options, dict):
            raise TaskFormatError("field 'options' must be an object")
        metadata: dict[str, Any] = {k: record[k] for k in ("seed", "options", "instructions")
                                    if record.get(k) is not None}
        prompt = opt_str(record, "instructions") or self.instructions
        return self._task(task_id, prompt, metadata)

    def tools(self, task: Task) -> list[Tool]:
        return [ActTool(self.tool_name, self.tool_description)]

    async def setup(self, ctx: ToolContext) -> str | None:
        env = await asyncio.to_thread(self.make_env)
        ctx.state.update({_ENV: env, _RETURN: 0.0, _STEPS: 0, _FLAGS: (False, False)})
        meta = ctx.task.metadata
        observation, _info = await asyncio.to_thread(
            lambda: env.reset(seed=meta.get("seed"), options=meta.get("options")))
        return str(observation)

    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        terminated, truncated = ctx.state[_FLAGS]
        return RewardResult(float(ctx.state[_RETURN]),
                            {"terminated": float(terminated), "truncated": float(truncated),
                             "steps": float(ctx.state[_STEPS])},
                            f"return over {ctx.state[_STEPS]} step(s)")

    async def teardown(self, ctx: ToolContext) -> None:
        env = ctx.state.pop(_ENV, None)
        close = getattr(env, "close", None)
        if callable(close):
            await asyncio.to_thread(close)
