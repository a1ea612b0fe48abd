"""A checkpoint's tokenizer encodes the same on the Hugging Face side as in treadle.

treadle encodes with `tokenizer.json` through the `tokenizers` package
(`HFTokenizer`); a trainer, and vLLM, load the same directory with
`transformers.AutoTokenizer`. The issue: transformers 5.x loaded a qwen2
checkpoint as a Qwen2Tokenizer rebuilt with Qwen's regex word split and NFC, so a
math question was 24 tokens there and 14 in treadle. Checked here over a few
thousand seeded strings (ASCII, digits, punctuation, whitespace runs, unicode that
NFC would change, chat special tokens, math, cuts of the agent format), for a
freshly saved checkpoint, the demo's trained one, and in `.venv-vllm` (vLLM's own
tokenizer loader and its transformers) for a saved checkpoint and the tiny test
model of `tests/engines/tiny_model.py`.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from treadle.agent.chat import Call, HermesFormat, prompt_messages
from treadle.agent.fingerprint import section_digests, tokenizer_fingerprint
from treadle.agent.loop import tool_messages
from treadle.agent.tokenizer import HFTokenizer
from treadle.train.model import (
    IM_END_ID,
    IM_START_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    ModelConfig,
    build_model,
    save_checkpoint,
    train_tokenizer,
)
from treadle.train.transcripts import math_suite
from vllm_server import REPO, VENV_PYTHON

# One layer of head_dim 64 (vLLM's CPU attention needs >= 32): the weights do not
# matter here, only that the directory is a real checkpoint (config.json included,
# which is what sends transformers to Qwen2Tokenizer).
SMALL = ModelConfig(hidden_size=64, layers=1, heads=1, kv_heads=1, intermediate_size=64)
STRINGS = 3000
QUESTION = "What is the remainder when 8^195 is divided by 7?"


def _agent_texts(n: int = 120) -> list[str]:
    """Prompts, replies with tool calls and observations as the agent loop renders
    them: the text the small model's tokenizer is trained on (long merges across
    spaces, digits apart)."""
    suite, fmt = math_suite(), HermesFormat()
    texts: list[str] = []
    for i, task in enumerate(suite.tasks(n)):
        specs = [tool.spec for tool in suite.tools(task)]
        texts.append(fmt.prompt(prompt_messages(task.prompt), specs))
        texts.append(fmt.reply_text(f"Let me compute {i} * {i + 7}.",
                                    [Call.of("python", {"code": f"print({i} * {i + 7})"})]))
        texts.append(fmt.continuation(tool_messages([str(i * (i + 7))]), True))
        texts.append(fmt.reply_text("", [Call.of("submit_answer", {"answer": str(i)})]))
    return texts


WORDS = ["the", "Answer", "python", "print", "submit_answer", "remainder", "divided", "code",
         "I", "don't", "it's", "WE'LL", "you're", "x", "boxed", "tool_call", "Problem:"]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n  ", "    \n\t ", "\u00a0",
          "\u2009", "\u3000", "\u200b"]
# Composed and decomposed forms (Qwen2Tokenizer's NFC would merge "e\u0301" into "é"),
# compatibility characters, other scripts, astral-plane symbols and emoji sequences.
UNICODE = ["é", "e\u0301", "naïve", "café", "Å", "A\u030a", "ﬁ", "①", "²", "½", "∑", "√",
           "π", "≤", "→", "日本語", "中文", "한국어", "Ελληνικά", "русский", "עברית", "العربية",
           "😀", "👍🏽", "🇫🇷", "\ufeff", "\U0001d4b3", "\x00", "\x7f"]
SPECIALS = [*SPECIAL_TOKENS, "<tool_call>", "</tool_call>", "<tool_response>",
            "<|im_start|>assistant\n", "<|im_end|>\n<|im_start|>user\n", "<|im_end", "|>"]


def _math(rng: random.Random) -> str:
    a, b = rng.randint(0, 10**rng.randint(1, 9)), rng.randint(1, 999)
    return rng.choice([f"{a} + {b} = {a + b}", f"{a}*{b}", f"{a}^{b} mod 7",
                       f"\\frac{{{a}}}{{{b}}}", f"\\boxed{{{a}}}", f"-{a}.{b}e-3", f"{a:,}",
                       f"x^2 + {b}x - {a}", f"({a} - {b}) / {b}", f"{a}/{b}"])


def random_strings(n: int, seed: int, agent_texts: list[str]) -> list[str]:
    """`n` strings from a seeded RNG (the same list every run), plus edge cases."""
    rng = random.Random(seed)

    def fragment() -> str:
        kind = rng.randrange(9)
        if kind == 0:
            return rng.choice(WORDS)
        if kind == 1:
            return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 30)))
        if kind == 2:
            return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 4)))
        if kind == 3:
            return rng.choice(SPACES)
        if kind == 4:
            return rng.choice(UNICODE)
        if kind == 5:
            return rng.choice(SPECIALS)
        if kind == 6:
            return _math(rng)
        if kind == 7:  # a cut of the agent format: long merges, cut anywhere
            text = rng.choice(agent_texts)
            start = rng.randrange(len(text))
            return text[start:start + rng.randint(1, 200)]
        return "".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(1, 12)))

    edge = ["", " ", "\n", "  \n\n  ", "<|im_end|>", "<|im_start|><|im_end|>", QUESTION,
            agent_texts[0], "".join(agent_texts[:8])]
    made = ["".join(fragment() + rng.choice(["", "", " ", "\n"])
                    for _ in range(rng.randint(1, 12))) for _ in range(n - len(edge))]
    return edge + made


@pytest.fixture(scope="module")
def agent_texts() -> list[str]:
    return _agent_texts()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, agent_texts: list[str]) -> Path:
    """A freshly saved checkpoint (`save_checkpoint`, as `treadle train sft` writes)."""
    tok = train_tokenizer(agent_texts, SMALL.vocab_size)
    out = tmp_path_factory.mktemp("fidelity") / "ckpt"
    return save_checkpoint(build_model(SMALL, tok.get_vocab_size(), seed=0), tok, out)


@pytest.fixture(scope="module")
def strings(agent_texts: list[str]) -> list[str]:
    return random_strings(STRINGS, seed=20240917, agent_texts=agent_texts)


def _assert_same_encoding(directory: Path, texts: list[str]) -> None:
    from transformers import AutoTokenizer

    ours = HFTokenizer(directory)
    hf = AutoTokenizer.from_pretrained(str(directory))
    batch = hf(texts, add_special_tokens=False)["input_ids"]
    for i, text in enumerate(texts):
        want = ours.encode(text)
        assert hf.encode(text, add_special_tokens=False) == want, (i, text)
        assert batch[i] == want, (i, text)
        assert hf.decode(want, skip_special_tokens=False) == ours.decode(want), (i, text)


def test_autotokenizer_encodes_like_tokenizer_json(saved: Path, strings: list[str]) -> None:
    _assert_same_encoding(saved, strings)


def test_the_question_of_the_issue_is_as_short_on_both_sides(saved: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(saved))
    ours = HFTokenizer(saved).encode(QUESTION)
    assert hf.encode(QUESTION, add_special_tokens=False) == ours
    # Digits apart, merges across spaces: far fewer tokens than Qwen's word split gives.
    assert len(ours) < len(QUESTION) / 2


def test_chat_special_tokens_are_right_on_the_hugging_face_side(saved: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(saved))
    ids = [PAD_ID, IM_START_ID, IM_END_ID]
    assert hf.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == ids
    assert (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", IM_END_ID)
    assert (hf.pad_token, hf.pad_token_id) == ("<|endoftext|>", PAD_ID)
    assert hf.bos_token is None and hf.unk_token is None
    assert set(ids) <= set(hf.all_special_ids)
    for token, want in zip(SPECIAL_TOKENS, ids, strict=True):
        assert hf.encode(token, add_special_tokens=False) == [want]
        assert hf.encode(f"a{token}b", add_special_tokens=False)[1] == want  # atomic inside text
    assert hf.encode("hi", add_special_tokens=True) == hf.encode("hi", add_special_tokens=False)
    text = "<|im_start|>user\nhi<|im_end|>\n"
    ids = hf.encode(text, add_special_tokens=False)
    assert hf.decode(ids, skip_special_tokens=True) == "user\nhi\n"


def test_fingerprints_agree_across_the_ways_of_loading(saved: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    want = tokenizer_fingerprint(saved)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(saved))) == want
    assert tokenizer_fingerprint(HFTokenizer(saved)) == want
    assert tokenizer_fingerprint(Tokenizer.from_file(str(saved / "tokenizer.json"))) == want


def test_the_config_asks_for_no_remote_code(saved: Path) -> None:
    """`trust_remote_code` in tokenizer_config.json only keeps tokenizer.json as written
    (see `treadle.train.model.tokenizer_config`); with no `auto_map` there is no code."""
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert "auto_map" not in config
    assert not [p for p in saved.iterdir() if p.suffix == ".py"]


def test_a_rebuilt_pipeline_is_caught_by_the_fingerprint(saved: Path) -> None:
    """What the issue saw (a Qwen2Tokenizer with its own pre-tokenizer and NFC), made
    by hand: the fingerprint differs and names the sections."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

    rebuilt = Tokenizer.from_file(str(saved / "tokenizer.json"))
    rebuilt.normalizer = normalizers.NFC()
    rebuilt.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}| ?\p{L}+|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert tokenizer_fingerprint(rebuilt) != tokenizer_fingerprint(saved)
    ours, theirs = section_digests(saved), section_digests(rebuilt)
    assert [k for k in ours if ours[k] != theirs[k]] == ["normalizer", "pre_tokenizer"]


@pytest.mark.slow
def test_the_trained_small_model_encodes_alike(trained_checkpoint: Path,
                                              agent_texts: list[str]) -> None:
    """The demo's checkpoint (what the issue was about), rebuilt by this fix."""
    _assert_same_encoding(trained_checkpoint, random_strings(1000, seed=7, agent_texts=agent_texts))


# Runs in .venv-vllm: vLLM's tokenizer loader (what the engine encodes text and
# decodes with) and plain AutoTokenizer under that venv's transformers.
_VLLM_SIDE = """
import json, sys
import transformers
from transformers import AutoTokenizer
try:
    from vllm.tokenizers import get_tokenizer
except ImportError:  # vLLM before 0.11 kept it here
    from vllm.transformers_utils.tokenizer import get_tokenizer
texts = json.loads(open(sys.argv[1], encoding="utf-8").read())
found = {"transformers": transformers.__version__, "dirs": {}}
for d in sys.argv[3:]:
    engine, auto = get_tokenizer(d), AutoTokenizer.from_pretrained(d)
    found["dirs"][d] = {
        "engine": [engine.encode(t, add_special_tokens=False) for t in texts],
        "auto": [auto.encode(t, add_special_tokens=False) for t in texts],
        "eos": engine.eos_token_id, "pad": engine.pad_token_id}
open(sys.argv[2], "w", encoding="utf-8").write(json.dumps(found))
"""


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(not VENV_PYTHON.exists(), reason="no .venv-vllm (scripts/vllm-cpu.sh)")
def test_vllm_encodes_like_treadle(saved: Path, strings: list[str], tmp_path: Path) -> None:
    tiny = tmp_path / "tiny-qwen2"
    subprocess.run([str(VENV_PYTHON), str(REPO / "tests" / "engines" / "tiny_model.py"),
                    str(tiny)], check=True, cwd=REPO, timeout=120, capture_output=True)
    texts, found_file, script = tmp_path / "texts.json", tmp_path / "found.json", tmp_path / "s.py"
    texts.write_text(json.dumps(strings), encoding="utf-8")
    script.write_text(_VLLM_SIDE, encoding="utf-8")
    run = subprocess.run([str(VENV_PYTHON), str(script), str(texts), str(found_file),
                          str(saved), str(tiny)], cwd=tmp_path, timeout=300,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    found: dict[str, Any] = json.loads(found_file.read_text(encoding="utf-8"))
    for directory in (saved, tiny):
        side = found["dirs"][str(directory)]
        ours = HFTokenizer(directory)
        assert (side["eos"], side["pad"]) == (IM_END_ID, PAD_ID)
        for i, text in enumerate(strings):
            want = ours.encode(text)
            assert side["engine"][i] == want, (directory.name, found["transformers"], i, text)
            assert side["auto"][i] == want, (directory.name, found["transformers"], i, text)
