"""TRL's `GRPOTrainer` on treadle's rollouts: a `rollout_func` and a weight sync.

    from treadle.client import RolloutClient
    from treadle.client.trl import treadle_reward
    from treadle.client.trl_trainer import TreadleRollouts, TreadleWeightSync

    client = RolloutClient(url, token=token)
    rollouts = TreadleRollouts(client, "math", records, num_generations=4,
                               pad_token_id=tok.pad_token_id, trainer_run="run-7")
    trainer = GRPOTrainer(model=model, processing_class=tok, args=args,
                          train_dataset=Dataset.from_list(rollouts.rows()),
                          reward_funcs=[treadle_reward], rollout_func=rollouts,
                          callbacks=[TreadleWeightSync(client, "out/weights",
                                                       trainer_run="run-7")])

`TreadleRollouts` is the `rollout_func`. TRL hands it only prompts (each repeated
`num_generations` times, consecutively), so it keeps the map from a prompt to its
suite task record (`rows()` is the dataset: one row per record, its prompt from
`prompt`, by default the record's ``question``). Each call runs the batch as one
treadle job — the unique tasks, `num_generations` samples each, sampled on exactly
the weights of the trainer's current step (``min_policy_version = max_policy_version
= global_step`` of `trainer_run`: a service serving other weights refuses the job
instead of training off-policy) with a seed derived from the trainer's seed and step
— and returns `to_trl`'s rows in TRL's order. It then recomputes the sampled tokens'
logprobs with the trainer's model and measures the gap to the engines' (TRL's own
importance correction and gap metric run only on its vLLM path): logged as
``treadle/logprob_gap_max`` and ``_mean`` among TRL's metrics and reported to the
job (`POST /v1/jobs/{id}/metrics`).

`TreadleWeightSync` is the `TrainerCallback` that keeps the engines on the trainer's
weights: at the start of training and after every optimiser step it saves the model
(safetensors, Hugging Face layout, embeddings untied: vLLM's CPU build reloads tied
ones wrongly) under `directory/v<step>`, pushes it through the service's weight
barrier as version ``global_step`` of `trainer_run`, and checks that the service
now serves exactly that. One process (no multi-GPU TRL: TRL calls `rollout_func`
per process with that process's prompts; run one job per process and push from the
main one only — not built here).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from treadle.client.errors import ConversionError
from treadle.client.http import RolloutClient
from treadle.client.samples import in_group_order
from treadle.client.trl import to_trl
from treadle.client.wire import suite_tasks
from treadle.errors import TreadleError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, TrainerControl, TrainerState, TrainingArguments

Record = dict[str, Any]
log = logging.getLogger(__name__)


def question(record: Record) -> str:
    """The default prompt of a task record: its ``question`` (math, STEM, search)."""
    return str(record["question"])


class TreadleRollouts:
    """GRPOTrainer's `rollout_func` over one treadle service (module docstring)."""

    def __init__(self, client: RolloutClient, suite: str, records: Sequence[Record], *,
                 num_generations: int, pad_token_id: int, trainer_run: str,
                 prompt: Callable[[Record], str] = question,
                 options: Mapping[str, Any] | None = None,
                 sampling: Mapping[str, float] | None = None,
                 limits: Mapping[str, Any] | None = None, check_gap: bool = True) -> None:
        self.client = client
        self.suite = suite
        self.num_generations = num_generations  # TRL's; each prompt's group size
        self.pad_token_id = pad_token_id
        self.trainer_run = trainer_run  # whose weights jobs may be sampled on
        self.options = dict(options or {})  # the suite's constructor options
        self.sampling = dict(sampling or {"temperature": 1.0})  # seed: derived per step
        self.limits = dict(limits or {})
        self.check_gap = check_gap  # recompute logprobs and measure the gap
        self.last_job: str | None = None  # the latest call's job id
        self.last_gap: tuple[float, float] | None = None  # its (max, mean) |gap|
        # The job's group ids are `{job}/{id}`: the records' own ids when each has a
        # distinct one, else one per prompt.
        ids = [r.get("id") for r in records]
        own = None not in ids and len(set(map(str, ids))) == len(ids)
        self._records: dict[str, Record] = {}
        for i, record in enumerate(records):
            text = prompt(record)
            if text in self._records:
                raise ValueError(f"two task records have the prompt {text[:80]!r}: TRL "
                                 "hands rollout_func prompts only, so each must be unique")
            self._records[text] = {**record, "id": str(record["id"]) if own else f"p{i}"}

    def rows(self) -> list[dict[str, str]]:
        """The training dataset: one ``{"prompt": ...}`` row per task record."""
        return [{"prompt": text} for text in self._records]

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        blocks = self._blocks(prompts)
        records = [self._records[p] for p in blocks]
        step = int(trainer.state.global_step)
        self._check_served(step)
        sampling = {**self.sampling,
                    "seed": (int(trainer.args.seed) * 1_000_003 + step) % (1 << 31)}
        job = self.client.submit(
            tasks=suite_tasks(self.suite, tasks=records, options=self.options or None),
            samples_per_task=self.num_generations, sampling=sampling,
            limits=self.limits or None, min_policy_version=step, max_policy_version=step,
            trainer_run=self.trainer_run)
        self.last_job = job.job_id
        trajectories = [d.trajectory for d in self.client.trajectories(job.job_id)]
        ordered = in_group_order(trajectories,
                                 [f"{job.job_id}/{r['id']}" for r in records])
        rows = to_trl(ordered, pad_token_id=self.pad_token_id,
                      num_generations=self.num_generations).data
        if self.check_gap:
            self.last_gap = logprob_gap(trainer.model, rows)
            gap_max, gap_mean = self.last_gap
            mode = "train" if trainer.model.training else "eval"
            metrics = getattr(trainer, "_metrics", None)  # TRL's per-mode metric lists
            if isinstance(metrics, dict) and mode in metrics:
                metrics[mode]["treadle/logprob_gap_max"].append(gap_max)
                metrics[mode]["treadle/logprob_gap_mean"].append(gap_mean)
            try:
                self.client.report(job.job_id, {"logprob_gap_max": gap_max,
                                                "logprob_gap_mean": gap_mean})
            except TreadleError:  # the step's data is good; the report is a record of it
                log.warning("could not report the logprob gap of job %s", job.job_id,
                            exc_info=True)
        return rows

    def _blocks(self, prompts: list[Any]) -> list[str]:
        """The unique prompts of TRL's list (runs of `num_generations` equal ones)."""
        n = self.num_generations
        if len(prompts) % n:
            raise ConversionError(f"{len(prompts)} prompts are not runs of num_generations={n}")
        blocks: list[str] = []
        for start in range(0, len(prompts), n):
            run = {_key(p) for p in prompts[start:start + n]}
            if len(run) != 1:
                raise ConversionError(f"prompts {start}..{start + n - 1} are not one prompt "
                                      "repeated num_generations times")
            (text,) = run
            if text not in self._records:
                raise ConversionError(f"prompt {text[:80]!r} is not one of this rollout "
                                      "function's tasks (train on its rows())")
            if text in blocks:
                raise ConversionError(f"prompt {text[:80]!r} comes twice in one batch; a "
                                      "job samples each task once, num_generations times")
            blocks.append(text)
        return blocks

    def _check_served(self, step: int) -> None:
        served = self.client.weights()
        if served.trainer_run == self.trainer_run and served.policy_version == step:
            return
        if served.policy_version == 0 and served.trainer_run is None and step == 0:
            return  # the engines' initial weights: the trainer's too, at step 0
        raise RuntimeError(
            f"the engines serve policy version {served.policy_version} of trainer run "
            f"{served.trainer_run!r}, not step {step} of {self.trainer_run!r}: add "
            "TreadleWeightSync to the trainer's callbacks (it pushes the weights after "
            "every optimiser step)")


def _key(prompt: Any) -> str:
    """A prompt as the map's key. Text only: rows() makes text prompts, and TRL
    passes the dataset's prompts through unchanged."""
    if not isinstance(prompt, str):
        raise ConversionError(f"a {type(prompt).__name__} prompt: TreadleRollouts trains "
                              "on its rows(), whose prompts are text")
    return prompt


def logprob_gap(model: PreTrainedModel, rows: Mapping[str, list[Any]]) -> tuple[float, float]:
    """The (max, mean) |trainer − engine| logprob over the rows' sampled tokens
    (``env_mask`` 1), with the model as it is now; (0, 0) when none was sampled."""
    import torch

    worst, total, count = 0.0, 0.0, 0
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            for prompt, completion, engine, mask in zip(
                    rows["prompt_ids"], rows["completion_ids"], rows["logprobs"],
                    rows["env_mask"], strict=True):
                if not any(mask):
                    continue
                mine = _completion_logprobs(model, prompt, completion)
                for lp, theirs, m in zip(mine.tolist(), engine, mask, strict=True):
                    if m:
                        gap = abs(lp - theirs)
                        worst, total, count = max(worst, gap), total + gap, count + 1
    finally:
        model.train(was_training)
    if count and not math.isfinite(total):
        raise ValueError("a recomputed logprob is not finite")
    return worst, (total / count if count else 0.0)


def _completion_logprobs(model: PreTrainedModel, prompt: list[int],
                         completion: list[int]) -> torch.Tensor:
    import torch

    ids = torch.tensor([prompt + completion], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, ids[0, len(prompt):, None])[:, 0]


class TreadleWeightSync(TrainerCallback):
    """Pushes the trainer's weights to treadle's engines (module docstring)."""

    def __init__(self, client: RolloutClient, directory: str | Path, *, trainer_run: str,
                 keep: int = 2) -> None:
        self.client = client
        self.directory = Path(directory)  # where each version is saved (engines read it)
        self.trainer_run = trainer_run
        self.keep = max(1, keep)  # versions kept on disk (older ones are removed)
        self.pushed: list[int] = []  # the versions pushed so far

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        self._push(kwargs["model"], state.global_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        self._push(kwargs["model"], state.global_step)

    def _push(self, model: PreTrainedModel, version: int) -> None:
        path = save_untied(model, self.directory / f"v{version}")
        served = self.client.update_weights(str(path), version, trainer_run=self.trainer_run)
        if (served.policy_version, served.trainer_run) != (version, self.trainer_run):
            raise RuntimeError(f"pushed version {version} of {self.trainer_run!r}, but the "
                               f"service serves {served.policy_version} of "
                               f"{served.trainer_run!r}")
        self.pushed.append(version)
        on_disk = sorted(set(self.pushed))
        for old in on_disk[:-self.keep]:
            _remove(self.directory / f"v{old}")


def save_untied(model: PreTrainedModel, out: Path) -> Path:
    """The model's weights and config saved to `out` (what an engine's weight reload
    reads), the output projection a separate copy of tied embeddings; the model
    itself is not changed. The engines keep their own tokenizer."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    # Cloned: safetensors refuses tensors that share memory (tied ones do).
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        embed: Any = model.get_input_embeddings()
        state["lm_head.weight"] = embed.weight.detach().clone()
    config = type(model.config).from_dict(model.config.to_dict())
    config.tie_word_embeddings = False
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


__all__ = ["TreadleRollouts", "TreadleWeightSync", "logprob_gap", "question", "save_untied"]
