"""verl's rollout and weight-push extension points, served by a treadle service.

Two classes verl 0.9.1 loads by name from its config (docs/trainers.md, "verl"):

- `TreadleAgentLoopManager` (``actor_rollout_ref.rollout.agent.agent_loop_manager_class``):
  each step's rollouts are ONE treadle job; verl's own agent loop workers are never made
  and verl's LLM servers are never called.
- `TreadleCheckpointManager` (``actor_rollout_ref.rollout.checkpoint_manager_class``),
  with `TreadleCheckpointEngine` (checkpoint engine backend ``treadle``): the actor's
  weights, as safetensors in a Hugging Face layout, pushed to treadle's engines
  through the service's weight barrier, the policy version being the trainer's global
  step.

Only verl's legacy trainer honours both (``trainer.use_v1=False``: `RayPPOTrainer`,
ray_trainer.py). verl 0.9.1's default v1 trainer ignores ``checkpoint_manager_class``
(trainer/ppo/v1/trainer_base.py builds `CheckpointEngineManager` with the "naive"
backend) and wants ``generate_sequences(TensorDict) -> None`` writing into
TransferQueue, a package verl==0.9.1 does not install: the manager refuses that
trainer rather than fail mid-step.

What verl still does: `RayPPOTrainer.init_workers` starts verl's own rollout replicas
(`LLMServerManager.create`, before either class is made; neither extension point can
stop it). They are put to sleep at start (`CheckpointEngineManager.sleep_replicas`,
inherited) and never woken: weight updates go to treadle, not to them.

**Rows.** The returned `DataProto` is what verl's `AgentLoopManager` returns (the keys,
padding and dtypes of `AgentLoopWorker._postprocess`: prompts left-padded to
``rollout.prompt_length`` and responses right-padded to ``rollout.response_length``
with the tokenizer's pad id, attention_mask, position_ids, response_mask,
rollout_log_probs, rm_scores at the last response token, the input's non-tensor
fields, ``__num_turns__``, the reward parts and every extra field as object arrays,
``meta_info`` {timing, reward_extra_keys}), one row per input row, except that a
multi-segment trajectory gives one row per segment (``segments="all"``), each with
its row's uid and other non-tensor fields. verl's trainer joins the output to its
own batch row by row (``batch.repeat(n).union(output)``, ray_trainer.py), which
refuses a batch with more rows: with that trainer, a harness that edits contexts
needs ``segments: last`` (each trajectory's last segment only) — see the
``segments`` setting. Responses longer than ``response_length`` are cut there (as
verl's tool agent loop does); a prompt longer than ``prompt_length`` is an error
(cutting it would change the context the tokens were sampled in).

Rewards are treadle's (the suite's verifier, or the harness's): verl's reward loop is
not called, so set the suite, not a verl reward function. The weights half (checkpoint
engine and manager) is `treadle.client.verl_weights`, re-exported here, so that this
module is the one name verl's config needs.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict  # type: ignore[import-not-found]
from verl.protocol import DataProto  # type: ignore[import-not-found]
from verl.utils.config import omega_conf_to_dataclass  # type: ignore[import-not-found]
from verl.utils.model import compute_position_id_with_mask  # type: ignore[import-not-found]

from treadle.client.http import RolloutClient
from treadle.client.verl import Segments, plan_step, rows_in_order, step_records
from treadle.client.verl_weights import (
    BACKEND,
    TreadleCheckpointEngine,
    TreadleCheckpointManager,
    WeightSettings,
    note_rollout_service,
    plain,
    pushed_version,
    version_dir,
)
from treadle.client.wire import suite_tasks
from treadle.types import Trajectory

log = logging.getLogger(__name__)

TASK_COLUMN = "treadle_task"  # the non-tensor field (or extra_info key) of a row's task
# Extra fields verl's `_postprocess` always sets (None where a loop gave none), so that
# batches of different agent loops concatenate.
_VERL_DEFAULT_EXTRA = ("turn_scores", "tool_rewards", "min_global_steps", "max_global_steps",
                       "extras")


# -- settings -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RolloutSettings:
    """``actor_rollout_ref.rollout.custom.treadle``: where the service is, what a job runs.

    Sampling is verl's (``rollout.temperature`` and ``top_p``; ``val_kwargs`` for
    validation; treadle has no top_k); the job's token limits default to verl's
    lengths: ``max_tokens_per_turn`` = ``response_length``, ``max_total_tokens`` =
    ``prompt_length + response_length``. verl prints its whole config: keep the token
    in $TREADLE_TOKEN of the process that makes the manager (verl's TaskRunner, a Ray
    actor: ``ray_kwargs.ray_init.runtime_env.env_vars`` reaches it on any cluster).
    """

    url: str  # the service, e.g. http://rollouts:8700
    suite: str  # the suite every task record is of (math, code, swe, ...)
    token: str | None = None  # bearer token; default: $TREADLE_TOKEN
    options: dict[str, Any] = field(default_factory=dict)  # the suite's options
    harness: str | None = None  # run each trajectory with this harness (serve --harness)
    harness_score: str | None = None  # how a harness run is scored (the service's default)
    limits: dict[str, Any] = field(default_factory=dict)  # max_turns, max_total_tokens, ...
    seed: int | None = None  # sampling seed (treadle derives one per task, sample, turn)
    segments: Segments = "all"  # "last": one row per trajectory (see the module docstring)
    drop_group_on_failure: bool = False  # treadle.client.samples' policy
    priority: int | None = None  # the job's priority in the service
    # The trainer run: jobs then take exactly the version last pushed from here, of
    # this run (a service serving other weights refuses them: docs/trainers.md).
    trainer_run: str | None = None
    timeout_s: float = 30.0  # per HTTP call (streams and barriers wait as long as needed)

    @classmethod
    def from_config(cls, rollout_config: Any) -> RolloutSettings:
        """From verl's rollout config; ValueError naming a missing or unknown key."""
        custom = rollout_config.get("custom") or {}
        raw = plain(custom.get("treadle") if hasattr(custom, "get") else None)
        if not isinstance(raw, dict):
            raise ValueError("TreadleAgentLoopManager needs actor_rollout_ref.rollout.custom."
                             "treadle (url, suite, ...): see docs/trainers.md")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"rollout.custom.treadle: unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        missing = [k for k in ("url", "suite") if not raw.get(k)]
        if missing:
            raise ValueError(f"rollout.custom.treadle needs {', '.join(missing)}")
        if raw.get("segments", "all") not in ("all", "last"):
            raise ValueError(f"rollout.custom.treadle.segments: 'all' or 'last', got "
                             f"{raw['segments']!r}")
        return cls(**raw)


# -- the agent loop manager ----------------------------------------------------------------


class TreadleAgentLoopManager:
    """verl's agent loop manager, each step one treadle job; see the module docstring.

    Made by verl's trainer as ``create(config=..., llm_client=..., teacher_client=...,
    reward_loop_worker_handles=...)``; the LLM client and the reward workers are not
    used (treadle samples and scores), a teacher (distillation) is refused.

    **Tasks.** Each input row's task is the suite's JSONL record (docs/suites.md), a
    dict or its JSON text, in the non-tensor field ``treadle_task`` (a dataset column:
    verl's RLHFDataset passes every column through) or, failing that, in the row's
    ``extra_info["treadle_task"]``. Rows sharing verl's ``uid`` (one prompt repeated
    ``rollout.n`` times) are one GRPO group: one task of the job, whose id becomes the
    uid, with that many samples.
    """

    def __init__(self, config: Any, llm_client: Any = None, teacher_client: Any = None,
                 reward_loop_worker_handles: Any = None) -> None:
        if config.trainer.get("use_v1", False):
            raise ValueError(
                "TreadleAgentLoopManager serves verl's RayPPOTrainer: set trainer.use_v1=False "
                "(verl's v1 trainer ignores rollout.checkpoint_manager_class and reads rollouts "
                "from TransferQueue)")
        if teacher_client:
            raise NotImplementedError("treadle's rollouts carry no teacher logprobs: "
                                      "distillation is not supported")
        self.config = config
        self.rollout_config = config.actor_rollout_ref.rollout
        self.settings = RolloutSettings.from_config(self.rollout_config)
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        self.calculate_log_probs = bool(self.rollout_config.get("calculate_log_probs", True))
        # The tokenizer verl's own agent loop workers pad with (HFModelConfig's).
        model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        if model_config.processor is not None:
            raise NotImplementedError("treadle's rollouts are text: models with a multimodal "
                                      "processor are not supported")
        pad = model_config.tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else 0
        token = self.settings.token or os.environ.get("TREADLE_TOKEN")
        self.client = RolloutClient(self.settings.url, token=token,
                                    timeout_s=self.settings.timeout_s)
        note_rollout_service(self.settings.url, token, self.settings.trainer_run)
        self.last_job_id: str | None = None  # the latest step's job

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> TreadleAgentLoopManager:
        """verl's constructor (`AgentLoopManager.create`): nothing to start."""
        return cls(*args, **kwargs)

    def close(self) -> None:
        self.client.close()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The step's rollouts: one job of every row's task, streamed until it ends,
        as verl's DataProto (module docstring). A failure cancels the job."""
        if not isinstance(prompts, DataProto):
            raise TypeError(f"generate_sequences takes verl's DataProto, got "
                            f"{type(prompts).__name__} (verl's v1 trainer?)")
        started = time.monotonic()
        inputs = {k: v for k, v in prompts.non_tensor_batch.items() if k != "__do_sample__"}
        do_sample = prompts.non_tensor_batch.get("__do_sample__")
        if do_sample is not None and not all(bool(x) for x in do_sample):
            raise NotImplementedError("greedy rows in a sampled batch (REMAX's baseline) are "
                                      "not supported: one treadle job samples alike")
        n_rows = len(prompts)
        uids = [str(u) for u in inputs["uid"]] if "uid" in inputs \
            else [f"row-{i}" for i in range(n_rows)]
        plan = plan_step(uids, [_task_record(inputs, i) for i in range(n_rows)])
        validate = bool(prompts.meta_info.get("validate", False))
        step = int(prompts.meta_info.get("global_steps", 0) or 0)
        job_id = (f"verl-{'val' if validate else 'train'}-{max(step, 0):06d}-"
                  f"{secrets.token_hex(4)}")
        request = self._job_request(plan.tasks, plan.samples_per_task, validate, job_id)
        self.last_job_id = job_id
        self.client.submit(request)
        try:
            delivered = [d.trajectory for d in self.client.trajectories(job_id)]
            rows = rows_in_order(plan, job_id, delivered)
            out = self._data_proto(rows, inputs)
        except BaseException:
            self._cancel(job_id)
            raise
        if len(out) != n_rows:
            log.warning("treadle job %s: %d rows for %d samples (trajectories with several "
                        "segments); verl's RayPPOTrainer.fit joins one row per sample and "
                        "refuses this: set rollout.custom.treadle.segments=last",
                        job_id, len(out), n_rows)
        out.meta_info["timing"]["treadle/job_s"] = time.monotonic() - started
        out.meta_info["treadle_job_id"] = job_id
        return out

    def _job_request(self, tasks: list[dict[str, Any]], samples: int, validate: bool,
                     job_id: str) -> dict[str, Any]:
        rc, s = self.rollout_config, self.settings
        sampling_config = rc.val_kwargs if validate else rc
        sampling: dict[str, Any] = {"temperature": float(sampling_config.temperature),
                                    "top_p": float(sampling_config.top_p)}
        if s.seed is not None:
            sampling["seed"] = s.seed
        limits = {"max_tokens_per_turn": self.response_length,
                  "max_total_tokens": self.prompt_length + self.response_length, **s.limits}
        request: dict[str, Any] = {
            "tasks": suite_tasks(s.suite, tasks=tasks, options=s.options or None),
            "samples_per_task": samples, "sampling": sampling, "limits": limits,
            # Start nothing before the engines serve the weights last pushed from here.
            "min_policy_version": pushed_version(), "job_id": job_id}
        if s.trainer_run is not None:
            request["max_policy_version"] = pushed_version()
            request["trainer_run"] = s.trainer_run
        if s.priority is not None:
            request["priority"] = s.priority
        if s.harness is not None:
            request["harness"] = {"name": s.harness, **(
                {"score": s.harness_score} if s.harness_score else {})}
        return request

    def _cancel(self, job_id: str) -> None:
        try:
            self.client.cancel(job_id)
        except Exception:  # the step's own error is the one to raise
            log.warning("could not cancel treadle job %s", job_id, exc_info=True)

    def _data_proto(self, rows: list[Trajectory], inputs: Mapping[str, np.ndarray]
                    ) -> DataProto:
        """The rows' records as verl's `AgentLoopWorker._postprocess` batches them."""
        step = step_records(rows, segments=self.settings.segments,
                            drop_group_on_failure=self.settings.drop_group_on_failure)
        records = [self._fit(r) for r in step.records]
        n = len(records)
        P, R = self.prompt_length, self.response_length
        prompts = torch.full((n, P), self.pad_token_id, dtype=torch.int64)
        responses = torch.full((n, R), self.pad_token_id, dtype=torch.int64)
        prompt_attention = torch.zeros((n, P), dtype=torch.int64)
        response_attention = torch.zeros((n, R), dtype=torch.int64)
        response_mask = torch.zeros((n, R), dtype=torch.int64)
        logprobs = torch.zeros((n, R), dtype=torch.float32)
        for i, r in enumerate(records):
            p, q = len(r["prompt_ids"]), len(r["response_ids"])
            if p:  # left padding
                prompts[i, P - p:] = torch.tensor(r["prompt_ids"], dtype=torch.int64)
                prompt_attention[i, P - p:] = 1
            if q:  # right padding
                responses[i, :q] = torch.tensor(r["response_ids"], dtype=torch.int64)
                response_attention[i, :q] = 1
                response_mask[i, :q] = torch.tensor(r["response_mask"], dtype=torch.int64)
                logprobs[i, :q] = torch.tensor(r["response_logprobs"], dtype=torch.float32)
        attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
        tensors = {
            "prompts": prompts, "responses": responses, "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
        }
        if self.calculate_log_probs:
            tensors["rollout_log_probs"] = logprobs
        # The reward sits on the last response token (at -1, the last column, for an
        # empty response), as verl puts it.
        rm_scores = torch.zeros((n, R), dtype=torch.float32)
        last = response_attention.sum(dim=1) - 1
        rm_scores[torch.arange(n), last] = torch.tensor(
            [float(r["reward_score"]) for r in records], dtype=torch.float32)
        tensors["rm_scores"] = rm_scores
        batch = TensorDict(tensors, batch_size=n)

        where = np.asarray(step.rows, dtype=np.int64)
        non_tensor: dict[str, np.ndarray] = {
            "__num_turns__": np.array([r["num_turns"] for r in records], dtype=np.int32)}
        non_tensor.update({k: v[where] for k, v in inputs.items()})
        extra_keys = list(records[0]["extra_fields"]["reward_extra_info"]) if records else []
        for key in extra_keys:
            non_tensor[key] = np.array([r["extra_fields"]["reward_extra_info"][key]
                                        for r in records])
        # verl's text-only rows carry an empty dict of processor inputs, which its
        # trainer reads unconditionally.
        non_tensor["multi_modal_inputs"] = _objects([{} for _ in records])
        extras = [self._extra_fields(r) for r in records]
        for key in sorted({k for e in extras for k in e} | set(_VERL_DEFAULT_EXTRA)):
            non_tensor[key] = _objects([e.get(key) for e in extras])
        metrics = [{"generate_sequences": float(r["metrics"]["generate_sequences"]),
                    "tool_calls": float(r["metrics"]["tool_calls"]), "compute_score": 0.0,
                    "num_preempted": int(r["metrics"]["num_preempted"])} for r in records]
        meta = {"timing": _timing(metrics, attention_mask, P) if records else {},
                "reward_extra_keys": extra_keys}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def _fit(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record within verl's lengths: a response cut at ``response_length`` (as
        verl's tool agent loop cuts it), a longer prompt refused."""
        extra = record["extra_fields"]
        if len(record["prompt_ids"]) > self.prompt_length:
            raise ValueError(
                f"trajectory {extra['treadle_trajectory_id']!r} segment "
                f"{extra['treadle_segment_index']}: its prompt is {len(record['prompt_ids'])} "
                f"tokens, over rollout.prompt_length={self.prompt_length}: raise "
                f"data.max_prompt_length to hold the suite's whole rendered prompt (its "
                f"instructions and tools) and, where a harness edits contexts, up to the "
                f"job's limits.max_total_tokens")
        R = self.response_length
        if len(record["response_ids"]) <= R:
            return record
        return {**record, "response_ids": record["response_ids"][:R],
                "response_mask": record["response_mask"][:R],
                "response_logprobs": record["response_logprobs"][:R],
                "extra_fields": {**extra, "treadle_policy_versions":
                                 extra["treadle_policy_versions"][:R]}}

    @staticmethod
    def _extra_fields(record: dict[str, Any]) -> dict[str, Any]:
        """The record's extra fields, with the weights versions verl's LLM client reports
        (``min/max_global_steps``: treadle's policy versions of the sampled tokens)."""
        extra = dict(record["extra_fields"])
        sampled = [v for v, m in zip(extra["treadle_policy_versions"], record["response_mask"],
                                     strict=True) if m]
        extra["min_global_steps"] = min(sampled) if sampled else None
        extra["max_global_steps"] = max(sampled) if sampled else None
        return extra


def _task_record(inputs: Mapping[str, np.ndarray], row: int) -> Any:
    if TASK_COLUMN in inputs:
        return inputs[TASK_COLUMN][row]
    extra = inputs["extra_info"][row] if "extra_info" in inputs else None
    if isinstance(extra, Mapping) and TASK_COLUMN in extra:
        return extra[TASK_COLUMN]
    raise ValueError(f"row {row} has no task: give each row the suite's record in a "
                     f"'{TASK_COLUMN}' column or in extra_info['{TASK_COLUMN}']")


def _objects(values: list[Any]) -> np.ndarray:
    # Assigned element-wise: np.array would turn lists of equal length into a 2-D array.
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _timing(metrics: list[dict[str, Any]], attention_mask: torch.Tensor,
            prompt_length: int) -> dict[str, float]:
    """`AgentLoopManager._performance_metrics`' keys (verl's trainer logs them)."""
    out: dict[str, float] = {}
    for name in ("num_preempted", "generate_sequences", "tool_calls", "compute_score"):
        values = np.array([m[name] for m in metrics], dtype=np.float64)
        out[f"agent_loop/{name}/min"] = float(values.min())
        out[f"agent_loop/{name}/max"] = float(values.max())
        out[f"agent_loop/{name}/mean"] = float(values.mean())
    total = np.array([m["generate_sequences"] + m["tool_calls"] + m["compute_score"]
                      for m in metrics])
    slowest = int(np.argmax(total))
    for name in ("generate_sequences", "tool_calls", "compute_score", "num_preempted"):
        out[f"agent_loop/slowest/{name}"] = float(metrics[slowest][name])
    row = attention_mask[slowest]
    out["agent_loop/slowest/prompt_length"] = float(row[:prompt_length].sum().item())
    out["agent_loop/slowest/response_length"] = float(row[prompt_length:].sum().item())
    return out


__all__ = [
    "BACKEND",
    "RolloutSettings",
    "TreadleAgentLoopManager",
    "TreadleCheckpointEngine",
    "TreadleCheckpointManager",
    "WeightSettings",
    "version_dir",
]
