"""SkyRL with treadle's rollouts: the docs' example (docs/trainers.md, "## SkyRL")
returns a TreadleGenerator from BasePPOExp.get_generator; in .venv-skyrl (skyrl
0.3.0) it runs a GeneratorInput that SkyRL's own PromptDataset and
prepare_generator_input made, as one job of a real service on loopback (the math
suite, a tokenizer, a scripted vLLM-wire engine), and SkyRL's own
validate_generator_output, concatenation and step-wise merging take the output, with
and without step-wise training, and once more with the input's rows shuffled
(tests/trainers/skyrl_script.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from service.service_helpers import running_service
from trainers.trainers_helpers import REPO, trainer_python
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.slow, pytest.mark.integration]
TOKEN = "skyrl-token"
SCRIPT = Path(__file__).with_name("skyrl_script.py")
# As skyrl_script.py sets them: three gsm8k rows (uids "0".."2", answers 3, 4, 3),
# three samples each, SkyRL's temperature and max_generate_length.
SAMPLES, TEMPERATURE, MAX_GENERATE_LENGTH = 3, 0.7, 48
UIDS = [uid for uid in ("0", "1", "2") for _ in range(SAMPLES)]
SHUFFLE = [7, 0, 4, 8, 3, 1, 5, 2, 6]  # the input order of the script's last run


def check_rows_against_the_engine(out: dict[str, Any], fake: FakeVLLMServer, job: str,
                                  reply: list[int]) -> None:
    """Each row, token by token, is the one call of its trajectory: the prompt the
    engine was sent, its reply's ids at mask 1 and the reply's logprobs. Row k of a
    uid (in output order, which is the input's) is repetition k of group
    ``{job}/{uid}``: the trajectory ``{job}/{uid}/{k}`` of the engine's request ids."""
    sent = {str(body["request_id"]).split(":")[0]: (body["prompt"], ids)
            for body, ids in zip(fake.requests, fake.replies, strict=True)}
    taken: dict[str, int] = {}
    for i, uid in enumerate(out["uids"]):
        k = taken.get(uid, 0)
        taken[uid] = k + 1
        prompt, ids = sent[f"{job}/{uid}/{k}"]
        assert ids == reply
        assert out["prompt_token_ids"][i] == prompt, (job, uid, k)
        assert out["response_ids"][i] == ids, (job, uid, k)
        assert out["loss_masks"][i] == [1] * len(ids), (job, uid, k)
        assert out["rollout_logprobs"][i] == [-0.1 * (j + 1) for j in range(len(ids))], \
            (job, uid, k)


def test_the_docs_generator_gives_skyrl_its_own_uids_in_both_modes(tmp_path: Path) -> None:
    python = trainer_python("skyrl")
    tokenizer = build_tokenizer(tmp_path / "tok")
    # Every reply answers 3: right for rows 0 and 2, wrong for row 1.
    reply = [*tokenizer.encode("the answer is \\boxed{3}"), tokenizer.token_id("<|im_end|>")]
    fake = FakeVLLMServer(reply_ids=reply)
    report = tmp_path / "report.json"
    with fake.serve() as engine_url:
        config = ServiceConfig(db=str(tmp_path / "s.db"), token=TOKEN, policy="verl",
                               tokenizer=str(tmp_path / "tok"),
                               engines=[EngineRequest(url=engine_url, model="m")])
        with running_service(config) as url:
            env = {**os.environ, "TREADLE_URL": url, "TREADLE_TOKEN": TOKEN,
                   # SkyRL's PromptDataset reads through Hugging Face datasets: a local
                   # file, a cache of this test's own, and no hub.
                   "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1",
                   "HF_HUB_OFFLINE": "1"}
            done = subprocess.run(
                [str(python), str(SCRIPT), str(REPO / "docs" / "trainers.md"),
                 str(tmp_path), str(report)],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    result = json.loads(report.read_text())
    assert result["input_uids"] == UIDS
    rewards = {"0": 1.0, "1": 0.0, "2": 1.0}
    for mode in ("plain", "step_wise"):
        out = result[mode]
        # One segment per trajectory here, so both modes give a row per input row, in
        # input order, under SkyRL's uids and repetitions.
        assert out["rows"] == len(UIDS), mode
        assert out["uids"] == UIDS, mode
        assert out["repetitions"] == [r for _ in range(3) for r in range(SAMPLES)], mode
        assert out["rewards"] == [rewards[uid] for uid in UIDS], mode
        assert out["stop_reasons"] == ["stop"] * len(UIDS), mode
        # Beyond SkyRL 0.3.0's keys, only the newer one, None, and treadle's per-token
        # policy versions.
        assert out["extra_keys"] == ["rollout_sample_support", "treadle_policy_versions"], mode
        assert out["metrics"]["treadle/num_trajectories"] == len(UIDS)
        assert out["metrics"]["treadle/num_excluded"] == 0
        assert out["metrics"]["generate/avg_num_tokens"] == len(reply)
    # Shuffled input, output in its order: each row's uid and repetition are the ones
    # SkyRL gave that row.
    shuffled = result["shuffled"]
    assert shuffled["uids"] == [UIDS[i] for i in SHUFFLE]
    assert shuffled["repetitions"] == [i % SAMPLES for i in SHUFFLE]
    assert shuffled["rewards"] == [rewards[UIDS[i]] for i in SHUFFLE]
    # The rows are the engine's prompts and replies, token by token; the jobs ran in
    # the order plain, step-wise, shuffled.
    jobs = list(dict.fromkeys(str(body["request_id"]).split(":")[0].rsplit("/", 2)[0]
                              for body in fake.requests))
    assert len(jobs) == 3
    for job, mode in zip(jobs, ("plain", "step_wise", "shuffled"), strict=True):
        check_rows_against_the_engine(result[mode], fake, job, reply)
    assert result["step_wise"]["is_last_step"] == [True] * len(UIDS)
    # Three jobs of 9 trajectories, one turn each, sampled as SkyRL's config says.
    assert len(fake.requests) == 3 * len(UIDS)
    assert {r["temperature"] for r in fake.requests} == {TEMPERATURE}
    assert all(r["max_tokens"] <= MAX_GENERATE_LENGTH for r in fake.requests)
