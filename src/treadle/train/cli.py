"""`treadle train sft | eval`: fine-tune the small model (cached), measure a checkpoint.

    treadle train sft --out ~/.cache/treadle --steps 400      # prints the checkpoint dir
    treadle train eval --model DIR --tasks 200 --temperature 1.0

Wire into the main CLI with `add_train_parser(subparsers)`; the handler is in
`args.func`. Needs the ``train`` extra; imports are lazy so `treadle --help` stays
fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_CACHE = Path(os.environ.get("TREADLE_CACHE", Path.home() / ".cache" / "treadle"))


def add_train_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `train sft` and `train eval` on the main CLI's subparsers."""
    train = subparsers.add_parser("train", help="build, fine-tune and evaluate the small model")
    commands = train.add_subparsers(dest="train_command", required=True)
    sft = commands.add_parser("sft", help="supervised fine-tuning on math transcripts "
                                          "(cached by a hash of its inputs)")
    sft.add_argument("--out", type=Path, default=DEFAULT_CACHE,
                     help=f"cache root; the checkpoint is OUT/sft-<key> (default {DEFAULT_CACHE}"
                          ", or $TREADLE_CACHE)")
    sft.add_argument("--steps", type=int, default=None, help="optimizer steps (default 400)")
    sft.add_argument("--train-tasks", type=int, default=None,
                     help="distinct training transcripts (default 2000)")
    sft.add_argument("--seed", type=int, default=None, help="initialisation and batch order")
    sft.add_argument("--eval-tasks", type=int, default=0, metavar="N",
                     help="then evaluate on N held-out tasks at temperature 1.0")
    sft.set_defaults(func=run_sft)
    ev = commands.add_parser("eval", help="held-out success rate of a checkpoint, through "
                                          "the agent loop with real python tool calls")
    ev.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    ev.add_argument("--tasks", type=int, default=200, help="held-out tasks (default 200)")
    ev.add_argument("--samples", type=int, default=1, help="trajectories per task")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--seed", type=int, default=0, help="sampling seed")
    ev.add_argument("--backend", default="local", help="sandbox backend (local, bwrap)")
    ev.set_defaults(func=run_eval)


def _quiet() -> None:
    import transformers

    transformers.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    logging.basicConfig(level=logging.WARNING, format="%(message)s")


def _fail(command: str, message: str) -> int:
    print(f"treadle train {command}: {message}", file=sys.stderr)
    return 2


def run_sft(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from treadle.train.evaluate import evaluate_checkpoint
    from treadle.train.sft import SFTConfig, sft
    from treadle.train.transcripts import HELDOUT_POOL

    for name in ("steps", "train_tasks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return _fail("sft", f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.eval_tasks <= HELDOUT_POOL:
        return _fail("sft", f"--eval-tasks must be in 0-{HELDOUT_POOL}")
    _quiet()
    overrides = {"steps": args.steps, "train_tasks": args.train_tasks, "seed": args.seed}
    config = replace(SFTConfig(), **{k: v for k, v in overrides.items() if v is not None})
    path = sft(config, args.out)
    print(path)
    if args.eval_tasks:
        print(json.dumps(evaluate_checkpoint(path, tasks=args.eval_tasks).as_dict()))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from treadle.train.evaluate import evaluate_checkpoint
    from treadle.train.transcripts import HELDOUT_POOL

    if not (args.model / "config.json").is_file():
        return _fail("eval", f"--model {args.model}: no checkpoint (config.json) there")
    if not 1 <= args.tasks <= HELDOUT_POOL or args.samples < 1:
        return _fail("eval", f"--tasks must be in 1-{HELDOUT_POOL} and --samples >= 1")
    if args.temperature < 0:
        return _fail("eval", "--temperature must be >= 0")
    _quiet()
    report = evaluate_checkpoint(args.model, tasks=args.tasks, temperature=args.temperature,
                                 samples=args.samples, seed=args.seed, backend=args.backend)
    print(json.dumps(report.as_dict()))
    return 0
