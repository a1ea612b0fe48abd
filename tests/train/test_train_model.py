"""The tokenizer, the model, the checkpoint format and the chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import TINY

from treadle.agent.chat import Call, HermesFormat, prompt_messages
from treadle.agent.loop import tool_messages
from treadle.agent.tokenizer import HFTokenizer
from treadle.train.model import (
    CHAT_TEMPLATE,
    IM_END_ID,
    IM_START_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    build_model,
    load_model,
    train_tokenizer,
    weights_digest,
)
from treadle.train.transcripts import Transcript, math_suite


def test_special_tokens_are_single_ids_and_text_round_trips(tiny_dir: Path,
                                                            transcripts: list[Transcript]) -> None:
    tok = HFTokenizer(tiny_dir)
    assert [tok.token_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, IM_START_ID, IM_END_ID]
    for token, want in zip(SPECIAL_TOKENS, (PAD_ID, IM_START_ID, IM_END_ID), strict=True):
        assert tok.encode(token) == [want]
    for piece in transcripts[0].pieces:
        assert tok.decode(tok.encode(piece)) == piece
    text = "unseen text: naïve café, 12345 ∑ <|im_end|>"
    assert tok.decode(tok.encode(text)) == text  # byte-level: nothing is unknown
    assert tok.encode("x<|im_end|>")[-1] == IM_END_ID


def test_digits_are_single_tokens_and_the_prompt_is_short(tiny_dir: Path,
                                                          transcripts: list[Transcript]) -> None:
    tok = HFTokenizer(tiny_dir)
    assert tok.encode("1234567890") == [tok.encode(d)[0] for d in "1234567890"]
    assert all(len(tok.encode(d)) == 1 for d in "0123456789")
    # The constant system text is merged into long tokens (no whitespace split).
    assert len(tok.encode(transcripts[0].pieces[0])) < 150 < len(transcripts[0].pieces[0]) / 4


def test_tokenizer_and_weights_are_deterministic(transcripts: list[Transcript]) -> None:
    texts = [p for t in transcripts for p in t.pieces]
    a, b = (train_tokenizer(texts, TINY.vocab_size) for _ in range(2))
    assert a.to_str() == b.to_str()
    digests = [weights_digest(build_model(TINY, a.get_vocab_size(), seed)) for seed in (0, 0, 1)]
    assert digests[0] == digests[1] != digests[2]


def test_vocab_size_below_the_byte_alphabet_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 259"):
        train_tokenizer(["a"], 100)


def test_checkpoint_loads_back_with_eos_pad_and_same_weights(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    model = load_model(tiny_dir)
    assert not model.training
    assert model.config.eos_token_id == IM_END_ID
    assert model.model.layers[0].self_attn.head_dim == TINY.head_dim == 64
    assert model.generation_config.eos_token_id == IM_END_ID
    assert weights_digest(model) == weights_digest(load_model(tiny_dir))
    hf = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert (hf.eos_token, hf.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert hf.chat_template == CHAT_TEMPLATE


def test_chat_template_renders_what_the_agent_loop_appends(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_dir))
    suite = math_suite()
    task = suite.tasks(1)[0]
    specs = [tool.spec for tool in suite.tools(task)]
    fmt = HermesFormat()
    code = {"code": "print(1)\nprint('é')"}
    messages = [
        {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": code}}]},
        {"role": "tool", "content": "1\né"},
        {"role": "assistant", "content": "Done.",
         "tool_calls": [{"function": {"name": "submit_answer", "arguments": {"answer": "1"}}},
                        {"function": {"name": "python", "arguments": {"code": "x"}}}]},
        {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"},
    ]
    rendered = hf.apply_chat_template(messages, tools=specs, tokenize=False,
                                      add_generation_prompt=True)
    pieces = (fmt.prompt(prompt_messages(task.prompt), specs)
              + fmt.reply_text("", [Call.of("python", code)])
              + fmt.continuation(tool_messages(["1\né"]), True)
              + fmt.reply_text("Done.", [Call.of("submit_answer", {"answer": "1"}),
                                         Call.of("python", {"code": "x"})])
              + fmt.continuation(tool_messages(["a", "b"]), True))
    assert rendered == pieces
    system = hf.apply_chat_template([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hi"}], tokenize=False,
                                    add_generation_prompt=True)
    assert system == fmt.prompt(prompt_messages([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "hi"}]), [])
