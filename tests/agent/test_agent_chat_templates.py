"""The chat formats against their families' published templates, rendered by transformers.

The templates are the ones TRL 1.16.0 ships as the originals it recognises models by
(`trl/chat_templates/qwen2_5.jinja`, `qwen3.jinja`), read from the TRL virtualenv the
trainer tests use, and rendered with `apply_chat_template` as vLLM and the trainers
render them. Two promises are held: the whole conversation renders as the template
does, and the context a conversation builds turn by turn (each reply's sampled ids,
then only the new messages) is token for token the template's text for the whole
conversation — the agentic part, for Qwen3 (its thinking kept after the last query).
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent.agent_helpers import build_tokenizer
from trainers.trainers_helpers import trainer_python
from treadle.agent.chat import Call, ChatFormat, Message, ParsedReply, chat_format
from treadle.agent.context import TokenContext
from treadle.agent.tokenizer import HFTokenizer

TOOLS = [{"type": "function", "function": {"name": "python", "description": "run code",
                                            "parameters": {"type": "object", "properties": {
                                                "code": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "submit_answer",
                                            "parameters": {"type": "object"}}}]


@functools.cache
def _published(name: str) -> str:
    """A template as TRL 1.16.0 ships it (its copy of the model repository's)."""
    python = trainer_python("trl")
    where = subprocess.run(
        [str(python), "-c", "import pathlib, trl; "
         "print(pathlib.Path(trl.__file__).parent / 'chat_templates')"],
        capture_output=True, text=True, check=True).stdout.strip()
    return (Path(where) / f"{name}.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf(tok: HFTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Any:
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("hf")
    tok._tok.save(str(directory / "tokenizer.json"))
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))


def _openai(messages: list[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.calls:
            d["tool_calls"] = [{"type": "function", "function": {
                "name": c.name, "arguments": c.parsed_arguments()}} for c in m.calls]
        if m.reasoning is not None:
            d["reasoning_content"] = m.reasoning
        out.append(d)
    return out


def _render(hf: Any, template: str, messages: list[Message],
            tools: list[dict[str, Any]] | None) -> str:
    hf = copy.copy(hf)
    hf.chat_template = template
    text: str = hf.apply_chat_template(_openai(messages), tools=tools, tokenize=False,
                                       add_generation_prompt=True)
    return text


def _call(name: str, **args: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


# (format, published template, replies as sampled: reasoning + content + calls)
FAMILIES = [
    ("hermes", "qwen2_5", ["Let me run it.\n" + _call("python", code="print(6*7)"),
                           _call("python", code="print(1)"),
                           _call("submit_answer", answer="42")]),
    ("qwen3", "qwen3", ["<think>\nI should compute it.\n</think>\n\nLet me run it.\n"
                        + _call("python", code="print(6*7)"),
                        "<think>\nCheck once more.\n</think>\n\n" + _call("python", code="1"),
                        "<think>\nIt is 42.\n</think>\n\n" + _call("submit_answer",
                                                                    answer="42")]),
]


# Qwen2.5's default system text is Qwen's own; the hermes format's default is the
# one the small model was trained with, so hermes is compared with a system message.
CASES = [(*family, system, tools) for family in FAMILIES for system in (True, False)
         for tools in (True, False) if system or family[0] != "hermes"]


@pytest.mark.parametrize(("name", "template", "replies", "with_system", "with_tools"), CASES)
def test_a_conversation_built_turn_by_turn_is_the_published_templates_text(
        tok: HFTokenizer, hf: Any, name: str, template: str, replies: list[str],
        with_system: bool, with_tools: bool) -> None:
    fmt = chat_format(name)
    published = _published(template)
    tools = TOOLS if with_tools else []
    convo = ([Message("system", "You solve math with python.")] if with_system else []) + [
        Message("user", "What is 6*7?")]
    ctx = TokenContext(tok, fmt)
    begun = ctx.begin(convo, tools, 0)
    for turn, text in enumerate(replies):
        want = _render(hf, published, convo, tools or None)
        assert fmt.prompt(convo, tools) == want
        assert begun.prompt_ids == tok.encode(want), f"turn {turn}: the context is not the " \
                                                     "template's tokens"
        reply = fmt.reply(text)
        assert reply.calls, f"turn {turn}: the sampled calls were not read"
        ids = [*tok.encode(text), ctx.stop_id]
        ctx.reply(ids, [-0.5] * len(ids), [0] * len(ids), reply.message())
        convo = [*convo, reply.message(), Message("tool", f"result {turn}")]
        begun = ctx.begin(convo, tools, turn + 1)
        assert begun.new_segment is None  # only ever appended
    assert ctx.segments[0].prompt_ids + ctx.segments[0].response_ids == tok.encode(
        _render(hf, published, convo, tools or None))


def test_qwen3_reads_calls_after_the_thinking_only_and_returns_the_content_without_it(
        ) -> None:
    fmt = chat_format("qwen3")
    text = ("<think>\nMaybe " + _call("python", code="draft") + " first?\n</think>\n\n"
            "Running it.\n" + _call("python", code="print(2)"))
    reply = fmt.reply(text + "<|im_end|>")
    assert reply.reasoning == "Maybe " + _call("python", code="draft") + " first?"
    assert reply.calls == [Call.of("python", {"code": "print(2)"})]
    assert reply.content == "Running it."
    assert reply.text.startswith("Running it.")  # what the agent loop scores
    assert reply.message() == Message("assistant", "Running it.", tuple(reply.calls),
                                      reply.reasoning)


def test_qwen3_history_keeps_thinking_only_after_the_last_query(hf: Any) -> None:
    fmt = chat_format("qwen3")
    reply = fmt.reply("<think>\nold thought\n</think>\n\nfour")
    convo = [Message("user", "2+2?"), reply.message(), Message("user", "and 3+3?"),
             _reasoned(fmt, "<think>\nadd\n</think>\n\n" + _call("python", code="3+3")),
             Message("tool", "6")]
    text = fmt.prompt(convo, TOOLS)
    assert text == _render(hf, _published("qwen3"), convo, TOOLS)
    assert "old thought" not in text and "<think>\nadd\n</think>" in text


def _reasoned(fmt: ChatFormat, text: str) -> Message:
    parsed: ParsedReply = fmt.reply(text)
    return parsed.message()
