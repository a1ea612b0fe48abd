"""Weight updates in each mode on the emulated engine: how long new calls are held,
what happens to the calls in flight, and how many sampled tokens are thrown away.

    flock -x /tmp/treadle-cpu.lock .venv/bin/python benchmarks/weight_modes_bench.py \
        --out benchmarks/weight-modes.json

`--trajectories` single-turn trajectories of `--tokens` tokens each run on one
emulated engine (Qwen3-14B on an H100, `--time-scale`, a reload of `--load-s`
modelled seconds); once the engine has taken `--steps-before` steps, one update per
mode (`Runtime.update_weights`, a fresh engine each). Reported per mode: `held_s`
(wall seconds new calls were held), the calls kept and aborted, the tokens the
engine sampled and those delivered (the difference: discarded), and how many of
the delivered tokens the old weights sampled. Seeded engine and sampling; the
timings are wall clock and move with the machine's load.

With `--vllm-url URL --vllm-model NAME --weights DIR` the same runs against a real
vLLM server in dev mode (`VLLM_SERVER_DEV_MODE=1`), each update reloading `DIR`
(the weights it serves, say); the tokens it sampled are the change of its
`vllm:generation_tokens_total` (`/metrics`), and an update starts once the engine
has sampled `--steps-before` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from treadle.agent.runner import Sampling
from treadle.core.cost_model import CostModel
from treadle.core.policies.baselines import Slime
from treadle.engines._http import parse_prometheus
from treadle.engines.base import Engine, PauseMode
from treadle.engines.emulated import EmulatedEngine
from treadle.engines.emulated_client import EmulatedEngineClient
from treadle.engines.emulated_server import serve_in_thread
from treadle.engines.vllm import VLLMEngine
from treadle.runtime.driver import Runtime

MODES: tuple[PauseMode, ...] = ("abort", "drain", "keep")


Counter = Callable[[], Awaitable[int]]


async def _one_update(engine: Engine, sampled: Counter, progress: Counter, mode: PauseMode,
                      weights: str, args: argparse.Namespace) -> dict[str, Any]:
    """One update of `mode` with `args.trajectories` calls in flight, once `progress()`
    reaches `args.steps_before`; `sampled()`: the tokens the engine sampled so far, of
    requests that have ended."""
    rt = Runtime(Slime(1, 1))
    rt.register_engine(engine, max_batch=args.trajectories)
    await rt.start()
    before = await sampled()
    try:
        calls = [asyncio.ensure_future(rt.turns(f"t{i}", "g").generate(
            [1, 2, 3 + i], args.tokens, Sampling(seed=i), []))
            for i in range(args.trajectories)]
        while await progress() - before < args.steps_before:  # polled, not timed
            await asyncio.sleep(0.005)
        update = await rt.update_weights(weights, 1, mode, timeout_s=600)
        outs = await asyncio.gather(*calls)
    finally:
        await rt.close()
    delivered = sum(len(o.output_ids) for o in outs)
    total = await sampled() - before
    return {"held_s": round(update.held_s, 3), "kept_calls": update.kept,
            "aborted_calls": update.aborted, "tokens_sampled": total,
            "tokens_delivered": delivered, "tokens_discarded": total - delivered,
            "old_version_tokens": sum(o.policy_versions.count(0) for o in outs)}


def _emulated(mode: PauseMode, args: argparse.Namespace) -> dict[str, Any]:
    model = EmulatedEngine(CostModel.named("qwen3-14b", "h100"), time_scale=args.time_scale,
                           seed=1, load_s=args.load_s)

    async def sampled() -> int:
        return model.generated

    async def steps() -> int:
        return model.steps

    with serve_in_thread(model, "qwen3-14b-emulated") as running:
        engine = EmulatedEngineClient(running.url, running.model)
        return asyncio.run(_one_update(engine, sampled, steps, mode, "/weights/1", args))


def _vllm(mode: PauseMode, args: argparse.Namespace) -> dict[str, Any]:
    async def sampled() -> int:
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{args.vllm_url}/metrics")).text
        return int(parse_prometheus(text, {"vllm:generation_tokens_total": "n"})["n"])

    engine = VLLMEngine(args.vllm_url, args.vllm_model)
    return asyncio.run(_one_update(engine, sampled, sampled, mode, args.weights, args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--steps-before", type=int, default=50)
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--load-s", type=float, default=2.0)
    parser.add_argument("--vllm-url", help="a vLLM server in dev mode, instead")
    parser.add_argument("--vllm-model", default="model", help="its served model name")
    parser.add_argument("--weights", default="", help="the weights it reloads")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "out"}}
    for mode in MODES:
        report[mode] = _vllm(mode, args) if args.vllm_url else _emulated(mode, args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
