"""Planning a job: its trajectories, each with what to run for it.

`Planner.resolve` turns a `JobRequest` into `Work`, one type per kind of work,
each with its trajectory's id, GRPO group and repetition (`PlannedTrajectory`):

==============  ===============================================================
`SuiteWork`     a suite task run by treadle's agent loop, in the job's chat
                format, with the job's sampling and limits
`HarnessWork`   a suite task run by a harness command through the gateway,
                scored as the job says (`gateway.harness.judge`)
`ReplayWork`    a workload's trajectory script replayed on the engines
==============  ===============================================================

What cannot run here is refused with `RequestRefused` naming the field: an unknown
suite or options its constructor refuses, an unknown chat format, a file outside
the data roots, suite tasks without a tokenizer or a sandbox, more trajectories
than a job may plan, a trace line past the served model's window. Suites are
built once per (name, options) and kept.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from treadle.agent.chat import DEFAULT_FORMAT, chat_format
from treadle.agent.loop import AgentLimits
from treadle.agent.runner import Sampling
from treadle.agent.tokenizer import Tokenizer
from treadle.envs.base import Suite
from treadle.envs.registry import file_options, get_suite
from treadle.errors import TreadleError
from treadle.gateway.harness import Score
from treadle.sandbox.base import SandboxBackend
from treadle.service.errors import RequestRefused
from treadle.service.files import check_under_roots, held_file
from treadle.service.rubric_schemas import RubricParams
from treadle.service.schemas import (
    MAX_TRAJECTORIES_PER_JOB,
    JobRequest,
    ReplayTasks,
    SessionTasks,
    SuiteTasks,
)
from treadle.store.jobs import PlannedTrajectory
from treadle.types import KVAcrossUpdates, Task
from treadle.workloads import TrajectorySpec
from treadle.workloads.load import generate_named
from treadle.workloads.trace import TraceError, spec_from_record

log = logging.getLogger(__name__)
_SUITES_KEPT = 64  # suites built for jobs, kept for the next job with the same options


@dataclass(frozen=True, slots=True)
class SuiteWork:
    """A suite task run by treadle's agent loop."""

    job_id: str
    planned: PlannedTrajectory
    task: Task
    suite: Suite
    sampling: Sampling
    limits: AgentLimits
    chat_format: str  # the model family's format (`agent.chat`), checked when planned
    kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE  # the job's KV across weight updates
    rubric: RubricParams | None = None  # the job's rubric (`service.judging`)
    max_staleness: int | None = None  # a continuous job's bound, for the scheduler


@dataclass(frozen=True, slots=True)
class HarnessWork:
    """A suite task run by a harness command through the gateway."""

    job_id: str
    planned: PlannedTrajectory
    task: Task
    suite: Suite  # its tools are shown to the harness; its reward may score the run
    sampling: Sampling
    limits: AgentLimits  # the session's (no deadline: the harness's timeout is its limit)
    chat_format: str
    harness: str  # the harness command's name (`treadle serve --harness`)
    score: Score  # how the run is scored (`gateway.harness.judge`)
    kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE
    rubric: RubricParams | None = None  # the job's rubric, on top of `score`
    max_staleness: int | None = None  # a continuous job's bound, for the scheduler


@dataclass(frozen=True, slots=True)
class ReplayWork:
    """A workload trajectory's script, replayed on the engines (no tokens, no reward)."""

    job_id: str
    planned: PlannedTrajectory
    spec: TrajectorySpec
    kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE
    max_staleness: int | None = None  # a continuous job's bound, for the scheduler


Work = SuiteWork | HarnessWork | ReplayWork  # one planned trajectory, what to run for it


class Planner:
    """Resolves jobs for one service; see the module docstring."""

    def __init__(self, *, tokenizer: Tokenizer | None, sandbox_backend: SandboxBackend | None,
                 max_context: int, data_roots: Sequence[str] = (),
                 max_data_file_bytes: int = 256 << 20, harnesses: Sequence[str] = (),
                 chat_format: str = DEFAULT_FORMAT) -> None:
        self.tokenizer = tokenizer  # None: replay tasks only
        self.chat_format = chat_format  # the served model's, for jobs that name none
        self.sandbox_backend = sandbox_backend  # None: no suite that needs a sandbox
        self.max_context = max_context  # tokens a replayed trajectory may reach
        self.data_roots = tuple(data_roots)  # where files named by suite options may be
        self.max_data_file_bytes = max_data_file_bytes  # the largest such file
        self.harnesses = frozenset(harnesses)  # the harness commands jobs may name
        # Suites by name and options (files by their content's identity), the most
        # recently used last; at most _SUITES_KEPT.
        self._suites: collections.OrderedDict[str, Suite] = collections.OrderedDict()

    def check_rubric(self, request: JobRequest) -> None:
        """RequestRefused where the job's rubric cannot be judged here: an agentic
        judge (`rewards.AgentSpec`) on a service without sandboxes."""
        rubric = request.rubric
        if rubric is not None and self.sandbox_backend is None and any(
                j.agent is not None for j in rubric.judged):
            raise RequestRefused("rubric.judged: an agentic judge works in a sandbox and this "
                                 "service has none (treadle serve --sandbox)")

    def resolve(self, job_id: str, request: JobRequest) -> list[Work]:
        """The job's trajectories, each with what to run for it; RequestRefused
        naming the field for what cannot run here. Blocking (a suite's tasks, a
        big trace): call it off the event loop."""
        sampling = Sampling(request.sampling.temperature, request.sampling.top_p,
                            request.sampling.seed)
        lim = request.limits
        limits = AgentLimits(lim.max_turns, lim.max_total_tokens, lim.max_tokens_per_turn,
                             lim.deadline_s)
        tasks = request.tasks
        kv = KVAcrossUpdates(request.kv_across_updates)
        bound = request.continuous.max_staleness if request.continuous is not None else None
        out: list[Work] = []
        if isinstance(tasks, ReplayTasks):
            members: dict[str, int] = {}
            for spec in _replay_specs(tasks, self.max_context):
                repetition = members.get(spec.group_id, 0)  # order within its group
                members[spec.group_id] = repetition + 1
                planned = PlannedTrajectory(f"{job_id}/{spec.traj_id}",
                                            f"{job_id}/{spec.group_id}", spec.group_id,
                                            repetition)
                out.append(ReplayWork(job_id, planned, spec, kv, bound))
            return out
        if isinstance(tasks, SessionTasks):
            raise RequestRefused("tasks.sessions: sessions are made by harnesses, not run "
                                 "here (planned_sessions plans them)")
        n_tasks = tasks.count if tasks.count is not None else len(tasks.tasks or [])
        if n_tasks * request.samples_per_task > MAX_TRAJECTORIES_PER_JOB:
            raise RequestRefused(f"samples_per_task: {n_tasks} tasks x "
                                 f"{request.samples_per_task} samples is over the "
                                 f"{MAX_TRAJECTORIES_PER_JOB} trajectories a job may plan")
        if self.tokenizer is None:
            raise RequestRefused("tasks.suite: this service has no tokenizer for its model "
                                 "(start it with --tokenizer), so it can run replay tasks only")
        harness = request.harness
        if harness is not None and harness.name not in self.harnesses:
            known = ", ".join(sorted(self.harnesses)) or "none (treadle serve --harness)"
            raise RequestRefused(f"harness.name: no harness {harness.name!r} here; it has {known}")
        if harness is not None and request.limits.deadline_s is not None:
            raise RequestRefused("limits.deadline_s: a harness run's time limit is the "
                                 "harness's own (treadle serve --harness-timeout)")
        fmt = request.chat_format or self.chat_format
        try:
            chat_format(fmt)
        except ValueError as e:
            raise RequestRefused(f"chat_format: {e}") from None
        key, suite = self._suite(tasks)
        planned_tasks = _suite_tasks(suite, tasks)
        for task in planned_tasks:
            for path in suite.host_paths(task):
                check_under_roots(path, self.data_roots, f"tasks: task {task.task_id!r}")
        if self.sandbox_backend is None and any(suite.needs_sandbox(t) for t in planned_tasks):
            raise RequestRefused(f"tasks.suite: suite {tasks.suite!r} needs a sandbox and this "
                                 "service has none")
        for task in planned_tasks:
            for r in range(request.samples_per_task):
                planned = PlannedTrajectory(f"{job_id}/{task.task_id}/{r}",
                                            f"{job_id}/{task.task_id}", task.task_id, r)
                out.append(SuiteWork(job_id, planned, task, suite, sampling, limits, fmt, kv,
                                     request.rubric, bound)
                           if harness is None else
                           HarnessWork(job_id, planned, task, suite, sampling, limits, fmt,
                                       harness.name, harness.score, kv, request.rubric,
                                       bound))
        self._keep(key, suite)  # only a suite a job could be planned with
        return out

    def _suite(self, tasks: SuiteTasks) -> tuple[str, Suite]:
        """The suite of `tasks` and its cache key (name, options, the identity of
        every file an option names), built if it is not kept."""
        try:
            named_files = file_options(tasks.suite)
        except TreadleError as e:
            raise RequestRefused(f"tasks.suite: {e}") from None
        options = dict(tasks.options)
        shown: dict[str, str] = {}  # what the suite is given -> what the job named
        with contextlib.ExitStack() as held:
            identity = dict(options)
            for name in named_files:
                if name in options:
                    file = held.enter_context(held_file(
                        options[name], self.data_roots, self.max_data_file_bytes,
                        f"tasks.options.{name}"))
                    shown[file.path] = str(options[name])
                    options[name], identity[name] = file.path, file.identity
            key = json.dumps([tasks.suite, identity], sort_keys=True, default=repr)
            suite = self._suites.get(key)
            if suite is not None:
                self._suites.move_to_end(key)
                return key, suite
            try:
                return key, get_suite(tasks.suite, **options)
            # A suite's constructor is the suite's code: whatever it says of its options,
            # even by way of an exception it did not mean, is the request's to fix and
            # never a 500.
            except Exception as e:
                if not isinstance(e, TreadleError | ValueError | TypeError | OSError):
                    log.warning("suite %r raised %s for its options", tasks.suite,
                                type(e).__name__, exc_info=True)
                message = str(e)
                for given, named in shown.items():
                    message = message.replace(given, named)
                raise RequestRefused(f"tasks.options: suite {tasks.suite!r}: "
                                     f"{type(e).__name__}: {message}") from None

    def _keep(self, key: str, suite: Suite) -> None:
        self._suites[key] = suite
        self._suites.move_to_end(key)
        while len(self._suites) > _SUITES_KEPT:
            self._suites.popitem(last=False)



def planned_sessions(job_id: str, tasks: SessionTasks,
                     samples: int) -> list[PlannedTrajectory]:
    """A sessions job's plan: `samples` sessions of every group, group by group."""
    groups = tasks.group_ids
    if len(groups) * samples > MAX_TRAJECTORIES_PER_JOB:
        raise RequestRefused(f"samples_per_task: {len(groups)} groups x {samples} sessions is "
                             f"over the {MAX_TRAJECTORIES_PER_JOB} trajectories a job may plan")
    return [PlannedTrajectory(f"{job_id}/{g}/{r}", f"{job_id}/{g}", g, r)
            for g in groups for r in range(samples)]


def _suite_tasks(suite: Suite, tasks: SuiteTasks) -> list[Task]:
    if tasks.count is not None:
        try:
            return suite.tasks(tasks.count, seed=tasks.seed)
        except Exception as e:  # more than a bundled suite holds, a suite without tasks
            raise RequestRefused(f"tasks.count: suite {tasks.suite!r}: {e}") from None
    out: list[Task] = []
    seen: set[str] = set()
    for i, record in enumerate(tasks.tasks or []):
        try:
            task = suite.task_from_record(record)
        except Exception as e:  # the suite's reading of a record: the record's fault
            raise RequestRefused(f"tasks.tasks.{i}: {e}") from None
        if task.task_id in seen:
            raise RequestRefused(f"tasks.tasks.{i}: duplicate id {task.task_id!r}")
        seen.add(task.task_id)
        out.append(task)
    return out


def _replay_specs(tasks: ReplayTasks, max_context: int) -> list[TrajectorySpec]:
    if tasks.workload is not None:
        assert tasks.trajectories is not None
        try:
            return list(generate_named(tasks.workload, tasks.trajectories, seed=tasks.seed,
                                 group_size=tasks.group_size,
                                 max_context=max_context).trajectories)
        except ValueError as e:
            raise RequestRefused(f"tasks.trajectories: {e}") from None
    specs = []
    seen: set[str] = set()
    for i, line in enumerate(tasks.trace or []):
        try:
            spec = spec_from_record(line.model_dump(), source="tasks.trace", line=i)
        except TraceError as e:
            raise RequestRefused(f"tasks.trace.{i}{'.' if e.field else ''}{e.field}: "
                                 f"{e.problem}") from None
        if spec.traj_id in seen:
            raise RequestRefused(f"tasks.trace.{i}: duplicate id {spec.traj_id!r}")
        context = spec.context_tokens
        if context > max_context:
            raise RequestRefused(f"tasks.trace.{i}: the trajectory needs {context} tokens of "
                                 f"context, over the served model's {max_context}")
        seen.add(spec.traj_id)
        specs.append(spec)
    return specs


__all__ = ["HarnessWork", "Planner", "ReplayWork", "SuiteWork", "Work", "planned_sessions"]
