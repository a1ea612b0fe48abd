"""`treadle engine emulate`: serve an emulated engine (vLLM's API, cost-model timing).

    treadle engine emulate --port 8000 --model qwen3-14b --gpu h100 --tp 2 --time-scale 0.05

Wire into the main CLI with `add_engine_parser(subparsers)`; the handler is
`run_emulate(args)` (in `args.func`). Exits 2 with one line on stderr for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any


def add_engine_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `engine emulate` on the main CLI's subparsers; handler in `args.func`."""
    engine = subparsers.add_parser("engine", help="inference engines")
    commands = engine.add_subparsers(dest="engine_command", required=True)
    emu = commands.add_parser(
        "emulate", help="serve an emulated engine: vLLM's HTTP API, timing from the cost "
                        "model, synthetic tokens")
    emu.add_argument("--port", type=int, default=8000)
    emu.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    emu.add_argument("--model", default="qwen3-14b", help="cost-model entry, e.g. qwen3-14b")
    emu.add_argument("--gpu", default="h100", help="cost-model GPU entry, e.g. h100")
    emu.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    emu.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                     help="multiply every modelled duration (0.05 = 20x faster than real)")
    emu.add_argument("--max-num-seqs", type=int, default=256,
                     help="most requests in the running batch (vLLM's --max-num-seqs)")
    emu.add_argument("--max-model-len", type=int, default=None,
                     help="bound on prompt + max_tokens (default: the model's context)")
    emu.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens")
    emu.add_argument("--load-s", type=float, default=0.0, metavar="S",
                     help="seconds a weight reload takes (before --time-scale; default 0)")
    emu.add_argument("--log-level", default="info")
    emu.set_defaults(func=run_emulate)


def run_emulate(args: argparse.Namespace) -> int:
    """Handler of `engine emulate`: serves until SIGINT/SIGTERM; 0, or 2 for bad input."""
    from treadle.core.cost_model import CostModel  # lazy: keep --help fast
    from treadle.engines.emulated import EmulatedEngine
    from treadle.engines.emulated_server import serve

    try:
        cost = CostModel.named(args.model, args.gpu)
        engine = EmulatedEngine(cost, tp=args.tp, time_scale=args.time_scale,
                                max_num_seqs=args.max_num_seqs,
                                max_model_len=args.max_model_len, seed=args.seed,
                                load_s=args.load_s)
    except (KeyError, ValueError) as e:
        print(f"treadle engine emulate: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print("treadle engine emulate: --port must be in 1-65535", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper())
    served = f"{args.model}-emulated"
    print(f"emulated engine {served}: {args.gpu} x tp{args.tp}, time scale {args.time_scale},"
          f" KV {engine.kv_capacity} tokens, on http://{args.host}:{args.port}", file=sys.stderr)
    asyncio.run(serve(engine, served, host=args.host, port=args.port,
                      log_level=args.log_level))
    return 0
