"""Serve a checkpoint with real vLLM (CPU) and check its logprobs against the model's.

    .venv/bin/python scripts/vllm-parity.py CHECKPOINT_DIR [--tasks 32]

Starts `vllm.entrypoints.openai.api_server` from $TREADLE_VLLM_VENV (default
.venv-vllm in the repo) on the checkpoint, runs held-out math tasks through the
agent loop on it (`VLLMEngine`, temperature 1.0, real python tool calls), then
recomputes every sampled token's log-probability with `teacher_forced_logprobs`
on the same weights in this process and prints one JSON object: the max and mean
|engine - teacher-forced| over all sampled tokens, their count, and the success
rate of the run. Stops the server at the end. By hand, not in the test suite:
vLLM takes ~30-60 s to start on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from treadle.agent.chat import HFTokenizer
from treadle.engines.errors import EngineStartError
from treadle.runtime.launcher import LocalLauncher, VLLMProcess
from treadle.sandbox.local import LocalBackend
from treadle.train.evaluate import Rollout, rollouts, summarize
from treadle.train.logprobs import segment_logprob_gaps
from treadle.train.model import load_model
from treadle.train.transcripts import heldout_tasks

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--tasks", type=int, default=32)
    args = parser.parse_args()
    venv = Path(os.environ.get("TREADLE_VLLM_VENV", REPO / ".venv-vllm"))
    # The service's own launcher: a free port, a start-up deadline, the whole process
    # group stopped at the end, and vLLM dies with this script.
    launcher = LocalLauncher(VLLMProcess(model_dir=str(args.checkpoint), served_name="sft",
                                         python=str(venv / "bin" / "python"),
                                         extra_args=("--enforce-eager",)))

    async def run() -> tuple[list[Rollout], float, float]:
        start = time.monotonic()
        launched = await launcher.start(1)
        ready_s = time.monotonic() - start
        try:
            t0 = time.perf_counter()
            runs = await rollouts(launched.engine, HFTokenizer(args.checkpoint),
                                  heldout_tasks(args.tasks), LocalBackend(), temperature=1.0)
            return runs, time.perf_counter() - t0, ready_s
        finally:
            await launched.stop()

    try:
        runs, seconds, ready_s = asyncio.run(run())
    except EngineStartError as e:
        print(f"vLLM did not start: {e}", file=sys.stderr)
        return 1
    model = load_model(args.checkpoint)
    gaps = [g for r in runs for seg in r.trajectory.segments
            for g in segment_logprob_gaps(model, seg)]
    report = summarize(runs, temperature=1.0, seed=0, seconds=seconds)
    print(json.dumps({"checkpoint": str(args.checkpoint), "server_ready_s": round(ready_s, 1),
                      "trajectories": len(runs), "sampled_tokens": len(gaps),
                      "max_abs_logprob_diff": max(gaps, default=0.0),
                      "mean_abs_logprob_diff": sum(gaps) / max(1, len(gaps)),
                      "success": report.success, "well_formed": report.well_formed,
                      "statuses": report.statuses}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
