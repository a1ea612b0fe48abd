"""What a GRPO run's data can teach, offline: a fixed number of `policy_gradient_step`
updates from the run's starting weights, then held-out success on `TorchEngine`.

    .venv/bin/python scripts/rl-probe.py out/rl --data transcripts|successes|rollouts \
        [--steps 20] [--lr 2e-4] [--tasks 256]

`out/rl` is a `treadle train grpo --out` folder (its `rl.json`, `weights/v0` and
`rollouts.db`). The data of update k:

- `transcripts`: 64 of the run's supervised transcripts (advantage 1; all with the
  tool, whatever the start's `direct_share`): supervised
  learning through the RL loss, the update's sanity check;
- `successes`: the successful rollouts of the run's step k (advantage 1);
- `rollouts`: all of step k's rollouts with their GRPO advantages.

Old logprobs are recomputed on the weights being trained, so every update starts
on-policy (ratio 1). Prints one JSON line: the data, the settings, the held-out
success at T=1.0 and per kind. By hand, not in the test suite (a few minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from dataclasses import replace
from pathlib import Path

import torch

from treadle.agent.chat import HFTokenizer
from treadle.client.samples import TrainingSequence, training_sequences
from treadle.sandbox.local import LocalBackend
from treadle.store.db import Store
from treadle.train.cli import DEFAULT_CACHE
from treadle.train.engine import TorchEngine
from treadle.train.evaluate import evaluate
from treadle.train.grpo_config import GRPOConfig
from treadle.train.logprobs import teacher_forced_logprobs
from treadle.train.model import load_model
from treadle.train.serving import copy_tokenizer
from treadle.train.sft import SFTConfig, load_or_record_transcripts
from treadle.train.transcripts import heldout_tasks, tokenize
from treadle.train.update import policy_gradient_step
from treadle.types import TrajectoryStatus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--data", choices=("transcripts", "successes", "rollouts"), required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--tasks", type=int, default=256)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args()
    start = args.run / "weights" / "v0"
    tokenizer = HFTokenizer(start)
    torch.manual_seed(0)
    model = load_model(start)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99),
                                  weight_decay=0.0)
    config = GRPOConfig(epochs=1)

    def on_policy(s: TrainingSequence, advantage: float | None = None) -> TrainingSequence:
        lp = teacher_forced_logprobs(model, s.prompt_ids, s.response_ids)
        return replace(s, logprobs=[x if m else 0.0 for x, m in zip(lp, s.loss_mask,
                                                                    strict=True)],
                       advantage=s.advantage if advantage is None else advantage)

    if args.data == "transcripts":
        start_config = json.loads((args.run / "rl.json").read_text())["config"]["sft"]
        data = SFTConfig(train_tasks=start_config["train_tasks"],
                         data_seed=start_config["data_seed"])  # what decides the data key
        found = load_or_record_transcripts(data, args.cache, print)
        random.Random(0).shuffle(found)
    else:
        store = Store(args.run / "rollouts.db")
        jobs = [j for j in store.job_ids() if j.startswith("train-")]
    for k in range(args.steps):
        if args.data == "transcripts":
            rows = []
            for t in found[k * 64:(k + 1) * 64]:
                ex = tokenize(t, tokenizer)
                cut = ex.piece_lengths[0]
                response = ex.ids[cut:]
                rows.append(on_policy(TrainingSequence(
                    trajectory_id=t.task_id, group_id=t.task_id, task_id=t.task_id,
                    repetition=0, segment_index=0, num_segments=1, prompt_ids=ex.ids[:cut],
                    response_ids=response, loss_mask=ex.mask[cut:],
                    logprobs=[0.0] * len(response), policy_versions=[0] * len(response),
                    reward=1.0, advantage=1.0, status=TrajectoryStatus.COMPLETED,
                    excluded=None)))
        else:
            done = [d.trajectory() for d in store.iter_results(jobs[k % len(jobs)])]
            seqs = training_sequences(done).sequences
            rows = ([on_policy(s, 1.0) for s in seqs if s.reward == 1.0]
                    if args.data == "successes" else
                    [on_policy(s) for s in seqs if s.advantage])
        policy_gradient_step(model, optimizer, rows, config)
    out = args.run / f"probe-{args.data}"
    model.save_pretrained(out)
    copy_tokenizer(start, out)

    async def held_out() -> dict[str, object]:
        async with TorchEngine.from_checkpoint(out, seed=0, max_batch=64) as engine:
            report = await evaluate(engine, HFTokenizer(out), heldout_tasks(args.tasks),
                                    LocalBackend(), temperature=1.0)
        return {"success": report.success, "per_kind": report.per_kind}

    print(json.dumps({"data": args.data, "steps": args.steps, "lr": args.lr,
                      "tasks": args.tasks, **asyncio.run(held_out())}))


if __name__ == "__main__":
    main()
