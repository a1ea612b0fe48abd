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

Where vLLM is not installed, `--engine torch` times the model's decode arithmetic
in a CUDA graph instead (the GPU part of a step, no engine; rows say so), and
`--engine torch --prefill NEW:CACHED,...` times prefills and the pinned
host-to-device copy rate. `--compare FILE` prints a measured document beside the
model (GPU part and whole step); it needs no GPU.

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


# -- the engine-free measurement ------------------------------------------------
# Where vLLM is not installed (a lent GPU without it, nothing to fetch), the decode
# step is measured without an engine: the model's own decode arithmetic at its real
# shapes — per layer RMSNorm, the fused QKV, O, gate/up and down GEMMs, attention of
# one new token over the sequence's KV cache (SDPA, grouped-query heads as query
# positions), the LM head and a greedy pick — captured in one CUDA graph and
# replayed. That is the GPU part of the cost model's step (weights, batch GEMMs, KV
# reads: `StepParts` without `fixed_s` and `per_seq_s`); what an engine adds on the
# host (scheduling, sampling, input preparation) is not in it, and the rows say so.
# Rotary embeddings and the new token's KV write are left out (element-wise, a few
# microseconds a layer).


def _torch_step(cfg: dict[str, Any], batch: int, ctx: int, device: str) -> Any:
    """A decode step of `batch` sequences with `ctx` cached tokens each, as a
    no-argument callable over preallocated buffers (random bf16 weights, seeded)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    nq, nkv, hd = (int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]),
                   int(cfg["head_dim"]))
    vocab, layers = int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])
    bf16 = torch.bfloat16

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen, device=device, dtype=bf16) * 0.02

    w = [(rand(h, (nq + 2 * nkv) * hd), rand(nq * hd, h), rand(h, 2 * inter),
          rand(inter, h), rand(batch, nkv, ctx, hd), rand(batch, nkv, ctx, hd))
         for _ in range(layers)]
    head = rand(h, vocab)
    x0 = rand(batch, h)
    norm = torch.ones(h, device=device, dtype=bf16)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step() -> Any:
        x = x0
        for wqkv, wo, wgu, wd, kc, vc in w:
            qkv = torch.nn.functional.rms_norm(x, (h,), norm) @ wqkv
            # One query token per sequence: its nq/nkv heads of a KV group become
            # query positions of that group, so SDPA reads each KV head once.
            q = qkv[:, :nq * hd].view(batch, nkv, nq // nkv, hd)
            attn = sdpa(q, kc, vc).reshape(batch, nq * hd)
            x = x + attn @ wo
            gate, up = (torch.nn.functional.rms_norm(x, (h,), norm) @ wgu).chunk(2, -1)
            x = x + (torch.nn.functional.silu(gate) * up) @ wd
        return (torch.nn.functional.rms_norm(x, (h,), norm) @ head).argmax(-1)

    return step


def measure_torch(points: Sequence[Point], log: Any, steps: int = 100) -> dict[str, Any]:
    """Time each point's decode step as a replayed CUDA graph (mean of `steps`
    replays after a warm-up), on this machine's first GPU."""
    import torch

    device_name = torch.cuda.get_device_name(0)
    gpu = gpu_key(device_name)
    rows: list[dict[str, Any]] = []
    for p in points:
        ctx = round(p.context_per_seq)
        step = _torch_step(HF_CONFIGS[p.model], p.batch, ctx, "cuda")
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as required
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                graph.replay()
            end.record()
            end.synchronize()
        ms = start.elapsed_time(end) / steps
        log(f"{p.model} batch {p.batch} context {ctx}: {ms:.3f} ms/step (graph)")
        rows.append({
            "model": p.model, "gpu": gpu, "tp": 1, "batch": p.batch,
            "context_per_seq": float(ctx), "step_ms": round(ms, 3),
            "source": f"scripts/calibrate-gpu.py --engine torch on {device_name}, "
                      f"{time.strftime('%Y-%m-%d')}",
            "conditions": (f"{device_name}, BF16, PyTorch {torch.__version__}, no engine: "
                           f"the model's decode arithmetic (random weights) for {p.batch} "
                           f"sequences of {ctx} cached tokens in one CUDA graph, mean of "
                           f"{steps} replays; the GPU part of a step only (no scheduling, "
                           "sampling or input preparation)"),
        })
        del step, graph
        torch.cuda.empty_cache()
    return document(rows)


PREFILL_SCHEMA = "treadle.prefill-calibration/1"


def _torch_prefill(cfg: dict[str, Any], new: int, cached: int) -> Any:
    """One sequence's prefill of `new` tokens over `cached` tokens already in KV, as a
    no-argument callable (the model's arithmetic at its shapes, random bf16 weights;
    causal attention aligned to the end, flash SDPA with grouped KV heads)."""
    import torch
    from torch.nn.attention.bias import causal_lower_right

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    nq, nkv, hd = (int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]),
                   int(cfg["head_dim"]))
    bf16, f = torch.bfloat16, torch.nn.functional

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=bf16) * 0.02

    w = [(rand(h, (nq + 2 * nkv) * hd), rand(nq * hd, h), rand(h, 2 * inter), rand(inter, h),
          rand(1, nkv, cached, hd), rand(1, nkv, cached, hd))
         for _ in range(int(cfg["num_hidden_layers"]))]
    x0, norm = rand(new, h), torch.ones(h, device="cuda", dtype=bf16)
    mask = causal_lower_right(new, cached + new)

    def prefill() -> Any:
        x = x0
        for wqkv, wo, wgu, wd, kc, vc in w:
            qkv = f.rms_norm(x, (h,), norm) @ wqkv
            q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], -1)
            q = q.view(new, nq, hd).transpose(0, 1).unsqueeze(0)
            k = torch.cat([kc, k.view(new, nkv, hd).transpose(0, 1).unsqueeze(0)], 2)
            v = torch.cat([vc, v.view(new, nkv, hd).transpose(0, 1).unsqueeze(0)], 2)
            attn = f.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            x = x + attn[0].transpose(0, 1).reshape(new, nq * hd) @ wo
            gate, up = (f.rms_norm(x, (h,), norm) @ wgu).chunk(2, -1)
            x = x + (f.silu(gate) * up) @ wd
        return x

    return prefill


def measure_torch_prefill(models: Sequence[str], shapes: Sequence[tuple[int, int]],
                          log: Any, reps: int = 5) -> dict[str, Any]:
    """Prefill times (new tokens over cached ones) and the host-to-device copy rate of
    pinned memory (the weight-load bandwidth), beside the cost model's figures."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from treadle.core.cost_model import CostModel

    device_name = torch.cuda.get_device_name(0)
    gpu = gpu_key(device_name)
    rows: list[dict[str, Any]] = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for model in models:
        for new, cached in shapes:
            run = _torch_prefill(HF_CONFIGS[model], new, cached)
            with torch.inference_mode():
                run()
                start.record()
                for _ in range(reps):
                    run()
                end.record()
                end.synchronize()
            ms = start.elapsed_time(end) / reps
            cost = CostModel.named(model, gpu)
            # The model's prefill less its step overhead: the GPU part measured here.
            predicted = 1e3 * (cost.prefill_time(1, new, cached) - cost.params.step_overhead_s)
            log(f"{model} prefill {new} over {cached}: {ms:.2f} ms (model {predicted:.2f})")
            rows.append({"model": model, "gpu": gpu, "tp": 1, "new_tokens": new,
                         "cached_tokens": cached, "ms": round(ms, 3),
                         "model_ms": round(predicted, 3)})
            del run
            torch.cuda.empty_cache()
    host = torch.empty(8 * 2**30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    start.record()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    load_gbs = reps * host.numel() / (start.elapsed_time(end) / 1e3) / 1e9
    log(f"host-to-device (pinned, 8 GiB): {load_gbs:.1f} GB/s")
    return {"schema": PREFILL_SCHEMA,
            "description": "Prefill of one sequence (new tokens over cached ones) as the "
                           "model's arithmetic at its shapes in PyTorch (no engine), mean "
                           f"of {reps} after a warm-up, beside core.cost_model's prefill "
                           "time less its step overhead; and the pinned host-to-device "
                           "copy rate, the bound on loading weights",
            "source": f"scripts/calibrate-gpu.py --prefill on {device_name}, "
                      f"PyTorch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
            "rows": rows, "host_to_device_gbs": round(load_gbs, 1)}


def compare(doc: dict[str, Any]) -> list[str]:
    """Lines of a measured document beside the cost model: a decode row's step and
    the model's GPU part (no fixed or per-sequence overhead) and whole step; a
    prefill row's time and the model's prefill less its step overhead."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from treadle.core.cost_model import CostModel

    lines = []
    for r in doc["rows"]:
        cost = CostModel.named(r["model"], r["gpu"])
        if doc["schema"] == PREFILL_SCHEMA:
            lines.append(f"{r['model']:17} prefill {r['new_tokens']:>5} over "
                         f"{r['cached_tokens']:>5}: {r['ms']:8.2f} ms, model "
                         f"{r['model_ms']:8.2f} ({r['ms'] / r['model_ms']:.2f}x)")
            continue
        parts, b = cost.step_parts(r["tp"]), r["batch"]
        kv = b * r["context_per_seq"]
        gpu_ms = 1e3 * (max(parts.weights_s, parts.compute_s * b) + parts.kv_s * kv)
        full_ms = 1e3 * cost.step_time(r["tp"], b, kv)
        lines.append(f"{r['model']:17} batch {b:>4} context {r['context_per_seq']:>7.0f}: "
                     f"{r['step_ms']:7.3f} ms, model GPU part {gpu_ms:7.3f} "
                     f"({r['step_ms'] / gpu_ms:.2f}x), whole step {full_ms:7.3f} "
                     f"({r['step_ms'] / full_ms:.2f}x)")
    return lines


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
    ap.add_argument("--engine", choices=("vllm", "torch"), default="vllm",
                    help="vllm: time a real engine; torch: time the model's decode "
                         "arithmetic in a CUDA graph where vLLM is not installed")
    ap.add_argument("--prefill", default=None, metavar="NEW:CACHED,...",
                    help="with --engine torch: time prefills of NEW tokens over CACHED "
                         "ones (and the host-to-device copy rate) instead of decode steps")
    ap.add_argument("--compare", default=None, metavar="FILE",
                    help="print a measured document beside the cost model; no GPU")
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

    if args.compare:
        print("\n".join(compare(json.loads(Path(args.compare).read_text()))))
        return 0
    if args.dry_run:
        for p in points:
            log(f"would measure {p.model} at batch {p.batch}, context {p.context}, "
                f"{p.long - p.short} timed steps")
        doc = dry_run(points, args.gpu)
    elif args.prefill:
        shapes = [(int(a), int(b)) for a, b in
                  (item.split(":") for item in args.prefill.split(",") if item)]
        doc = measure_torch_prefill(models, shapes, log)
    elif args.engine == "torch":
        doc = measure_torch(points, log)
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
