"""What a GRPO run serves from: the policy's checkpoint as vLLM loads it, and the
rollout service as a child process (`serving`), which the trainer reaches only
over HTTP, as any trainer would."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from treadle.client.errors import ServiceUnavailable
from treadle.client.http import RolloutClient
from treadle.client.stream import RetryPolicy
from treadle.runtime.launcher import die_with_parent, free_port, stop_process_group
from treadle.sandbox.registry import usable_backend_name
from treadle.train.grpo_config import GRPOConfig

Log = Callable[[str], None]


def untied_copy(checkpoint: Path, out: Path) -> Path:
    """`checkpoint` with its output projection a copy of the embeddings (the same
    function), saved to `out` with the tokenizer files."""
    import torch

    from treadle.train.model import load_model

    model = load_model(checkpoint)
    if model.config.tie_word_embeddings:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(
            model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(out)
    copy_tokenizer(checkpoint, out)
    return out


def copy_tokenizer(checkpoint: Path, out: Path) -> None:
    """The tokenizer files (and generation config) of `checkpoint`, copied to `out`."""
    for f in checkpoint.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",
                                                        "generation_config.json",
                                                        "chat_template.jinja"):
            shutil.copy2(f, out / f.name)


@contextmanager
def serving(policy: Path, out: Path, config: GRPOConfig, *,
            log: Log) -> Iterator[RolloutClient]:
    """`treadle serve --vllm policy` as a child process, and a client of it."""
    token = secrets.token_hex(16)
    port = free_port()
    sandbox = usable_backend_name() if config.sandbox == "bwrap" else config.sandbox
    cmd = [sys.executable, "-m", "treadle", "serve", "--port", str(port), "--token", token,
           "--db", str(out / "rollouts.db"), "--vllm", str(policy), "--vllm-python",
           config.vllm_python, "--sandbox", sandbox, "--policy", "verl",
           "--log-level", "warning"]
    with open(out / "serve.log", "ab") as service_log:
        proc = subprocess.Popen(cmd, stdout=service_log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    client = RolloutClient(url, token=token, timeout_s=60.0)
    # One try per probe: the start-up wait is this loop's, not the client's retries.
    probe = RolloutClient(url, token=token, timeout_s=5.0, retry=RetryPolicy(attempts=1,
                                                                             patience_s=0.0))
    try:
        log(f"starting the rollout service with a vLLM engine ({url}; log {out / 'serve.log'})")
        deadline = time.monotonic() + 900  # a bound for a hang: vLLM starts within 600 s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"treadle serve exited with {proc.returncode}; see "
                                   f"{out / 'serve.log'}")
            try:
                if probe.health().engines >= 1:
                    break
            except ServiceUnavailable:  # not up yet (anything else is a real error)
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service did not come up in 900 s; see "
                                   f"{out / 'serve.log'}")
            time.sleep(1.0)
        yield client
    finally:
        probe.close()
        client.close()
        stop_process_group(proc, timeout_s=60)


def prune(folder: Path, keep: set[str]) -> None:
    for d in folder.iterdir():
        if d.is_dir() and d.name not in keep:
            shutil.rmtree(d, ignore_errors=True)


