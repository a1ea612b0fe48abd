"""Engine cost model: how long a decode step, a prefill, a migration and a TP
reconfiguration take for a given model on a given GPU.

It is pure arithmetic and lives in `core` because both the scheduler (to price
placements and migrations) and the simulator (to advance time) use it; the live
runtime can use the same numbers, recalibrated from measurements.

Decode is memory-bound. One engine step reads the weights once and every running
sequence's KV cache once::

    step(tp, B, K) = max(W / tp / (BW·e),  2·P·B / (tp·FLOPS·e_c))     # weights or compute
                     + K · kv_bytes / tp / (BW·e)                       # the batch's KV
                     + L · 2 · allreduce(tp, B)                          # two all-reduces a layer
                     + overhead + B · per_seq_overhead                   # scheduler, sampling

with W the weight bytes, P the parameter count, B the batch size, K the total
context tokens of the batch and L the number of layers. An all-reduce of the
batch's activations costs a latency plus its ring volume, 2(tp−1)/tp · B·hidden·2
bytes, over NVLink at the bandwidth decode's small messages achieve (a fraction of
the link's; this per-token term is what exists only at TP > 1). For a fixed batch the step
time is *linear* in K (`step_coeffs`), which lets the simulator jump from event to
event in closed form instead of stepping token by token.

Prefill is compute-bound: 2·P FLOPs per new token plus attention over the cached
prefix, split over tp GPUs, plus the activation all-reduce over NVLink.

Limits: no speculative decoding, no chunked-prefill overlap (prefill stalls the
batch for its duration, which slightly overstates interference), bf16 weights and
KV, one replica per TP group (no pipeline or expert parallelism). Every parameter
is in the tables below with its source; `CostParams` holds the efficiency and
overhead figures: the decode ones fitted to public H100 measurements (see its
docstring), the rest estimates. `scripts/calibrate-gpu.py` measures the same table on
a lent GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator's datasheet figures."""

    name: str  # registry key, e.g. "h100"
    hbm_bytes: float  # device memory
    hbm_bw: float  # peak memory bandwidth, bytes/s
    bf16_flops: float  # dense bf16 tensor throughput, FLOP/s (no sparsity)
    nvlink_bw: float  # per-GPU NVLink bandwidth, one direction, bytes/s
    source: str  # where the figures come from


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The architecture figures that decide decode and prefill cost."""

    name: str  # registry key, e.g. "qwen3-14b"
    params: float  # parameter count
    layers: int  # transformer blocks
    hidden: int  # model width
    kv_heads: int  # key/value heads (GQA)
    head_dim: int  # per-head width
    max_context: int  # tokens the model supports natively
    source: str  # where the figures come from

    @property
    def weight_bytes(self) -> float:
        return self.params * 2.0  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return float(self.layers * self.kv_heads * self.head_dim * 2 * 2)  # K and V, bf16


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        "h100", 80 * GB, 3.35e12, 989e12, 450 * GB,
        "NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3, 3.35 TB/s, "
        "989 TFLOPS bf16 dense, NVLink 900 GB/s bidirectional",
    ),
    "h200": GpuSpec(
        "h200", 141 * GB, 4.8e12, 989e12, 450 * GB,
        "NVIDIA H200 Tensor Core GPU datasheet, SXM: 141 GB HBM3e, 4.8 TB/s, "
        "989 TFLOPS bf16 dense, NVLink 900 GB/s bidirectional",
    ),
}

MODELS: dict[str, ModelSpec] = {
    "qwen3-8b": ModelSpec(
        "qwen3-8b", 8.19e9, 36, 4096, 8, 128, 40960,
        "Qwen/Qwen3-8B config.json and model card: 8.2B params, 36 layers, "
        "32 Q / 8 KV heads, head_dim 128, 32K native context (40,960 positions)",
    ),
    "qwen3-14b": ModelSpec(
        "qwen3-14b", 14.8e9, 40, 5120, 8, 128, 40960,
        "Qwen/Qwen3-14B config.json and model card: 14.8B params, 40 layers, "
        "40 Q / 8 KV heads, head_dim 128",
    ),
    "qwen3-32b": ModelSpec(
        "qwen3-32b", 32.8e9, 64, 5120, 8, 128, 40960,
        "Qwen/Qwen3-32B config.json and model card: 32.8B params, 64 layers, "
        "64 Q / 8 KV heads, head_dim 128",
    ),
    # The two shapes public H100 decode measurements exist for; they are here so the
    # calibration table (tests/core/data/h100_decode.json) can be replayed, not as
    # serving targets. Mistral-Nemo-12B has Qwen3-14B's width, depth and KV layout.
    "llama-3-8b": ModelSpec(
        "llama-3-8b", 8.03e9, 32, 4096, 8, 128, 8192,
        "meta-llama/Meta-Llama-3-8B config.json: 8.03B params, 32 layers, hidden 4096, "
        "32 Q / 8 KV heads, head_dim 128, 8,192 positions",
    ),
    "mistral-nemo-12b": ModelSpec(
        "mistral-nemo-12b", 12.25e9, 40, 5120, 8, 128, 131072,
        "mistralai/Mistral-Nemo-Base-2407 config.json and model card: 12.25B params, "
        "40 layers, hidden 5120, 32 Q / 8 KV heads, head_dim 128, 128K context",
    ),
}


@dataclass(frozen=True, slots=True)
class CostParams:
    """Efficiencies and overheads, each with its reasoning.

    The decode figures are fitted to public vLLM measurements on H100 SXM
    (Llama-3-8B and Mistral-Nemo-12B, batch 1 to 256, TP 1-8; the table with each
    row's source and conditions is tests/core/data/h100_decode.json, and a test
    holds the model to every row within ±15%; the fit is within ±9%). The prefill,
    memory, migration and restart figures are estimates still to be measured."""

    # Achieved fraction of peak HBM bandwidth for weight/KV streaming. Fitted: 0.85
    # puts the TP-1 batch-1 rows within 2% (0.75, the earlier estimate, made them
    # 11-13% slow); published decode GEMV rooflines report 70-85% of peak.
    hbm_efficiency: float = 0.85
    # Achieved fraction of peak bf16 FLOPs for large batched decode GEMMs. The TP-1
    # rows at batch 240-256 (compute-bound in the model) fit within +6% with it.
    decode_flops_efficiency: float = 0.5
    # Achieved fraction of peak bf16 FLOPs for prefill (long, compute-bound GEMMs).
    prefill_flops_efficiency: float = 0.55
    # Fixed cost of one engine step (scheduling, sampling, launch with CUDA graphs),
    # for an engine with multi-step or async scheduling (vLLM >= 0.6). The batch-1
    # rows pin only its sum with the all-reduce latency; 1.5 ms fits both models.
    step_overhead_s: float = 1.5e-3
    # Per-sequence cost of one step (input prep, sampling, detokenisation).
    per_seq_overhead_s: float = 4e-6
    # Latency of one small all-reduce at tp=2 (custom all-reduce over NVLink, inside
    # a CUDA graph). Microbenchmarks give 4-10 us; the batch-1 TP-2..8 step times
    # imply 10-16 us per in-step all-reduce (the kernel plus its launch gap).
    allreduce_base_s: float = 11e-6
    # Extra all-reduce latency per additional rank (microbenchmarks: 5.9 us at TP-8
    # against 3.7 us at TP-2, i.e. about 0.4 us a rank).
    allreduce_per_rank_s: float = 0.5e-6
    # Achieved fraction of NVLink bandwidth for decode's all-reduces: the per-token
    # cost that exists only at TP > 1. Decode all-reduces move 10 KB-3 MB, where
    # measured effective bandwidth is 100-270 GB/s, not the link's 450; the sharded
    # GEMMs of a TP-8 engine are also too thin to reach the FLOPs efficiency above.
    # Both show up as a per-sequence slope of the TP-8 step time of about 20 us
    # (measured) against 9 us without this term, which made TP-8 15-35% too cheap at
    # 80-256 sequences. 0.19 (86 GB/s) fits TP-8 at 79-256 sequences within ±9%.
    # Prefill all-reduces are large messages and keep the full link bandwidth.
    decode_allreduce_bw_efficiency: float = 0.19
    # Fraction of device memory the engine may use (vLLM gpu_memory_utilization).
    memory_utilization: float = 0.9
    # Per-GPU memory kept for activations, CUDA graphs and the allocator.
    activation_reserve_bytes: float = 3 * GB
    # Effective inter-node KV transfer bandwidth (one 400 Gb/s NIC, ~50% achieved).
    kv_link_bw: float = 25 * GB
    # Fixed cost of a KV migration (handshake, block tables); Heddle measured
    # 0.15-0.33 s per migration in total.
    migration_setup_s: float = 0.1
    # Fixed part of restarting an engine with another TP degree (process start,
    # NCCL init, CUDA-graph capture), as seen for vLLM with cached weights.
    restart_base_s: float = 20.0
    # Host-to-device weight load bandwidth per GPU (PCIe Gen5 x16, ~50% achieved).
    weight_load_bw: float = 25 * GB


TP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class StepParts:
    """The pieces of one TP degree's decode step, as `step_coeffs` adds them up:
    α(b) = max(weights_s, compute_s·b) + fixed_s + per_seq_s·b and step time
    α(b) + kv_s·K. Exposed for reasoning about batching (`core.lower_bound`)."""

    tp: int  # TP degree
    weights_s: float  # reading the weight shard
    compute_s: float  # batch GEMMs, per sequence (overlaps the weight read)
    fixed_s: float  # step overhead plus the all-reduce latencies
    per_seq_s: float  # per-sequence overhead plus the all-reduce volume
    kv_s: float  # reading one token of KV (beta)

    def alpha(self, batch: float) -> float:
        return (max(self.weights_s, self.compute_s * batch) + self.fixed_s
                + self.per_seq_s * batch)


class CostModel:
    """Times for one model on one GPU type. All results are in seconds."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, params: CostParams | None = None) -> None:
        self.model = model
        self.gpu = gpu
        self.params = params or CostParams()
        self._bw = gpu.hbm_bw * self.params.hbm_efficiency
        self._coeff_cache: dict[tuple[int, int], tuple[float, float]] = {}

    @classmethod
    def named(cls, model: str, gpu: str, params: CostParams | None = None) -> CostModel:
        """Look up table entries by name; raises KeyError naming the valid choices."""
        if model not in MODELS:
            raise KeyError(f"unknown model {model!r}; choose one of {', '.join(sorted(MODELS))}")
        if gpu not in GPUS:
            raise KeyError(f"unknown gpu {gpu!r}; choose one of {', '.join(sorted(GPUS))}")
        return cls(MODELS[model], GPUS[gpu], params)

    # -- decode ---------------------------------------------------------------

    def allreduce_s(self, tp: int, tokens: float = 1.0, *, decode: bool = True) -> float:
        """One all-reduce of `tokens` tokens' activations across `tp` GPUs: a decode
        step's (small messages, `decode_allreduce_bw_efficiency` of the link) or,
        with `decode=False`, a prefill's (large messages, the full link)."""
        if tp <= 1:
            return 0.0
        volume = 2.0 * (tp - 1) / tp * tokens * self.model.hidden * 2.0
        bw = self.gpu.nvlink_bw
        if decode:
            bw *= self.params.decode_allreduce_bw_efficiency
        return (self.params.allreduce_base_s + self.params.allreduce_per_rank_s * (tp - 2)
                + volume / bw)

    def step_parts(self, tp: int) -> StepParts:
        """The decode step's pieces at this TP degree (see `StepParts`)."""
        p, m = self.params, self.model
        # allreduce_s(tp, b) = latency + b · per-token volume time; two a layer.
        latency = self.allreduce_s(tp, 0.0)
        per_token = self.allreduce_s(tp, 1.0) - latency
        return StepParts(
            tp=tp,
            weights_s=m.weight_bytes / tp / self._bw,
            compute_s=2.0 * m.params / (tp * self.gpu.bf16_flops * p.decode_flops_efficiency),
            fixed_s=m.layers * 2 * latency + p.step_overhead_s,
            per_seq_s=m.layers * 2 * per_token + p.per_seq_overhead_s,
            kv_s=m.kv_bytes_per_token / tp / self._bw,
        )

    def step_coeffs(self, tp: int, batch: int) -> tuple[float, float]:
        """(alpha, beta) with step time = alpha + beta · (total KV tokens of the batch)."""
        key = (tp, batch)
        hit = self._coeff_cache.get(key)
        if hit is not None:
            return hit
        parts = self.step_parts(tp)
        self._coeff_cache[key] = (parts.alpha(batch), parts.kv_s)
        return self._coeff_cache[key]

    def step_time(self, tp: int, batch: int, kv_tokens: float) -> float:
        alpha, beta = self.step_coeffs(tp, batch)
        return alpha + beta * kv_tokens

    def min_step_time(self, context_tokens: float) -> float:
        """Fastest possible per-token time for one sequence of this context, any TP."""
        return min(self.step_time(tp, 1, context_tokens) for tp in TP_DEGREES)

    # -- prefill --------------------------------------------------------------

    def prefill_time(self, tp: int, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Time to prefill `new_tokens` on top of `cached_tokens` already in KV."""
        if new_tokens <= 0:
            return 0.0
        m, p = self.model, self.params
        linear = 2.0 * m.params * new_tokens
        # Attention: each new token attends to the cached prefix and to the new
        # tokens before it (q·k and a·v, 2 FLOPs each per element).
        ctx = cached_tokens + new_tokens / 2.0
        attention = 4.0 * m.layers * m.kv_heads * m.head_dim * new_tokens * ctx * (
            m.hidden / (m.kv_heads * m.head_dim)
        )
        compute = (linear + attention) / (tp * self.gpu.bf16_flops * p.prefill_flops_efficiency)
        comm = m.layers * 2 * self.allreduce_s(tp, new_tokens, decode=False)
        return compute + comm + p.step_overhead_s

    # -- capacity and reconfiguration ---------------------------------------------

    def kv_capacity_tokens(self, tp: int) -> int:
        """KV tokens an engine of this TP degree holds; 0 if the weights do not fit."""
        p = self.params
        free = tp * (self.gpu.hbm_bytes * p.memory_utilization - p.activation_reserve_bytes)
        free -= self.model.weight_bytes
        if free <= 0:
            return 0
        return int(free / self.model.kv_bytes_per_token)

    def min_tp(self) -> int:
        """Smallest TP degree whose engine holds at least one full-length context."""
        for tp in TP_DEGREES:
            if self.kv_capacity_tokens(tp) >= self.model.max_context:
                return tp
        raise ValueError(f"{self.model.name} does not fit on 8 x {self.gpu.name}")

    def migration_time(self, context_tokens: float) -> float:
        """Moving a trajectory's KV to another engine (RDMA), versus re-prefill."""
        kv = context_tokens * self.model.kv_bytes_per_token
        return self.params.migration_setup_s + kv / self.params.kv_link_bw

    def restart_time(self, tp: int) -> float:
        """Bringing up an engine with a new TP degree: restart plus weight load."""
        load = self.model.weight_bytes / (tp * self.params.weight_load_bw)
        return self.params.restart_base_s + load

    def weight_sync_time(self, tp: int) -> float:
        """An engine taking new weights from the trainer: its shard of the weights
        over the inter-node link (`kv_link_bw`; a broadcast from trainer GPUs of
        their own, the slower of the two ways a rollout engine gets weights — an
        in-node copy from a colocated trainer is faster). An estimate: Qwen3-14B
        takes 1.2 s at TP 1, 0.15 s at TP 8."""
        return self.model.weight_bytes / (tp * self.params.kv_link_bw)

    def decode_time(self, tp: int, batch: int, context_tokens: float, tokens: float) -> float:
        """Closed-form time for `tokens` decode steps of a batch whose KV starts at
        `context_tokens` in total and grows by `batch` tokens a step."""
        alpha, beta = self.step_coeffs(tp, batch)
        return series_time(alpha + beta * context_tokens, beta * batch, tokens)


def series_time(first_step: float, growth: float, steps: float) -> float:
    """Sum of `steps` step times starting at `first_step`, each `growth` longer than
    the last, taken continuously: ∫₀ⁿ (a + g·k) dk = a·n + g·n²/2."""
    return first_step * steps + growth * steps * steps / 2.0


def series_steps(first_step: float, growth: float, duration: float) -> float:
    """Inverse of `series_time`: steps completed within `duration` (continuous)."""
    if duration <= 0:
        return 0.0
    if growth <= 1e-18:
        return duration / first_step
    # Solve g/2·n² + a·n − d = 0 in the cancellation-free form.
    disc = first_step * first_step + 2.0 * growth * duration
    return 2.0 * duration / (first_step + math.sqrt(disc))
