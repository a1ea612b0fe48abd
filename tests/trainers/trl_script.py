"""Run in .venv-trl by test_trainers_trl.py: TRL's real GRPOTrainer, two steps, on
treadle's rollouts through the shipped adapter — the TRL example of docs/trainers.md,
executed as written, with the script's own `model`, `tok`, `args` and `records`.
Reads its inputs from the environment; writes what happened to result.json in the
working directory."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"


def docs_example(heading: str) -> str:
    """The first python block under `heading` of docs/trainers.md."""
    section = DOCS.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, f"no python example under ## {heading}"
    return found.group(1)


torch.manual_seed(0)
model_dir = os.environ["TREADLE_MODEL"]
records = [json.loads(line) for line in Path(os.environ["TREADLE_TASKS"]).read_text()
           .splitlines()]
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
args = GRPOConfig(output_dir="trl", per_device_train_batch_size=8, num_generations=4,
                  max_steps=2, learning_rate=1e-5, logging_steps=1, report_to="none",
                  use_cpu=True, bf16=False, save_strategy="no", seed=0, beta=0.0,
                  max_completion_length=768, dataloader_num_workers=0)
scope = {"model": model, "tok": tok, "args": args, "records": records}
exec(compile(docs_example("TRL"), f"{DOCS}:TRL", "exec"), scope)
served = scope["client"].weights()
Path("result.json").write_text(json.dumps({
    "log_history": scope["trainer"].state.log_history,
    "pushed": scope["sync"].pushed,
    "last_job": scope["rollouts"].last_job,
    "served": [served.policy_version, served.trainer_run],
}))
