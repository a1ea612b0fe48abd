"""The Qwen/Hermes chat format: rendering, tool-call parsing, the tokenizer wrapper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.agent.chat import IM_END, Call, CallError, HermesFormat, prompt_messages, tool_block
from treadle.agent.loop import tool_messages
from treadle.agent.tokenizer import HFTokenizer

SPEC = {"type": "function", "function": {"name": "python", "description": "run code",
                                         "parameters": {"type": "object"}}}
FMT = HermesFormat()


def test_prompt_renders_system_tools_user_and_generation_prompt() -> None:
    text = FMT.prompt(prompt_messages("What is 2+2?"), [SPEC])
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(SPEC) + "\n</tools>\n" in text
    assert text.endswith("<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_prompt_without_tools_has_no_tool_block_and_takes_a_system_message() -> None:
    text = FMT.prompt(prompt_messages([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "hi"}]), [])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tool_block([]) == ""


@pytest.mark.parametrize("prompt", [[], [{"role": "tool", "content": "x"}],
                                    [{"role": "user", "content": 3}],
                                    [{"role": "user", "content": "a"},
                                     {"role": "system", "content": "late"}]])
def test_bad_prompt_messages_are_refused(prompt: list[dict[str, object]]) -> None:
    with pytest.raises(ValueError, match=r"message|no messages"):
        FMT.prompt(prompt_messages(prompt), [])


def test_observation_frames_each_result_in_one_user_turn() -> None:
    assert FMT.continuation(tool_messages(["4"]), True) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    two = FMT.continuation(tool_messages(["a", "b"]), True)
    assert "</tool_response>\n<tool_response>\nb\n" in two
    assert two.count("<|im_start|>user") == 1


def test_parse_reads_calls_in_order_with_object_or_string_arguments() -> None:
    text = ('Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": '
            '"print(1)"}}\n</tool_call>\n<tool_call>{"name": "submit_answer", "arguments": '
            '"{\\"answer\\": \\"1\\"}"}</tool_call>' + IM_END)
    reply = FMT.reply(text)
    assert reply.text.endswith("</tool_call>")
    assert reply.calls == [Call.of("python", {"code": "print(1)"}),
                           Call.of("submit_answer", {"answer": "1"})]
    assert reply.wants_tools


def test_a_reply_without_calls_is_final() -> None:
    reply = FMT.reply("The answer is \\boxed{4}." + IM_END)
    assert not reply.wants_tools and reply.text == "The answer is \\boxed{4}."


@pytest.mark.parametrize(("body", "words"), [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>["python"]</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>', "JSON object"),
    ('<tool_call>{"name": "python", "arguments": "{oops"}</tool_call>', "JSON object"),
    ('<tool_call>{"name": "python", "arguments": {}}', "never closed"),
])
def test_malformed_calls_become_errors_not_exceptions(body: str, words: str) -> None:
    reply = FMT.reply(body)
    assert len(reply.parts) == 1 and not reply.calls
    err = reply.parts[0]
    assert isinstance(err, CallError) and words in err.message


def test_reply_text_is_parsed_back_to_the_same_calls() -> None:
    calls = [Call.of("python", {"code": "print(6*7)"})]
    text = FMT.reply_text("I will run it.", calls)
    assert text.endswith("</tool_call>" + IM_END)
    assert FMT.reply(text).calls == calls
    assert FMT.reply_text("42") == "42" + IM_END


def _tokenizer(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the tool call returns a result"] * 50, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_hf_tokenizer_maps_special_tokens_to_single_ids(tmp_path: Path) -> None:
    tok = HFTokenizer(_tokenizer(tmp_path))
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id(IM_END)
    ids = tok.encode("<|im_start|>user\nthe tool<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert tok.decode(ids) == "<|im_start|>user\nthe tool<|im_end|>"
    with pytest.raises(KeyError, match="not in the tokenizer"):
        tok.token_id("<|nope|>")
    with pytest.raises(FileNotFoundError):
        HFTokenizer(tmp_path / "missing")
