"""SkyRL's generator backed by a treadle rollout service: each batch SkyRL asks for is
one treadle job.

    from treadle.client.skyrl_generator import TreadleGenerator

    class TreadleExp(BasePPOExp):                  # skyrl.train.entrypoints.main_base
        def get_generator(self, cfg, tokenizer, inference_engine_client):
            return TreadleGenerator(url, token=token, suite="math",
                                    step_wise=cfg.generator.step_wise_trajectories)

This module imports SkyRL when it is imported (`TreadleGenerator` subclasses SkyRL's
`GeneratorInterface`); it is written against skyrl==0.3.0, the release the extra
``treadle[skyrl]`` pins. The converter it calls, `treadle.client.skyrl.to_skyrl`,
imports no SkyRL.

What one `generate` call does:

1. **Tasks.** SkyRL's GeneratorInput has one row per sample: every prompt repeated
   ``generator.n_samples_per_prompt`` times with the same uid
   (``trajectory_ids[i].instance_id``). Each uid becomes one task of the job: the
   record ``task_of(prompt, env_extras)`` returns for the uid's first row, in the
   format of `suite` (docs/suites.md), with its ``"id"`` set to the uid (a job's task
   ids must be unique, and the uid is how the trajectories find their rows again) and
   its None values dropped (a dataset's struct column gives every row every key). The
   default `task_of` reads ``env_extras["treadle_task"]``: a column ``treadle_task``
   of the SkyRL dataset, whose columns other than the prompt and env_class arrive as
   env_extras. The model sees the suite's prompt for the task, and the suite scores
   it: SkyRL's prompt messages only reach `task_of`, and env_classes are not used.
   Every uid must have the same number of rows: the job's samples_per_task.
2. **Sampling.** The job samples with SkyRL's temperature, top_p and seed (when its
   sampling_params set them) and takes its max_tokens as the per-turn token limit;
   `sampling` and `limits` given here win. SkyRL's other sampling keys (top_k, min_p,
   stop, ...) have no counterpart in a treadle job and are not used.
3. **The job.** It is submitted with the fields of `request` (any JobRequest field
   but tasks, samples_per_task, sampling, limits and job_id, which are this
   generator's; or a function of the GeneratorInput that returns them, e.g. a
   min_policy_version from ``batch_metadata.global_step``), under the id
   ``skyrl-<train|eval>-<global step>-<8 hex>``. Its trajectories are streamed until
   it ends (`AsyncRolloutClient`, which resumes across dropped connections and
   restarts); should the call fail or be cancelled before, the job is cancelled,
   unless the service could not be reached.
4. **The output.** The k-th repetition of a uid is that uid's k-th row: the output
   is in input order and carries SkyRL's own TrajectoryID objects, so its GRPO groups
   are SkyRL's uids (`to_skyrl` with ``trajectory_ids``). Without step-wise training
   (``step_wise=False``) SkyRL needs exactly one row per input row: a trajectory that
   must not train (an infrastructure failure, an abort), one not delivered or one
   with several token segments raises ConversionError, and the step fails rather
   than train on a batch other than the one SkyRL sampled. With ``step_wise=True``
   (it must equal ``generator.step_wise_trajectories``) those trajectories are left
   out (logged as a warning), and a trajectory gives one row per segment.
   rollout_metrics holds SkyRL's ``generate/*`` metrics of the rows and treadle's
   ``treadle/*``.

The policy's weights reach the service's engines through the service's weight routes
(`RolloutClient.update_weights`), not through SkyRL's inference_engine_client, which
this generator never calls.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# SkyRL has no type information for mypy, and the dev environment has no SkyRL: its
# names are Any there (unused-ignore: where SkyRL is installed the ignores are moot).
from skyrl.train.generators.base import (  # type: ignore[import-not-found, unused-ignore]
    GeneratorInput,
    GeneratorInterface,
    GeneratorOutput,
)
from skyrl.train.generators.utils import (  # type: ignore[import-not-found, unused-ignore]
    get_rollout_metrics,
)

from treadle.client.aio import AsyncRolloutClient
from treadle.client.errors import (
    ClientError,
    ConversionError,
    ServiceProtocolError,
    ServiceUnavailable,
)
from treadle.client.skyrl import to_skyrl
from treadle.client.stream import RetryPolicy
from treadle.client.wire import suite_tasks
from treadle.types import Trajectory

log = logging.getLogger(__name__)

TASK_KEY = "treadle_task"  # the env_extras key (dataset column) the default task_of reads
# The JobRequest fields a call sets itself.
_OWN_FIELDS = frozenset({"tasks", "samples_per_task", "sampling", "limits", "job_id"})

TaskOf = Callable[[Any, Mapping[str, Any]], Mapping[str, Any]]  # (prompt, env_extras)
JobFields = Mapping[str, Any] | Callable[[Any], Mapping[str, Any]]  # of the GeneratorInput


def task_from_extras(prompt: Any, extras: Mapping[str, Any]) -> Mapping[str, Any]:
    """The default `task_of`: the task record in ``env_extras["treadle_task"]``;
    ValueError naming what the row has instead."""
    record = extras.get(TASK_KEY)
    if not isinstance(record, Mapping):
        raise ValueError(f"the row's env_extras has no task record under {TASK_KEY!r} (a "
                         f"column of the SkyRL dataset); it has {sorted(extras)}: add the "
                         f"column, or give TreadleGenerator a task_of")
    return record


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """A GeneratorInput as a treadle job: its tasks, and where each sample goes back."""

    uids: list[str]  # SkyRL's uids, in the order of their first rows
    rows: dict[str, list[int]]  # uid -> its rows of the input, in input order
    records: list[dict[str, Any]]  # one task record per uid, "id" = the uid
    samples: int  # rows per uid: the job's samples_per_task

    def row_of(self, t: Trajectory, job_id: str) -> int | None:
        """The input row a trajectory of this plan answers (None: not of this plan —
        a harness's sub-agent, whose group is `<group>/sub`, answers none)."""
        uid = t.key.group_id.removeprefix(f"{job_id}/")
        rows = self.rows.get(uid) if t.key.group_id == f"{job_id}/{uid}" else None
        if rows is None or not 0 <= t.key.repetition < len(rows):
            return None
        return rows[t.key.repetition]


def plan_batch(input_batch: GeneratorInput, task_of: TaskOf = task_from_extras) -> BatchPlan:
    """The job for `input_batch` (see the module docstring, 1); ValueError when the
    batch is empty, has no trajectory_ids or its uids have unequal numbers of rows,
    and whatever `task_of` raises."""
    prompts: Sequence[Any] = input_batch["prompts"]
    if not prompts:
        raise ValueError("an empty batch: a treadle job needs at least one task")
    ids = input_batch.get("trajectory_ids")
    if ids is None or len(ids) != len(prompts):
        raise ValueError("TreadleGenerator needs the GeneratorInput's trajectory_ids, one "
                         "per prompt: its uids are the GRPO groups of the job")
    extras: Sequence[Mapping[str, Any]] = input_batch.get("env_extras") or [{}] * len(prompts)
    rows: dict[str, list[int]] = {}
    for i, tid in enumerate(ids):
        rows.setdefault(str(tid.instance_id), []).append(i)
    sizes = {len(r) for r in rows.values()}
    if len(sizes) != 1:
        counts = ", ".join(f"{uid}: {len(r)}" for uid, r in list(rows.items())[:8])
        raise ValueError(f"every uid needs the same number of samples (one treadle job has "
                         f"one samples_per_task), got {counts}")
    records = []
    for uid, where in rows.items():
        first = where[0]
        record = {k: v for k, v in task_of(prompts[first], extras[first] or {}).items()
                  if v is not None}
        records.append({**record, "id": uid})
    return BatchPlan(list(rows), rows, records, sizes.pop())


class TreadleGenerator(GeneratorInterface):  # type: ignore[misc, unused-ignore]
    """A SkyRL generator whose rollouts a treadle service runs: one job per `generate`
    call (see the module docstring).

    `url` and `token`: the service; `suite` and `options`: the suite that runs and
    scores the tasks, and its constructor options; `task_of(prompt, env_extras)`: a
    row's task record; `step_wise`: SkyRL's ``generator.step_wise_trajectories``;
    `drop_group_on_failure`: leave out a whole group when one of its members failed
    (step-wise only; see treadle.client.samples); `sampling`, `limits`, `request`:
    the job's fields; `retry`, `timeout_s`: the HTTP client's.
    """

    def __init__(self, url: str, *, suite: str, token: str | None = None,
                 task_of: TaskOf = task_from_extras, options: Mapping[str, Any] | None = None,
                 step_wise: bool = False, drop_group_on_failure: bool = False,
                 sampling: Mapping[str, float] | None = None,
                 limits: Mapping[str, Any] | None = None, request: JobFields | None = None,
                 retry: RetryPolicy | None = None, timeout_s: float = 30.0) -> None:
        if isinstance(request, Mapping) and _OWN_FIELDS & request.keys():
            raise ValueError(f"request may not set {sorted(_OWN_FIELDS & request.keys())}: "
                             f"the generator sets them (sampling and limits: its own "
                             f"arguments)")
        self.url = url
        self.token = token
        self.suite = suite
        self.task_of = task_of
        self.options = dict(options or {})
        self.step_wise = step_wise
        self.drop_group_on_failure = drop_group_on_failure
        self.sampling = dict(sampling or {})
        self.limits = dict(limits or {})
        self.request = request
        self.retry = retry
        self.timeout_s = timeout_s

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        """Run `input_batch` as one job and return its GeneratorOutput, in input order
        with SkyRL's trajectory ids. Raises ValueError for a batch no job can
        represent, ConversionError for one SkyRL could not train on (see the module
        docstring, 4), and the client's errors (ServiceError, ServiceUnavailable)."""
        plan = plan_batch(input_batch, self.task_of)
        body = self.job_request(input_batch, plan)
        # A client per call: SkyRL may call from more than one event loop (training,
        # evaluation), and an httpx.AsyncClient belongs to the loop that first used it.
        async with AsyncRolloutClient(self.url, token=self.token, retry=self.retry,
                                      timeout_s=self.timeout_s) as client:
            job = await client.submit(body)
            try:
                trajectories = [d.trajectory async for d in client.trajectories(job.job_id)]
            except BaseException as e:
                # Its trajectories would run on for nobody; a service that cannot be
                # reached cannot be told, and trying would only delay the error.
                if not isinstance(e, ServiceUnavailable):
                    try:
                        await client.cancel(job.job_id)
                    except ClientError as cancel_failed:
                        log.warning("could not cancel treadle job %s: %s", job.job_id,
                                    cancel_failed)
                raise
        return self.output(input_batch, plan, job.job_id, trajectories)

    def job_request(self, input_batch: GeneratorInput, plan: BatchPlan) -> dict[str, Any]:
        """The JobRequest body for `input_batch` (see the module docstring, 2 and 3)."""
        given: Mapping[str, Any] = {}
        if callable(self.request):
            given = self.request(input_batch)
        elif self.request is not None:
            given = self.request
        own = sorted(_OWN_FIELDS & given.keys())
        if own:
            raise ValueError(f"request gave {own}: the generator sets them")
        skyrl = input_batch.get("sampling_params") or {}
        sampling = {k: skyrl[k] for k in ("temperature", "top_p", "seed")
                    if skyrl.get(k) is not None}
        limits = {} if skyrl.get("max_tokens") is None \
            else {"max_tokens_per_turn": skyrl["max_tokens"]}
        body: dict[str, Any] = {
            **given,
            "tasks": suite_tasks(self.suite, tasks=plan.records, options=self.options or None),
            "samples_per_task": plan.samples,
            "job_id": _job_id(input_batch),
        }
        if sampling or self.sampling:
            body["sampling"] = {**sampling, **self.sampling}
        if limits or self.limits:
            body["limits"] = {**limits, **self.limits}
        return body

    def output(self, input_batch: GeneratorInput, plan: BatchPlan, job_id: str,
               trajectories: Sequence[Trajectory]) -> GeneratorOutput:
        """The GeneratorOutput of the job's `trajectories` (see the module docstring, 4)."""
        row: dict[str, int] = {}
        planned = []
        for t in trajectories:
            i = plan.row_of(t, job_id)
            if i is None:
                if t.parent_id is not None:
                    continue  # a sub-agent: its parent's row carries the sample
                raise ServiceProtocolError(
                    f"job {job_id}: trajectory {t.trajectory_id!r} (group "
                    f"{t.key.group_id!r}, repetition {t.key.repetition}) is none the job "
                    "planned")
            row[t.trajectory_id] = i
            planned.append(t)
        trajectories = planned
        n = len(input_batch["prompts"])
        if not self.step_wise and len(row) < n:
            missing = sorted(set(range(n)) - set(row.values()))
            raise ConversionError(f"job {job_id} delivered {len(row)} of {n} trajectories "
                                  f"(none for rows {missing[:8]}): SkyRL without step-wise "
                                  f"training needs one row per prompt")
        ordered = sorted(trajectories, key=lambda t: row[t.trajectory_id])
        ids = input_batch["trajectory_ids"]
        converted = to_skyrl(ordered, step_wise=self.step_wise,
                             drop_group_on_failure=self.drop_group_on_failure,
                             trajectory_ids={tid: ids[i] for tid, i in row.items()})
        if converted.exclusions:
            first = converted.exclusions[0]
            log.warning("treadle job %s: %d of %d trajectories left out of training (%s: %s)",
                        job_id, len(converted.exclusions), len(trajectories),
                        first.trajectory_id, first.reason)
        data = converted.data
        data["rollout_metrics"] = {
            **get_rollout_metrics(data["response_ids"], data["rewards"],
                                  loss_masks=data["loss_masks"]),
            **data["rollout_metrics"]}
        return data


def _job_id(input_batch: GeneratorInput) -> str:
    """``skyrl-<phase>-<step>-<8 hex>``: unique, and it says which step it served."""
    meta = input_batch.get("batch_metadata")
    tag = uuid.uuid4().hex[:8]
    if meta is None:
        return f"skyrl-{tag}"
    return f"skyrl-{meta.training_phase}-{meta.global_step}-{tag}"


__all__ = ["TASK_KEY", "BatchPlan", "TreadleGenerator", "plan_batch", "task_from_extras"]
