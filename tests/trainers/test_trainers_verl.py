"""verl 0.9.1's rollout and weight extension points served by treadle
(`treadle.client.verl_manager`), against a real service.

The service runs on a scripted engine (`FakeVLLMServer`, taught vLLM's weight-reload
endpoints here) with a tiny model's tokenizer; verl's side runs in .venv-verl
(tests/trainers/verl_script.py), configured with the docs' overrides (docs/trainers.md,
"verl") and fed the docs' dataset snippet. It checks the rollout manager's DataProto
with verl's own code (its AgentLoopOutput model, DataProto's consistency check, and
its agent loop worker's batching, tensor by tensor, of records built from the job's
trajectories without treadle's converter: verl_expected.py), and here against what
the scripted engine was sent and sampled, row by row and token by token; it runs
fit's join, GRPO advantages and a policy update with verl's loss on CPU, a harness
whose trajectories have two segments (or one with an observation inside), and two
weight pushes through the service's barrier.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi import Request, Response
from fastapi.responses import JSONResponse

from engines.engines_fakes import FakeVLLMServer
from engines.tiny_model import build
from service.service_helpers import running_service
from trainers.trainers_helpers import trainer_python
from treadle.agent.tokenizer import HFTokenizer
from treadle.gateway.harness import Harness
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "verl-token"
HERE = Path(__file__).resolve().parent
DOCS = HERE.parents[1] / "docs" / "trainers.md"
QUESTIONS = ["What is 2 + 2?", "Please edit: what is 2 + 2?", "What is 2 + 2? crash"]


class ReloadingVLLM(FakeVLLMServer):
    """The fake vLLM server with scripted answers by sample — even repetitions answer
    4 (right), odd ones 7 (wrong), so that every GRPO group has an advantage — and
    vLLM's RL endpoints (``VLLM_SERVER_DEV_MODE=1``) that `VLLMEngine.update_weights`
    calls, recording the weights it is told to reload."""

    def __init__(self, right: list[int], wrong: list[int]) -> None:
        super().__init__()
        self.reloads: list[str] = []  # weights_path of each reload_weights
        self.sampled: dict[str, tuple[list[int], list[float]]] = {}  # request id -> reply
        self.versions: list[str] = []  # each update_weight_version
        self.pauses = 0
        # The base class's completions route replies one way; this one by repetition.
        self.app.router.routes = [r for r in self.app.router.routes
                                  if getattr(r, "path", None) != "/v1/completions"]

        @self.app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            # The runtime's request ids are "<job>/<uid>/<repetition>:<turn>:<call>".
            repetition = int(str(body["request_id"]).split(":")[0].rsplit("/", 1)[1])
            ids = (right if repetition % 2 == 0 else wrong)[:body["max_tokens"]]
            lps = [-0.1 * (i + 1) for i in range(len(ids))]
            self.sampled[str(body["request_id"])] = (ids, lps)
            choice = {"index": 0, "text": "x" * len(ids), "finish_reason": "stop",
                      "stop_reason": None, "token_ids": ids, "prompt_token_ids": body["prompt"],
                      "logprobs": {"tokens": [str(t) for t in ids], "token_logprobs": lps,
                                   "top_logprobs": [{str(t): lp} for t, lp in
                                                    zip(ids, lps, strict=True)],
                                   "text_offset": list(range(len(ids)))}}
            return JSONResponse({"id": f"cmpl-{body['request_id']}", "object": "text_completion",
                                 "model": body["model"], "choices": [choice],
                                 "usage": {"prompt_tokens": len(body["prompt"]),
                                           "completion_tokens": len(ids),
                                           "total_tokens": len(body["prompt"]) + len(ids)}})

        @self.app.post("/pause")
        async def pause() -> Response:
            self.pauses += 1
            return Response(status_code=200)

        @self.app.post("/resume")
        async def resume() -> Response:
            return Response(status_code=200)

        @self.app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> Response:
            body = await request.json()
            assert body["method"] == "reload_weights"
            self.reloads.append(body["kwargs"]["weights_path"])
            return JSONResponse({"results": [None]})

        @self.app.post("/update_weight_version")
        async def update_weight_version(request: Request) -> Response:
            self.versions.append(str((await request.json())["new_version"]))
            return JSONResponse({})


def docs_verl() -> tuple[list[str], str]:
    """The verl section's overrides (its bash block, after ``main_ppo``) and its python
    block, as a user copies them."""
    section = DOCS.read_text(encoding="utf-8").split("\n## verl\n", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)
    python = re.search(r"```python\n(.*?)```", section, re.S)
    assert bash and python, "docs/trainers.md's verl section lost its code blocks"
    command = " ".join(line.split(" #")[0].rstrip().rstrip("\\")
                       for line in bash.group(1).splitlines())
    words = shlex.split(command)
    return words[words.index("verl.trainer.main_ppo") + 1:], python.group(1)


def gsm8k_rows() -> list[dict[str, Any]]:
    """Rows in the format of verl's gsm8k example (examples/data_preprocess/gsm8k.py)."""
    return [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": q}],
             "reward_model": {"style": "rule", "ground_truth": "4"},
             "extra_info": {"split": "train", "index": i, "answer": "#### 4", "question": q}}
            for i, q in enumerate(QUESTIONS)]


def with_test_values(overrides: list[str], values: dict[str, str]) -> list[str]:
    """The docs' overrides with the test's url, paths and sizes, and the rest of a
    config the docs leave to the user (their "..." line)."""
    out = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+")
        out.append(f"{o.split('=', 1)[0]}={values.pop(key)}" if key in values else o)
    return out + [f"{k}={v}" for k, v in values.items()]


def float32(x: float) -> float:
    """`x` as verl's float32 logprob tensor holds it."""
    value: float = struct.unpack("f", struct.pack("f", x))[0]
    return value


Call = tuple[list[int], list[int], list[float]]  # prompt sent, ids sampled, their logprobs


def check_rows_against_the_engine(rows: list[dict[str, Any]], fake: ReloadingVLLM,
                                  segments: str, right: list[int]) -> None:
    """Every row of the manager's batch, padding removed, is what the scripted engine
    was sent and sampled. A trajectory's calls, in order, make its rows: a row's
    prompt is the prompt of its first call; each reply follows at mask 1 with its
    logprobs; the tokens up to where the next call's prompt ends (the observation
    the context was extended with) are at mask 0 with logprob 0.0; a call whose
    prompt does not extend the row so far opens the next row (a new segment); with
    "last" a trajectory's row is its last segment. The reward is the last reply's
    (1 for the right answer). An excluded trajectory's row trains nothing."""
    calls: dict[str, list[Call]] = {}
    for body in fake.requests:  # in arrival order: a trajectory's calls in turn order
        request_id = str(body["request_id"])
        ids, lps = fake.sampled[request_id]
        calls.setdefault(request_id.split(":")[0], []).append((body["prompt"], ids, lps))
    by_trajectory: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_trajectory.setdefault(row["trajectory_id"], []).append(row)
    for tid, mine in by_trajectory.items():
        if mine[0]["excluded"]:
            for row in mine:
                assert set(row["response_mask"]) <= {0}, row
                assert set(row["rollout_log_probs"]) <= {0.0}, row
            continue
        pending = list(calls[tid])
        if segments == "last":  # its calls from the one that opened the last segment
            prompt = mine[-1]["prompt_ids"]
            pending = pending[max(i for i, c in enumerate(pending) if c[0] == prompt):]
        for row in mine:
            check_row(tid, row, pending)
            assert row["reward"] == (1.0 if calls[tid][-1][1] == right else 0.0), tid
        assert not pending, (tid, "calls left without a row")


def check_row(tid: str, row: dict[str, Any], pending: list[Call]) -> None:
    """Takes the calls of `row` off the front of `pending`, checking the row against them."""
    prompt, response = row["prompt_ids"], row["response_ids"]
    mask, lps = row["response_mask"], row["rollout_log_probs"]
    assert pending and pending[0][0] == prompt, (tid, "no call was sent this row's prompt")
    at = 0
    while pending and pending[0][0] == prompt + response[:at]:
        _sent, ids, sampled = pending.pop(0)
        end = at + len(ids)
        assert (response[at:end], mask[at:end]) == (ids, [1] * len(ids)), (tid, at)
        assert lps[at:end] == [float32(lp) for lp in sampled], (tid, at)
        at = end
        # The observation: up to the end of the next call's prompt, if that call goes on
        # from this row's context; else the rest of the row.
        goes_on = bool(pending) and pending[0][0][:len(prompt) + at] == prompt + response[:at]
        upto = len(pending[0][0]) - len(prompt) if goes_on else len(response)
        assert (mask[at:upto], lps[at:upto]) == ([0] * (upto - at), [0.0] * (upto - at)), \
            (tid, at)
        at = upto
    assert at == len(response), (tid, "tokens after the last call", response[at:])


def test_verl_rollouts_and_weights_through_treadle(tmp_path: Path) -> None:
    python = trainer_python("verl")
    model = build(tmp_path / "model")
    tok = HFTokenizer(model)
    end = tok.token_id("<|im_end|>")
    right = [*tok.encode("the answer is \\boxed{4}"), end]
    fake = ReloadingVLLM(right, [*tok.encode("the answer is \\boxed{7}"), end])
    overrides, snippet = docs_verl()
    work = tmp_path / "work"
    (work / "gsm8k").mkdir(parents=True)
    harness = Harness("edit", (sys.executable, str(HERE / "verl_script_harness.py")))
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp_path / "s.db"), token=TOKEN, policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(model), harnesses={"edit": harness})
        with running_service(config) as url:
            values = {
                "actor_rollout_ref.rollout.custom.treadle.url": url,
                "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.treadle.weights_dir":
                    str(tmp_path / "weights"),
                "data.train_files": str(work / "gsm8k" / "train.parquet"),
                "actor_rollout_ref.model.path": str(model),
                "actor_rollout_ref.rollout.name": "vllm",
                "actor_rollout_ref.rollout.n": "2",
                "data.max_prompt_length": "1024", "data.max_response_length": "96",
                "data.train_batch_size": "3",
                "actor_rollout_ref.actor.ppo_mini_batch_size": "3",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "2",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "2",
            }
            spec = {"url": url, "work_dir": str(work), "harness": "edit", "rows": gsm8k_rows(),
                    "overrides": with_test_values(overrides, values), "docs_python": snippet}
            (tmp_path / "spec.json").write_text(json.dumps(spec))
            env = {**os.environ, "TREADLE_TOKEN": TOKEN, "TOKENIZERS_PARALLELISM": "false",
                   "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HOME": str(tmp_path)}
            done = subprocess.run([str(python), str(HERE / "verl_script.py"),
                                   str(tmp_path / "spec.json"), str(tmp_path / "report.json")],
                                  env=env, capture_output=True, text=True, check=False,
                                  timeout=540)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    # The docs' configuration: one row per sample, verl's batching, fit's join and a
    # policy update that moves the weights.
    loop = report["agent_loop"]
    assert (loop["rows_in"], loop["rows_out"], loop["max_segments"]) == (6, 6, 1)
    assert loop["rewards"] == [0.0, 1.0] and loop["min_policy_version"] == 0
    # Token for token what the engine was sent and sampled (verl_script.py also checks
    # the batch against verl's own batching of the same trajectories).
    for name, segments in (("agent_loop", "all"), ("harness_all", "all"),
                           ("harness_last", "last")):
        check_rows_against_the_engine(report[name]["rows"], fake, segments, right)
    # (the harness's conversations have observation tokens inside a trained response)
    assert any(0 in r["response_mask"] and not r["excluded"]
               for r in report["harness_all"]["rows"])
    step = report["training_step"]
    assert step["nonzero_advantages"] > 0 and step["params_changed"] > 0
    # A harness that rewrote its prompt: two segments, two rows, one uid...
    every = report["harness_all"]
    assert (every["rows_in"], every["rows_out"], every["max_segments"]) == (6, 8, 2)
    assert every["rows_per_trajectory"] == 2 and every["uids_per_trajectory"] == 1
    assert len(every["excluded"]) == 1 and "infra_failure (harness)" in every["excluded"][0]
    # ... which verl's fit cannot join to its batch; its last segments it can.
    assert "identical batch size" in every["fit_union"]
    last = report["harness_last"]
    assert (last["rows_out"], last["fit_union"]) == (6, "ok")
    # Weights: safetensors in a Hugging Face layout, through the barrier, as versions.
    first, second = report["push_3"], report["push_4"]
    assert first["worker_calls"] == [[3, "treadle"]] and first["pushed_again"] == {}
    assert first["metrics"]["treadle/weights_bytes"] > 0
    assert "model.safetensors" in first["files"] and "config.json" in first["files"]
    assert "model.safetensors.index.json" in second["files"]
    assert len([f for f in second["files"] if f.endswith(".safetensors")]) > 1
    assert (first["service_policy_version"], second["service_policy_version"]) == (3, 4)
    assert second["kept"] == ["v3", "v4"]
    assert fake.reloads == [first["path"], second["path"]] and fake.versions == ["3", "4"]
    assert report["after_push"] == {"min_policy_version": 4, "token_versions": [4]}
    # Refused, saying what to set.
    said = report["refusals"]
    assert "set trainer.use_v1=False" in said["v1_trainer"]
    assert said["no_suite"] == "ValueError: rollout.custom.treadle needs suite"
    assert "unknown keys ['segmnets']" in said["typo"]
    assert "needs rollout.checkpoint_engine.backend=treadle" in said["naive_backend"]
    assert "over rollout.prompt_length=64: raise data.max_prompt_length" in \
        said["prompt_too_long"]
    # What stops verl's own actor worker on a machine without a GPU: verl 0.9.1 has no
    # CPU platform, falls back to CUDA's and asks torch.distributed for NCCL.
    assert "doesn't have NCCL built in" in report["verl_worker_on_cpu"]
    assert "verl/utils/distributed.py" in report["verl_worker_on_cpu"]
