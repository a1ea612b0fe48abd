"""Supervised fine-tuning of the small model on math transcripts, cached.

    path = sft(SFTConfig(steps=400), cache_root)   # trains once (minutes), then instant
    model, tokenizer = load_model(path), HFTokenizer(path)

What it does: record `train_tasks` transcripts with the real `python` tool in
`local` sandboxes (cached on their own, keyed by the data spec), replace a seeded
`direct_share` of them by their tool-less form (`mixed`), train the
tokenizer on them, build the model from `seed`, and train it on the reply tokens
(cross-entropy under the loss mask; AdamW, linear warm-up then cosine decay to a
tenth of the peak, gradient norm clipped at 1) in plain PyTorch, fp32, batches
padded on the right.

The cache: ``cache_root/sft-<key>/`` where the key hashes the whole `SFTConfig`
(model, data and optimisation, seed included), the source of the modules that
make the data and the model (this package, the chat format, the math suite, the
python tool) and the torch/transformers/tokenizers versions. A finished directory
is never rewritten; a second call with the same inputs returns it without work.
It is written under a temporary name and renamed, under a file lock, so a crash
leaves no half checkpoint and two processes never train the same key at once.

Determinism: same config → same tokenizer, same initial weights, same batch order;
on the same machine and thread count, the same trained weights (CPU kernels are
deterministic for a fixed thread count; another thread count may differ in the
last bits).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.agent.tokenizer import HFTokenizer
from treadle.train import model as model_module
from treadle.train import transcripts as transcripts_module
from treadle.train.model import ModelConfig, build_model, save_checkpoint, train_tokenizer
from treadle.train.transcripts import Example, Transcript, record_transcripts, tokenize, train_tasks

if TYPE_CHECKING:
    import torch
    from transformers import Qwen2ForCausalLM

Log = Callable[[str], None]
META_FILE = "sft.json"  # in a checkpoint directory: config, key, timings, loss history


@dataclass(frozen=True, slots=True)
class SFTConfig:
    """Everything that decides the checkpoint (all of it goes into the cache key)."""

    model: ModelConfig = field(default_factory=ModelConfig)  # architecture, vocabulary size
    train_tasks: int = 2000  # distinct training transcripts
    data_seed: int = 0  # MathSuite seed of the training tasks (not the held-out seed)
    steps: int = 400  # optimizer steps: the knob that sets how good the checkpoint is
    batch_size: int = 32  # transcripts per step
    lr: float = 2e-3  # peak learning rate
    warmup_steps: int = 20  # linear warm-up before the cosine decay
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    seed: int = 0  # weight initialisation and batch order
    # Share of the transcripts replaced by their tool-less form (the answer submitted
    # at once, `Transcript.answered_directly`), picked with `seed`. 0: every one
    # uses the tool. Above 0 the model learns to skip the tool that often, as a
    # model fine-tuned on chat data without tools would; RL can learn it pays.
    direct_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.direct_share < 1.0:
            raise ValueError(f"direct_share {self.direct_share}: must be in [0, 1)")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _digest(payload: Any) -> str:
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _sources(*modules: Any) -> dict[str, str]:
    """SHA-256 of each module's source file, by module name."""
    return {m.__name__: hashlib.sha256(Path(m.__file__).read_bytes()).hexdigest()
            for m in modules}


def _data_sources() -> dict[str, str]:
    from treadle.agent.chat import base, hermes
    from treadle.envs.suites import math as math_suite
    from treadle.envs.tools import exec as exec_tool

    return _sources(transcripts_module, base, hermes, math_suite, exec_tool)


def _versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    import treadle

    return {"treadle": treadle.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def data_key(config: SFTConfig) -> str:
    """The key of the transcript set (task count, seed, the code that writes them)."""
    return _digest({"train_tasks": config.train_tasks, "data_seed": config.data_seed,
                    "sources": _data_sources()})


def cache_key(config: SFTConfig) -> str:
    """The key of the checkpoint: config, data, sources and library versions."""
    return _digest({"config": config.as_dict(), "data": data_key(config),
                    "sources": _sources(model_module, sys.modules[__name__]),
                    "versions": _versions()})


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def transcripts_path(config: SFTConfig, cache_root: str | Path) -> Path:
    """Where `config`'s transcripts are cached (a file that exists once recorded)."""
    return Path(cache_root) / f"transcripts-{data_key(config)}.jsonl"


def checkpoint_dir(config: SFTConfig, cache_root: str | Path) -> Path:
    """Where `config`'s checkpoint lives; it is complete once it holds META_FILE."""
    return Path(cache_root) / f"sft-{cache_key(config)}"


def load_or_record_transcripts(config: SFTConfig, cache_root: Path, log: Log) -> list[Transcript]:
    """The training transcripts, from `cache_root` or recorded now (then cached)."""
    from treadle.sandbox.local import LocalBackend

    path = transcripts_path(config, cache_root)
    with _locked(path.with_suffix(".lock")):
        if path.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            return [Transcript(r["task_id"], r["kind"], tuple(r["pieces"])) for r in rows]
        start = time.perf_counter()
        tasks = train_tasks(config.train_tasks, config.data_seed)
        found = asyncio.run(record_transcripts(tasks, LocalBackend()))
        log(f"recorded {len(found)} transcripts with the python tool in "
            f"{time.perf_counter() - start:.1f} s")
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps({"task_id": t.task_id, "kind": t.kind,
                                           "pieces": list(t.pieces)}) + "\n" for t in found))
        tmp.replace(path)
        return found


def mixed(found: Sequence[Transcript], config: SFTConfig) -> list[Transcript]:
    """`found` with round(direct_share x n) of them, picked with `config.seed`, in
    their tool-less form; order kept."""
    direct = set(random.Random(config.seed).sample(range(len(found)),
                                                   round(config.direct_share * len(found))))
    return [t.answered_directly() if i in direct else t for i, t in enumerate(found)]


def _batch(examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, loss mask on targets), right-padded to the longest."""
    import torch

    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), model_module.PAD_ID, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.float32)
    for row, e in enumerate(examples):
        ids[row, :len(e.ids)] = torch.tensor(e.ids)
        attention[row, :len(e.ids)] = 1
        loss_mask[row, :len(e.ids)] = torch.tensor(e.mask, dtype=torch.float32)
    return ids, attention, loss_mask


def masked_loss(model: Qwen2ForCausalLM, ids: torch.Tensor, attention: torch.Tensor,
                loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions whose target has mask 1."""
    import torch.nn.functional as F

    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    targets, weight = ids[:, 1:], loss_mask[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                          reduction="none").view_as(weight)
    return (nll * weight).sum() / weight.sum().clamp(min=1.0)


def lr_at(step: int, config: SFTConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to lr/10 at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(config: SFTConfig, examples: Sequence[Example], vocab_size: int, log: Log,
          log_every: int = 25) -> tuple[Qwen2ForCausalLM, list[dict[str, float]]]:
    """Build the model from `config.seed` and fine-tune it; returns it (eval mode) with
    the loss history (one entry per `log_every` steps: mean loss over them)."""
    import torch

    if len(examples) < config.batch_size:
        raise ValueError(f"{len(examples)} examples cannot fill a batch of {config.batch_size}")
    model = build_model(config.model, vocab_size, config.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    order = torch.Generator().manual_seed(config.seed)
    history: list[dict[str, float]] = []
    start, losses, tokens, step = time.perf_counter(), [], 0, 0
    while step < config.steps:
        perm = torch.randperm(len(examples), generator=order).tolist()
        for first in range(0, len(perm) - config.batch_size + 1, config.batch_size):
            if step >= config.steps:
                break
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config)
            batch = [examples[i] for i in perm[first:first + config.batch_size]]
            ids, attention, loss_mask = _batch(batch)
            loss = masked_loss(model, ids, attention, loss_mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            losses.append(loss.item())
            tokens += int(attention.sum())
            if step % log_every == 0 or step == config.steps:
                elapsed = time.perf_counter() - start
                history.append({"step": step, "loss": sum(losses) / len(losses),
                                "elapsed_s": elapsed})
                log(f"step {step}/{config.steps}  loss {history[-1]['loss']:.4f}  "
                    f"lr {lr_at(step - 1, config):.2e}  {elapsed:.1f} s  "
                    f"{tokens / elapsed:.0f} tok/s")
                losses = []
    model.eval()  # type: ignore[no-untyped-call]
    return model, history


def _log(message: str) -> None:
    print(f"treadle: sft: {message}", flush=True)


def sft(config: SFTConfig, cache_root: str | Path, *, log: Log = _log) -> Path:
    """The checkpoint directory for `config` under `cache_root`, trained if missing."""
    cache_root = Path(cache_root)
    key = cache_key(config)
    out = checkpoint_dir(config, cache_root)
    if (out / META_FILE).is_file():
        return out
    with _locked(cache_root / f".sft-{key}.lock"):
        if (out / META_FILE).is_file():  # another process finished it meanwhile
            return out
        start = time.perf_counter()
        found = mixed(load_or_record_transcripts(config, cache_root, log), config)
        data_s = time.perf_counter() - start
        tokenizer = train_tokenizer((p for t in found for p in t.pieces),
                                    config.model.vocab_size)
        tmp = cache_root / f".sft-{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tokenizer.save(str(tmp / "tokenizer.json"))
        examples = [tokenize(t, HFTokenizer(tmp)) for t in found]
        log(f"{len(examples)} examples, {sum(len(e.ids) for e in examples) / len(examples):.0f} "
            f"tokens each on average, vocabulary {tokenizer.get_vocab_size()}")
        train_start = time.perf_counter()
        model, history = train(config, examples, tokenizer.get_vocab_size(), log)
        train_s = time.perf_counter() - train_start
        save_checkpoint(model, tokenizer, tmp)
        meta = {"key": key, "config": config.as_dict(), "data_key": data_key(config),
                "versions": _versions(), "transcripts_s": data_s, "train_s": train_s,
                "threads": _threads(), "history": history,
                "weights_sha256": model_module.weights_digest(model)}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        tmp.rename(out)
        log(f"trained {config.steps} steps in {train_s:.1f} s; checkpoint {out}")
        return out


def _threads() -> int:
    import torch

    return int(torch.get_num_threads())
