"""Serve a checkpoint with real vLLM (CPU) and check its logprobs against the model's.

    .venv/bin/python scripts/vllm-parity.py CHECKPOINT_DIR [--tasks 32] [--port 8011]

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
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from treadle.agent.chat import HFTokenizer
from treadle.engines.vllm import VLLMEngine
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
    parser.add_argument("--port", type=int, default=8011)
    args = parser.parse_args()
    venv = Path(os.environ.get("TREADLE_VLLM_VENV", REPO / ".venv-vllm"))
    log_path = Path(f"/tmp/treadle-vllm-parity-{args.port}.log")
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
             "--model", str(args.checkpoint), "--served-model-name", "sft",
             "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
             "--host", "127.0.0.1", "--port", str(args.port)],
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        start = time.monotonic()
        while True:
            if server.poll() is not None:
                print(f"vLLM exited ({server.returncode}); see {log_path}", file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        ready_s = time.monotonic() - start

        async def run() -> tuple[list[Rollout], float]:
            t0 = time.perf_counter()
            async with VLLMEngine(url, "sft") as engine:
                runs = await rollouts(engine, HFTokenizer(args.checkpoint),
                                      heldout_tasks(args.tasks), LocalBackend(), temperature=1.0)
            return runs, time.perf_counter() - t0

        runs, seconds = asyncio.run(run())
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
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
