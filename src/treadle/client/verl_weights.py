"""The weights half of treadle's verl adapter (`treadle.client.verl_manager`, which
re-exports it): verl's checkpoint engine backend ``treadle`` and checkpoint manager.

The actor's weights go to treadle's engines as files, never through verl's replicas:
on ``update_weights(global_steps)`` every actor worker hands its HF-named tensors to
`TreadleCheckpointEngine`, whose master rank writes ``weights_dir/v<global_steps>``
(safetensors, a Hugging Face layout: what `treadle.train.grpo` writes with
``save_pretrained`` and `VLLMEngine.update_weights` loads), and
`TreadleCheckpointManager` then runs the service's weight barrier
(``POST /v1/weights/update``) with that directory and ``global_steps`` as the policy
version.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import ray  # type: ignore[import-not-found,unused-ignore]  # (in .venv with the ray extra)
import torch
from omegaconf import OmegaConf  # type: ignore[import-not-found]
from verl.checkpoint_engine import (  # type: ignore[import-not-found]
    CheckpointEngine,
    CheckpointEngineManager,
    CheckpointEngineRegistry,
)

from treadle.client.http import RolloutClient

BACKEND = "treadle"  # the checkpoint engine backend name
# The files of a Hugging Face checkpoint other than its weights: copied next to them so
# that each version is a checkpoint vLLM (and `treadle train eval`) loads whole.
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                  "merges.txt", "added_tokens.json", "chat_template.jinja", "tokenizer.model")

# What verl's TaskRunner process knows once it has made the agent loop manager and
# pushed weights (it makes both): the service's address, which the checkpoint manager
# defaults to, and the latest version pushed, which a job waits for.
_process: dict[str, Any] = {"url": None, "token": None, "pushed_version": 0,
                            "trainer_run": None}


def note_rollout_service(url: str, token: str | None,
                         trainer_run: str | None = None) -> None:
    """The service the TreadleAgentLoopManager of this process talks to, and the
    trainer run its jobs are for."""
    _process["url"], _process["token"] = url, token
    _process["trainer_run"] = trainer_run


def pushed_version() -> int:
    """The policy version this process last pushed (0 before the first push)."""
    return int(_process["pushed_version"])


def plain(value: Any) -> Any:
    """A DictConfig/ListConfig as plain dicts and lists (interpolations resolved)."""
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def version_dir(weights_dir: str | os.PathLike[str], version: int) -> Path:
    """Where policy `version`'s weights are written (a whole HF checkpoint)."""
    return Path(weights_dir) / f"v{version}"


@CheckpointEngineRegistry.register(BACKEND)
class TreadleCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """Checkpoint engine backend ``treadle``, made on every actor worker by verl
    (``rollout.checkpoint_engine.backend=treadle``, this module as
    ``custom_backend_module``; its ``engine_kwargs.treadle`` are the keywords).

    `send_weights` takes the actor's HF-named full tensors (verl's
    ``engine.get_per_tensor_param()``) on every rank, since gathering them is
    collective; the master rank writes them to ``weights_dir/v<global_steps>`` as
    safetensors (``model.safetensors``, or shards of at most `max_shard_bytes` with
    ``model.safetensors.index.json``), with the config and tokenizer files of
    `model_path` if given (a directory or a Hub id, as verl's ``model.path``), under a
    temporary name renamed into place once whole, and
    keeps the newest `keep` versions. ``weights_dir`` must be on a file system the
    engines read. LoRA: only merged (``model.lora.merge=True``) weights are whole.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False,
                 weights_dir: str | None = None, model_path: str | None = None,
                 dtype: str | None = None, max_shard_bytes: int = 5 << 30, keep: int = 2,
                 **_others: Any) -> None:
        # `_others`: the settings in engine_kwargs.treadle that are the driver's (url, ...).
        if not weights_dir:
            raise ValueError("checkpoint_engine.engine_kwargs.treadle.weights_dir is required: "
                             "a directory treadle's engines read")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.weights_dir = Path(weights_dir)
        self.model_path = model_path  # a directory or a Hugging Face Hub id
        self.dtype = None if dtype is None else getattr(torch, dtype)
        self.max_shard_bytes = max_shard_bytes
        self.keep = max(1, keep)

    def prepare(self) -> dict[str, Any]:
        return {}  # no communication topology: the weights go through files

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Any, global_steps: int | None = None
                           ) -> dict[str, float]:
        """Write the weights as policy version `global_steps` (master rank); every rank
        drains `weights`. Returns {"treadle/weights_bytes": bytes written}."""
        if global_steps is None:
            raise ValueError("send_weights needs global_steps (the policy version)")
        if not self.is_master:
            async for _ in _each(weights):
                pass
            return {}
        final = version_dir(self.weights_dir, global_steps)
        staging = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(3)}")
        staging.mkdir(parents=True)
        try:
            written = await self._write(weights, staging)
            if self.model_path is not None:
                _side_files(self.model_path, staging)
            if final.exists():  # a step pushed again (a resumed run)
                shutil.rmtree(final)
            staging.rename(final)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        self._prune(global_steps)
        return {"treadle/weights_bytes": float(written)}

    async def _write(self, weights: Any, into: Path) -> int:
        from safetensors.torch import save_file

        shards: list[dict[str, torch.Tensor]] = [{}]
        size = total = 0
        seen: set[int] = set()  # storages already written
        async for name, tensor in _each(weights):
            t = tensor.detach()
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            t = t.to("cpu").contiguous()
            # Tied weights (embeddings and output projection) may share one storage,
            # which safetensors refuses: each name gets a copy of its own.
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > self.max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
            total += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(into / "model.safetensors"), metadata={"format": "pt"})
            return total
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(into / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        (into / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        return total

    def _prune(self, newest: int) -> None:
        versions = sorted(int(p.name[1:]) for p in self.weights_dir.glob("v*")
                          if p.is_dir() and p.name[1:].isdigit())
        for v in versions:
            if v != newest and v < newest and len([u for u in versions if u > v]) >= self.keep:
                shutil.rmtree(version_dir(self.weights_dir, v), ignore_errors=True)

    async def receive_weights(self, global_steps: int | None = None) -> Any:
        raise NotImplementedError("treadle's engines load the weights from weights_dir")


def _side_files(model_path: str, into: Path) -> None:
    """The model's config, generation config and tokenizer, next to its weights: copied
    from a directory as they are, or saved by transformers from a Hub id."""
    source = Path(model_path)
    if source.is_dir():
        for name in _HF_SIDE_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, into / name)
        return
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    AutoConfig.from_pretrained(model_path).save_pretrained(into)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(into)
    with contextlib.suppress(OSError):  # a model without a generation config
        GenerationConfig.from_pretrained(model_path).save_pretrained(into)


async def _each(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """A sync or async iterator of (name, tensor), as verl's engines give either."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


@dataclass(frozen=True, slots=True)
class WeightSettings:
    """``rollout.checkpoint_engine.engine_kwargs.treadle``, the driver's part (the
    workers' is `TreadleCheckpointEngine`'s keywords). `url` and `token` default to the
    TreadleAgentLoopManager's (``rollout.custom.treadle``), then $TREADLE_TOKEN."""

    weights_dir: str
    url: str | None = None
    token: str | None = None
    mode: str = "wait"  # the barrier's pause: "wait" for calls in flight, or "abort" them
    timeout_s: float | None = None  # the barrier's; None: as long as it takes
    # The run whose weights these are (default: rollout.custom.treadle.trainer_run).
    trainer_run: str | None = None


class TreadleCheckpointManager(CheckpointEngineManager):  # type: ignore[misc]
    """verl's checkpoint manager (``rollout.checkpoint_manager_class``): weights to
    treadle's engines. ``update_weights(global_steps)``: every actor worker exports its
    weights to the ``treadle`` checkpoint engine (`TreadleCheckpointEngine`, which
    writes ``weights_dir/v<global_steps>``), then the service's barrier
    (``POST /v1/weights/update``: pause, every engine loads the directory, resume)
    makes ``global_steps`` the policy version new tokens carry. verl's own replicas
    are put to sleep once, at the trainer's first `sleep_replicas`, and never woken
    (fit calls it after every rollout, when verl's own rollout would have woken them).
    A version pushed again (fit's validation with a colocated reward model calls
    ``update_weights`` with the step it already pushed, the weights unchanged) is not
    pushed twice."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        if config.backend != BACKEND:
            raise ValueError(f"TreadleCheckpointManager needs rollout.checkpoint_engine."
                             f"backend={BACKEND} (and custom_backend_module="
                             f"treadle.client.verl_manager), not {config.backend!r}")
        super().__init__(config, actor_wg, replicas)
        raw = plain(config.engine_kwargs.get(BACKEND)) or {}
        mine = {f.name for f in fields(WeightSettings)}
        self.settings = WeightSettings(**{k: v for k, v in raw.items() if k in mine})
        url = self.settings.url or _process["url"]
        if not url:
            raise ValueError("engine_kwargs.treadle.url is not set and no "
                             "TreadleAgentLoopManager was made in this process")
        token = self.settings.token or _process["token"] or os.environ.get("TREADLE_TOKEN")
        self.client = RolloutClient(url, token=token)
        self._asleep = False  # verl's replicas, put to sleep once
        self._pushed: int | None = None  # the version this manager pushed last

    def sleep_replicas(self) -> None:
        """Put verl's own rollout replicas to sleep (their weights and KV cache leave
        the GPU), the first time only: nothing wakes them again."""
        if not self._asleep:
            super().sleep_replicas()
            self._asleep = True

    def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        """Push the actor's weights as policy version `global_steps` (0 if None)."""
        version = int(global_steps or 0)
        if version == self._pushed:
            return {}
        results = _wait(self.actor_wg.update_weights(global_steps=version, mode=BACKEND))
        path = version_dir(self.settings.weights_dir, version)
        state = self.client.update_weights(
            str(path), version, mode=self.settings.mode, timeout_s=self.settings.timeout_s,
            trainer_run=self.settings.trainer_run or _process["trainer_run"])
        _process["pushed_version"] = state.policy_version
        self._pushed = version
        metrics: dict[str, float] = {}
        for r in _results(results):
            metrics.update(r)
        return metrics


def _wait(results: Any) -> list[Any]:
    """The workers' answers: verl's worker groups return ObjectRefs from methods
    registered non-blocking (`update_weights` is); answers already there are kept."""
    answers = results if isinstance(results, list) else [results]
    return [ray.get(r) if isinstance(r, ray.ObjectRef) else r for r in answers]


def _results(results: list[Any]) -> Iterable[dict[str, float]]:
    for r in results:
        if isinstance(r, dict):
            yield {k: float(v) for k, v in r.items() if isinstance(v, int | float)
                   and math.isfinite(v)}


__all__ = [
    "BACKEND",
    "TreadleCheckpointEngine",
    "TreadleCheckpointManager",
    "WeightSettings",
    "note_rollout_service",
    "plain",
    "pushed_version",
    "version_dir",
]
