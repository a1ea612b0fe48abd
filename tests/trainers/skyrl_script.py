"""SkyRL's side of tests/trainers/test_trainers_skyrl.py, run by the python of
.venv-skyrl (skyrl==0.3.0): the docs' SkyRL example (docs/trainers.md) builds a
TreadleGenerator, which runs a batch SkyRL itself prepared against the service at
$TREADLE_URL; SkyRL's own checks then take the output.

    python skyrl_script.py DOCS_MD DATA_DIR REPORT_JSON

The batch: SkyRL's PromptDataset reads gsm8k-shaped rows (the columns of SkyRL's
examples/train/gsm8k dataset) from a JSONL file, its collate_fn and
prepare_generator_input make the GeneratorInput with SkyRL's uids, as its trainer
does. For each mode (step-wise or not) the generator's output goes where
RayPPOTrainer.generate sends it: rollout_metrics popped, validate_generator_output;
then concatenate_generator_outputs, and merge_stepwise_output in step-wise mode; and
once more without step-wise training, the input's rows shuffled; then batches no
job can represent are refused. Any
failed check raises; the report says what came back, for the test to check against
the service.
"""

from __future__ import annotations

# SkyRL 0.3.0 does not import on Python 3.11, the python of .venv-skyrl (the CPU torch
# wheel here is cp311): skyrl/tinker/types.py puts a typing.TypedDict in a pydantic
# model, which pydantic refuses below Python 3.12. typing_extensions' TypedDict is the
# same type with what pydantic needs; set before SkyRL is imported.
import sys
import typing

import typing_extensions

if sys.version_info < (3, 12):
    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]

import asyncio
import json
import re
import types
from pathlib import Path
from typing import Any

from skyrl.backends.skyrl_train.inference_servers.engine_utils import (
    get_sampling_params_for_backend,
)
from skyrl.train.config import SamplingParams
from skyrl.train.dataset import PromptDataset
from skyrl.train.generators.base import (
    GeneratorInterface,
    GeneratorOutput,
    TrajectoryID,
)
from skyrl.train.generators.utils import (
    concatenate_generator_outputs,
    merge_stepwise_output,
    prepare_generator_input,
)
from skyrl.train.utils.trainer_utils import validate_generator_output

SAMPLES = 3  # generator.n_samples_per_prompt
MAX_GENERATE_LENGTH = 48  # generator.sampling_params.max_generate_length
TEMPERATURE = 0.7
ROWS = [("What is 1 + 2?", "3"), ("What is 2 + 2?", "4"), ("What is 5 - 2?", "3")]
SHUFFLE = [7, 0, 4, 8, 3, 1, 5, 2, 6]  # an input order of the 9 rows for the last run


class ChatTemplateOnly:
    """What PromptDataset asks of a tokenizer: the prompt's length, to filter long ones."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> list[int]:
        return [0] * sum(len(m["content"].split()) + 4 for m in messages)


def docs_example(docs: Path) -> dict[str, Any]:
    """The names the python block of the docs' "## SkyRL" section defines."""
    text = docs.read_text()
    section = text.split("\n## SkyRL\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None, "no python block under ## SkyRL in docs/trainers.md"
    names: dict[str, Any] = {"__name__": "treadle_docs_skyrl"}
    exec(compile(block.group(1), f"{docs}#SkyRL", "exec"), names)
    return names


def generator_input(data_dir: Path) -> dict[str, Any]:
    """A GeneratorInput made as RayPPOTrainer.train makes one, from a gsm8k-shaped file."""
    path = data_dir / "gsm8k.jsonl"
    with path.open("w") as f:
        for i, (question, answer) in enumerate(ROWS):
            f.write(json.dumps({
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question}],
                "env_class": "gsm8k",
                "reward_spec": {"method": "rule", "ground_truth": answer},
                "extra_info": {"split": "train", "index": i, "question": question},
            }) + "\n")
    dataset = PromptDataset([str(path)], ChatTemplateOnly(), max_prompt_length=512,
                            num_workers=1)
    batch = dataset.collate_fn([dataset[i] for i in range(len(dataset))])
    sampling = get_sampling_params_for_backend(
        "vllm", SamplingParams(max_generate_length=MAX_GENERATE_LENGTH,
                               temperature=TEMPERATURE))
    gi, uids = prepare_generator_input(batch, SAMPLES, sampling, "gsm8k", "train", 1)
    assert uids == [str(i) for i in range(len(ROWS)) for _ in range(SAMPLES)], uids
    return gi


def run_mode(exp_class: type, gi: dict[str, Any], step_wise: bool) -> dict[str, Any]:
    cfg = types.SimpleNamespace(generator=types.SimpleNamespace(
        step_wise_trajectories=step_wise))
    # BasePPOExp.__init__ builds datasets, tokenizer and Ray placement: get_generator
    # needs none of it.
    exp = object.__new__(exp_class)
    generator = exp.get_generator(cfg, None, None)
    assert isinstance(generator, GeneratorInterface)
    out = asyncio.run(generator.generate(gi))
    declared = set(GeneratorOutput.__annotations__)
    assert declared <= set(out), declared - set(out)
    extra = set(out) - declared
    # What RayPPOTrainer.generate does with the output.
    metrics = out.pop("rollout_metrics")
    validate_generator_output(len(gi["prompts"]), out, step_wise=step_wise)
    concatenate_generator_outputs([out], step_wise=step_wise)
    ids_in = gi["trajectory_ids"]
    ids_out = out["trajectory_ids"]
    assert all(isinstance(t, TrajectoryID) for t in ids_out)
    if step_wise:
        assert all(any(t is s for s in ids_in) for t in ids_out), "not SkyRL's own ids"
        merged = merge_stepwise_output(out)
        assert len(merged["response_ids"]) == sum(out["is_last_step"])
    else:
        assert len(ids_out) == len(ids_in)
        assert all(t is s for t, s in zip(ids_out, ids_in, strict=True)), \
            "not SkyRL's own ids in input order"
    return {
        "rows": len(out["response_ids"]),
        "uids": [t.instance_id for t in ids_out],
        "repetitions": [t.repetition_id for t in ids_out],
        "rewards": out["rewards"],
        "stop_reasons": out["stop_reasons"],
        # The token lists, row by row, for the test to check against its engine.
        **{key: out[key] for key in ("prompt_token_ids", "response_ids", "loss_masks",
                                     "rollout_logprobs", "is_last_step")},
        "extra_keys": sorted(extra),
        "metrics": {k: metrics[k] for k in ("generate/avg_num_tokens",
                                            "treadle/num_trajectories",
                                            "treadle/num_excluded")},
    }


def refusals(exp_class: type, gi: dict[str, Any]) -> None:
    """Batches and settings no treadle job can represent raise ValueError before any
    job is submitted (the docs' generator reaches the service: the test counts the
    engine's requests, which a job submitted here would add to)."""
    from treadle.client.skyrl_generator import TreadleGenerator, plan_batch

    cfg = types.SimpleNamespace(generator=types.SimpleNamespace(step_wise_trajectories=False))
    generator = object.__new__(exp_class).get_generator(cfg, None, None)
    uneven = {**gi, **{key: gi[key][:-1] for key in ("prompts", "env_classes", "env_extras",
                                                     "trajectory_ids")}}
    for batch, says in ((uneven, "same number of samples"),
                        ({**gi, "trajectory_ids": None}, "needs the GeneratorInput's"),
                        ({**gi, "prompts": [], "trajectory_ids": []}, "empty batch")):
        try:
            asyncio.run(generator.generate(batch))
        except ValueError as e:
            assert says in str(e), e
        else:
            raise AssertionError(f"no ValueError ({says})")
    try:  # the default task_of: a gsm8k row has no treadle_task column
        plan_batch(gi)
    except ValueError as e:
        assert "treadle_task" in str(e), e
    else:
        raise AssertionError("a row without a task record was planned")
    try:
        TreadleGenerator("http://127.0.0.1:9", suite="math", request={"samples_per_task": 2})
    except ValueError as e:
        assert "samples_per_task" in str(e), e
    else:
        raise AssertionError("request may not set samples_per_task")


def main() -> None:
    docs, data_dir, report = (Path(a) for a in sys.argv[1:4])
    names = docs_example(docs)
    gi = generator_input(data_dir)
    result: dict[str, Any] = {"input_uids": [t.instance_id for t in gi["trajectory_ids"]]}
    for mode, step_wise in (("plain", False), ("step_wise", True)):
        result[mode] = run_mode(names["TreadleExp"], gi, step_wise)
    # SkyRL's contract is the input's order, whatever it is: rows of a uid apart and
    # out of their repetitions' order too.
    shuffled = {**gi, **{key: [gi[key][i] for i in SHUFFLE]
                         for key in ("prompts", "env_classes", "env_extras", "trajectory_ids")}}
    result["shuffled"] = run_mode(names["TreadleExp"], shuffled, False)
    refusals(names["TreadleExp"], gi)
    report.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
