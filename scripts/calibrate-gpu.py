#!/usr/bin/env python3
"""Measure vLLM decode step times on the one GPU of this machine, in the format of
tests/core/data/h100_decode.json, so that calibrating `treadle.core.cost_model` is
one command when a GPU is lent:

    python scripts/calibrate-gpu.py --out out/h200_decode.json     # a few minutes
    python scripts/calibrate-gpu.py --dry-run                      # the plan, no GPU

What it measures: for each model shape (random weights through vLLM's
`load_format="dummy"` and a config written here, so nothing is downloaded and no
tokenizer is needed) and each batch size, `batch` prompts of `context` random token
ids are sent at once and decoded with `ignore_eos`, twice: for `short` and for
`long` new tokens. The step time is the difference of the two wall times over the
difference of the token counts, which cancels the prefill, the first-step CUDA-graph
warm-up and the request setup. The row's context per sequence is the mean over the
measured steps. TP 1 only (one GPU). Each row records vLLM's version, the GPU's
name and the conditions.

Then `pytest tests/core/test_calibration.py` with the new file in place of (or beside)
the committed table checks the model against it; refit `CostParams` if it fails.

The dry run prints the same JSON document with the cost model's predictions in
`step_ms` (conditions say so), which is also what the measured rows will be judged
against. The script imports neither torch nor vLLM until it measures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "treadle.decode-calibration/1"
DESCRIPTION = (
    "Decode step time of vLLM on one TP group, per row: model shape (a "
    "core.cost_model.MODELS key), GPU (a GPUS key), TP degree, running sequences, mean "
    "context per sequence, measured milliseconds per step. Written by "
    "scripts/calibrate-gpu.py."
)

# Hugging Face configs of the shapes measured (random weights: only the shape
# matters). Keys are treadle.core.cost_model.MODELS keys.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "mistral-nemo-12b": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "hidden_size": 5120, "intermediate_size": 14336, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 131072, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
        "sliding_window": None, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen3-14b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


@dataclass(frozen=True, slots=True)
class Point:
    """One row to measure."""

    model: str  # a HF_CONFIGS / cost-model key
    batch: int  # sequences decoded together
    context: int  # prompt tokens per sequence
    short: int  # new tokens of the first run
    long: int  # new tokens of the second run; (long - short) steps are timed

    @property
    def context_per_seq(self) -> float:
        """Mean context over the timed steps (prompt plus the tokens decoded so far)."""
        return self.context + (self.short + self.long) / 2.0


def plan(models: Sequence[str], batches: Sequence[int], context: int,
         short: int, long: int) -> list[Point]:
    """Every (model, batch) point, in the order they are measured."""
    return [Point(m, b, context, short, long) for m in models for b in batches]


def conditions(point: Point, gpu_name: str, vllm_version: str) -> str:
    return (f"{gpu_name}, BF16, vLLM {vllm_version}, random weights (load_format=dummy), "
            f"TP 1, {point.batch} sequences of {point.context} random prompt tokens sent "
            f"at once, ignore_eos; step = (wall({point.long} new tokens) - "
            f"wall({point.short})) / {point.long - point.short}")


def gpu_key(device_name: str) -> str:
    """The cost model's GPUS key for a CUDA device name ("NVIDIA H200" -> "h200")."""
    name = device_name.lower()
    for key in ("h200", "h100"):
        if key in name:
            return key
    raise SystemExit(f"no cost-model entry for GPU {device_name!r} (known: h100, h200)")


def document(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"schema": SCHEMA, "description": DESCRIPTION, "rows": rows}


def dry_run(points: Sequence[Point], gpu: str) -> dict[str, Any]:
    """The plan as a calibration document whose `step_ms` are the cost model's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from treadle.core.cost_model import CostModel

    rows = []
    for p in points:
        cost = CostModel.named(p.model, gpu)
        ms = 1e3 * cost.step_time(1, p.batch, p.batch * p.context_per_seq)
        rows.append({
            "model": p.model, "gpu": gpu, "tp": 1, "batch": p.batch,
            "context_per_seq": p.context_per_seq, "step_ms": round(ms, 3),
            "source": "dry run of scripts/calibrate-gpu.py: treadle.core.cost_model "
                      "prediction, not a measurement",
            "conditions": conditions(p, gpu, "(not run)"),
        })
    return document(rows)


def _wall(llm: Any, prompts: list[dict[str, Any]], tokens: int) -> float:
    """Seconds to decode exactly `tokens` new tokens for every prompt at once."""
    from vllm import SamplingParams  # type: ignore[import-not-found, unused-ignore]

    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True,
                            temperature=1.0, detokenize=False)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def measure(points: Sequence[Point], gpu_mem: float, log: Any) -> dict[str, Any]:
    """Run every point on this machine's GPU; one engine per model."""
    import torch
    import vllm  # type: ignore[import-not-found, unused-ignore]
    from vllm import LLM  # type: ignore[import-not-found, unused-ignore]

    device = torch.cuda.get_device_name(0)
    gpu = gpu_key(device)
    rng = random.Random(0)  # the prompts' token ids: seeded, the same every run
    rows: list[dict[str, Any]] = []
    for model in dict.fromkeys(p.model for p in points):
        mine = [p for p in points if p.model == model]
        cfg = HF_CONFIGS[model]
        with tempfile.TemporaryDirectory(prefix=f"calib-{model}-") as tmp:
            Path(tmp, "config.json").write_text(json.dumps(cfg))
            started = time.perf_counter()
            max_len = max(p.context + p.long for p in mine) + 16
            llm = LLM(model=tmp, load_format="dummy", skip_tokenizer_init=True,
                      dtype="bfloat16", tensor_parallel_size=1, max_model_len=max_len,
                      gpu_memory_utilization=gpu_mem,
                      max_num_seqs=max(256, max(p.batch for p in mine)), seed=0)
            log(f"{model}: engine up in {time.perf_counter() - started:.0f}s")
            vocab = int(cfg["vocab_size"])
            for p in mine:
                prompts = [{"prompt_token_ids": [rng.randrange(1000, vocab - 1000)
                                                 for _ in range(p.context)]}
                           for _ in range(p.batch)]

                _wall(llm, prompts, p.short)  # warm-up: graphs for this batch, allocator
                step = ((_wall(llm, prompts, p.long) - _wall(llm, prompts, p.short))
                        / (p.long - p.short))
                log(f"{model} batch {p.batch}: {1e3 * step:.2f} ms/step")
                rows.append({
                    "model": model, "gpu": gpu, "tp": 1, "batch": p.batch,
                    "context_per_seq": p.context_per_seq, "step_ms": round(1e3 * step, 3),
                    "source": f"scripts/calibrate-gpu.py on {device}, "
                              f"{time.strftime('%Y-%m-%d')}",
                    "conditions": conditions(p, device, vllm.__version__),
                })
            del llm
            torch.cuda.empty_cache()
    return document(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3-8b,qwen3-14b",
                    help=f"comma-separated, of {', '.join(HF_CONFIGS)}")
    ap.add_argument("--batches", default="1,80,256", help="sequences per step")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--short", type=int, default=32, help="new tokens of the first run")
    ap.add_argument("--long", type=int, default=288, help="new tokens of the second run")
    ap.add_argument("--gpu", default="h100",
                    help="cost-model GPU of the dry run's predictions (a real run detects it)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan as a calibration document of predictions; no GPU")
    ap.add_argument("--out", default=None, help="also write the document here")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in HF_CONFIGS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose of {', '.join(HF_CONFIGS)}")
    if not 0 < args.short < args.long:
        ap.error("need 0 < --short < --long")
    points = plan(models, [int(b) for b in args.batches.split(",") if b], args.context,
                  args.short, args.long)

    def log(message: str) -> None:
        print(f"calibrate-gpu: {message}", file=sys.stderr, flush=True)

    if args.dry_run:
        for p in points:
            log(f"would measure {p.model} at batch {p.batch}, context {p.context}, "
                f"{p.long - p.short} timed steps")
        doc = dry_run(points, args.gpu)
    else:
        doc = measure(points, args.gpu_memory_utilization, log)
    text = json.dumps(doc, indent=2) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
