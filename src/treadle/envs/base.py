"""Suites and episodes: what a task is, which tools it offers, how it is scored.

    suite = get_suite("math")
    task = suite.tasks(1, seed=0)[0]
    async with open_episode(suite, task, BwrapBackend()) as ep:
        specs = ep.tool_specs                       # for the chat template
        result = await ep.call("python", {"code": "print(6*7)"})
        await ep.call("submit_answer", {"answer": "42"})
        reward = await ep.score()                   # RewardResult

A `Suite` owns a task format (JSONL records, `task_from_record`), a generator
(`tasks(n, seed)`: deterministic, seeded), the tool set of a task, an optional
setup (files put in the sandbox) and the reward function. An `Episode` binds one
task to one sandbox for one trajectory and records every tool call.

Contracts:

- `tasks(n, seed)` returns the same tasks for the same (n, seed) in every process,
  and `tasks(n, seed)` is a prefix of `tasks(n + 1, seed)`.
- `task_to_record(task_from_record(r))` round-trips a record (the id included).
- `Episode.call` never raises for what the model did (an unknown tool, arguments
  that are not JSON, a call after the episode ended: error observations). It
  raises for infrastructure failures (see `treadle.envs.tools.base`).
- `Episode.score` raises for infrastructure failures and never invents a reward
  for them; a wrong, missing or unparsable answer is a low reward.
- A task's hidden data (answers, tests) lives in `Task.metadata`, which the agent
  loop must not show the model; `Task.prompt` is what the model sees.
"""

from __future__ import annotations

import collections
import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from treadle.envs.errors import EnvConfigError, TaskFormatError
from treadle.envs.records import read_jsonl, write_jsonl
from treadle.envs.tools.base import Tool, ToolContext, ToolRecord, ToolReplay, ToolResult
from treadle.sandbox.base import Limits, Sandbox, SandboxBackend
from treadle.sandbox.pool import SandboxPool
from treadle.types import Task, ToolCall


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A score with its parts. `reward` is what the trainer uses."""

    reward: float  # each suite documents its range; the built-in ones are in [0, 1]
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. exact_match, f1, passed
    detail: str = ""  # one line for humans: why this score


class Suite(ABC):
    """A family of tasks with their tools and reward. See the module docstring."""

    name: ClassVar[str] = ""  # registry name; also Task.suite
    # Constructor options that name a file on the host (the service checks them
    # against its data roots before the suite may open anything).
    file_options: ClassVar[tuple[str, ...]] = ()
    # Default limits for the sandbox of one episode; callers may use their own.
    limits: Limits = Limits(cpu_s=10, memory_mb=512, wall_timeout_s=30)

    def needs_sandbox(self, task: Task) -> bool:
        """Whether an episode of `task` must be given a sandbox (default: yes)."""
        return True

    def host_paths(self, task: Task) -> tuple[str, ...]:
        """Host paths `task` names that treadle will read for it (an environment image);
        a service refuses a task whose paths lie outside its data roots. Default: none."""
        return ()

    def sandbox_backend(self, task: Task, backend: SandboxBackend) -> SandboxBackend:
        """The backend `open_episode` starts `task`'s sandbox from, given the caller's
        (default: that one). A suite whose tasks run in their own environment image
        returns one on the task's image; EnvConfigError if `backend` cannot run it."""
        return backend

    @abstractmethod
    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        """`n` bundled or generated tasks (None: the whole bundle, where there is one)."""

    @abstractmethod
    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        """A task from one JSONL record; TaskFormatError naming the bad field."""

    def task_to_record(self, task: Task) -> dict[str, Any]:
        """The JSONL record of `task` (inverse of `task_from_record`)."""
        return {"id": task.task_id, **task.metadata}

    def load_tasks(self, path: str | Path) -> list[Task]:
        """Tasks from a JSONL file; TaskFormatError with path and line on any bad record."""
        tasks: list[Task] = []
        seen: set[str] = set()
        for number, record in read_jsonl(path):
            try:
                task = self.task_from_record(record)
            except TaskFormatError as e:
                raise TaskFormatError(f"{path}:{number}: {e}") from None
            if task.task_id in seen:
                raise TaskFormatError(f"{path}:{number}: duplicate id {task.task_id!r}")
            seen.add(task.task_id)
            tasks.append(task)
        return tasks

    def save_tasks(self, path: str | Path, tasks: list[Task]) -> None:
        """Write `tasks` as JSONL records that `load_tasks` reads back unchanged."""
        write_jsonl(path, [self.task_to_record(t) for t in tasks])

    def initial_files(self, task: Task) -> Mapping[str, str] | None:
        """The files (path -> text) an episode of `task` starts with in its sandbox:
        the base of the diff a rubric's judges see (`envs.worktree`). None (the
        default): the suite has no work tree to show."""
        return None

    @abstractmethod
    def tools(self, task: Task) -> list[Tool]:
        """The tools the model may call in an episode of `task`."""

    async def setup(self, ctx: ToolContext) -> str | None:
        """Prepare an episode (files into the sandbox, a remote session); may return an
        initial observation to show the model after the prompt. Default: nothing."""
        return None

    @abstractmethod
    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        """Score the episode. `final_message` is the model's last assistant text."""

    async def teardown(self, ctx: ToolContext) -> None:  # noqa: B027 - optional hook
        """Release what `setup` acquired outside the sandbox. Default: nothing."""

    def episode(self, task: Task, sandbox: Sandbox | None = None) -> Episode:
        """A new episode of `task` in `sandbox` (which the caller owns and closes)."""
        if sandbox is None and self.needs_sandbox(task):
            raise EnvConfigError(f"suite {self.name!r} needs a sandbox for task "
                                 f"{task.task_id!r}")
        return Episode(self, task, sandbox)

    def _task(self, task_id: str, prompt: str, metadata: dict[str, Any]) -> Task:
        return Task(task_id=task_id, prompt=prompt, suite=self.name, metadata=metadata)


class Episode:
    """One trajectory's view of a task: its tools, its calls, its score."""

    def __init__(self, suite: Suite, task: Task, sandbox: Sandbox | None) -> None:
        self.suite = suite
        self.ctx = ToolContext(task=task, sandbox=sandbox)
        self.tools: dict[str, Tool] = {}
        for tool in suite.tools(task):
            if tool.name in self.tools:
                raise EnvConfigError(f"suite {suite.name!r} offers two tools named {tool.name!r}")
            self.tools[tool.name] = tool
        self.initial_observation: str | None = None
        self._replays: collections.deque[ToolRecord] = collections.deque()  # (`replay`)
        self._started = False
        self._closed = False

    @property
    def task(self) -> Task:
        return self.ctx.task

    @property
    def tool_specs(self) -> list[dict[str, Any]]:
        """Function specs of the episode's tools, in the suite's order."""
        return [tool.spec for tool in self.tools.values()]

    @property
    def done(self) -> bool:
        """True once a call ended the episode (an answer submitted, an env terminated)."""
        return self.ctx.done

    @property
    def final_answer(self) -> str | None:
        return self.ctx.final_answer

    @property
    def history(self) -> list[ToolRecord]:
        return self.ctx.history

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls so far as trajectory records (`treadle.types.ToolCall`)."""
        return [r.result.to_tool_call(r.name, r.arguments) for r in self.ctx.history]

    async def start(self) -> str | None:
        """Run the suite's setup once; returns (and keeps) the initial observation."""
        if not self._started:
            self._started = True
            self.initial_observation = await self.suite.setup(self.ctx)
        return self.initial_observation

    def replay_of(self, name: str) -> ToolReplay:
        """How a resume brings back a call of the tool `name` (`Tool.replay`); a name
        the episode has no tool by was an error observation: nothing to bring back."""
        tool = self.tools.get(name)
        return ToolReplay.NONE if tool is None else tool.replay

    def replay(self, calls: Sequence[ToolRecord]) -> None:
        """The next `len(calls)` calls are a resumed trajectory's recorded ones
        (`treadle.agent.journal`), in order: each answers its recorded result, after
        running again, its new result dropped, where its tool is declared
        `ToolReplay.RERUN` (to rebuild what it left in the sandbox or the state)."""
        self._replays.extend(calls)

    async def call(self, name: str, arguments: Mapping[str, Any] | str) -> ToolResult:
        """Run one tool call as the model wrote it (arguments as a dict or a JSON string).
        A call that `replay` announced answers its recorded result; EnvConfigError if
        it is not the call recorded (the journal and the reply disagree)."""
        if not self._started:
            await self.start()
        parsed, problem = _parse_arguments(arguments)
        if self._replays:
            return await self._replayed(name, parsed, problem is None)
        if self.ctx.done:
            result = ToolResult(error="the episode is over; no more tool calls are accepted")
        elif name not in self.tools:
            available = ", ".join(self.tools) or "none"
            result = ToolResult(error=f"unknown tool {name!r}; available tools: {available}")
        elif problem is not None:
            result = ToolResult(error=problem)
        else:
            result = await self.tools[name].call(parsed, self.ctx)
        self.ctx.history.append(ToolRecord(f"call_{len(self.ctx.history)}", name, parsed, result))
        if result.final_answer is not None:
            self.ctx.final_answer = result.final_answer
        if result.done:
            self.ctx.done = True
        return result

    async def _replayed(self, name: str, arguments: dict[str, Any], valid: bool) -> ToolResult:
        recorded = self._replays.popleft()
        if (recorded.name, recorded.arguments) != (name, arguments):
            raise EnvConfigError(f"resume: call {len(self.ctx.history)} is {name!r}, the "
                                 f"journal recorded {recorded.name!r} with other arguments")
        tool = self.tools.get(name)
        if valid and tool is not None and tool.replay is ToolReplay.RERUN:
            await tool.call(arguments, self.ctx)
        result = recorded.result
        self.ctx.history.append(ToolRecord(f"call_{len(self.ctx.history)}", name, arguments,
                                           result))
        if result.final_answer is not None:
            self.ctx.final_answer = result.final_answer
        self.ctx.done = self.ctx.done or result.done
        return result

    async def score(self, final_message: str | None = None) -> RewardResult:
        """The suite's reward for the episode so far (run setup first if it never ran)."""
        if not self._started:
            await self.start()
        return await self.suite.reward(self.ctx, final_message)

    async def close(self) -> None:
        """Release what the suite's setup acquired outside the sandbox (idempotent)."""
        if self._started and not self._closed:
            self._closed = True
            await self.suite.teardown(self.ctx)


def _parse_arguments(arguments: Mapping[str, Any] | str) -> tuple[dict[str, Any], str | None]:
    """(arguments as a dict, None) or ({"_raw": text}, why they are unusable)."""
    if isinstance(arguments, Mapping):
        return dict(arguments), None
    if not isinstance(arguments, str):
        return {"_raw": repr(arguments)}, "arguments must be a JSON object"
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as e:
        return {"_raw": arguments}, f"arguments are not valid JSON: {e.msg} at position {e.pos}"
    if not isinstance(parsed, dict):
        return {"_raw": arguments}, "arguments must be a JSON object"
    return parsed, None


@contextlib.asynccontextmanager
async def open_episode(
    suite: Suite,
    task: Task,
    sandboxes: SandboxBackend | SandboxPool | None = None,
    *,
    limits: Limits | None = None,
) -> AsyncIterator[Episode]:
    """A started episode of `task`, with a fresh sandbox when the suite needs one.

    `sandboxes` is a backend (a sandbox is started from `suite.sandbox_backend(task,
    sandboxes)` with `limits` or the suite's limits, and closed afterwards) or a pool
    (one is borrowed and returned; EnvConfigError unless the pool's backend is the
    one `suite.sandbox_backend` picks for the task). The
    episode is closed and the sandbox released on exit, whatever happened.
    """
    if not suite.needs_sandbox(task):
        sandboxes = None
    elif sandboxes is None:
        raise EnvConfigError(f"suite {suite.name!r} needs a sandbox backend or pool")
    async with contextlib.AsyncExitStack() as stack:
        sandbox: Sandbox | None = None
        if isinstance(sandboxes, SandboxPool):
            if suite.sandbox_backend(task, sandboxes.backend) is not sandboxes.backend:
                raise EnvConfigError(f"task {task.task_id!r} of suite {suite.name!r} runs on "
                                     "a backend of its own (its image): give a backend, or a "
                                     "pool over `suite.sandbox_backend(task, backend)`")
            sandbox = await stack.enter_async_context(sandboxes.sandbox())
        elif sandboxes is not None:
            backend = suite.sandbox_backend(task, sandboxes)
            sandbox = await backend.start(limits or suite.limits)
            stack.push_async_callback(sandbox.close)
        episode = suite.episode(task, sandbox)
        stack.push_async_callback(episode.close)
        await episode.start()
        yield episode
