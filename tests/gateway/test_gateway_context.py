"""The session's token context: extensions append only new tokens, edits begin new
segments, a retried request takes its reply back; the rendering is Qwen's."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.agent_helpers import build_tokenizer
from treadle.agent.chat import Call, HermesFormat, Message, ToolChoice, chat_format
from treadle.agent.context import TokenContext
from treadle.agent.tokenizer import HFTokenizer
from treadle.train.model import CHAT_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "python", "description": "run code",
                                            "parameters": {"type": "object"}}}]
FMT = HermesFormat()


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _reply(ctx: TokenContext, text: str, *, closed: bool = True) -> Message:
    """Sample `text` as if the engine had: its ids (and the stop id), mask 1."""
    ids = ctx.tokenizer.encode(text) + ([ctx.stop_id] if closed else [])
    returned = FMT.reply(text).message()
    ctx.reply(ids, [-0.5] * len(ids), [0] * len(ids), returned)
    return returned


def _echo(returned: Message) -> Message:
    """How a harness echoes a reply: its own whitespace, arguments re-serialised."""
    return Message("assistant", f"  {returned.content}\n", returned.calls)


def test_an_extension_appends_only_the_new_messages_after_the_sampled_ids(
        tok: HFTokenizer) -> None:
    ctx = TokenContext(tok, FMT)
    first = [Message("system", "be brief"), Message("user", "compute 1 + 2")]
    begun = ctx.begin(first, TOOLS, 0)
    assert begun.new_segment == "start" and begun.prompt_ids == tok.encode(
        FMT.prompt(first, TOOLS))
    returned = _reply(ctx, '<tool_call>\n{"name": "python", "arguments": {"code": "print(3)"}}'
                           "\n</tool_call>")
    sampled = list(ctx.context)
    second = [*first, _echo(returned), Message("tool", "3")]
    begun = ctx.begin(second, TOOLS, 1)
    assert begun.new_segment is None and not begun.retried
    piece = tok.encode("\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
                       "<|im_start|>assistant\n")
    assert begun.prompt_ids == sampled + piece  # the reply's ids kept, never re-encoded
    seg = ctx.segments[0]
    n_reply = len(sampled) - len(seg.prompt_ids)
    assert seg.loss_mask == [1] * n_reply + [0] * len(piece)
    assert seg.logprobs == [-0.5] * n_reply + [0.0] * len(piece)
    assert len(ctx.segments) == 1


def test_a_whole_conversation_renders_as_the_models_chat_template(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = build_tokenizer(tmp_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    hf.chat_template = CHAT_TEMPLATE
    messages = [Message("system", "sys"), Message("user", "q"),
                Message("assistant", "let me run it", (Call.of("python", {"code": "1"}),)),
                Message("tool", "1"), Message("tool", "again"), Message("user", "ok?")]
    openai = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
              {"role": "assistant", "content": "let me run it", "tool_calls": [
                  {"function": {"name": "python", "arguments": {"code": "1"}}}]},
              {"role": "tool", "content": "1"}, {"role": "tool", "content": "again"},
              {"role": "user", "content": "ok?"}]
    want = hf.apply_chat_template(openai, tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True)
    assert FMT.prompt(messages, TOOLS) == want
    del tok


@pytest.mark.parametrize(("edit", "reason"), [
    ("prune", "messages_edited"), ("drop", "messages_removed"),
    ("system", "system_changed"), ("tools", "tools_changed"), ("reply", "reply_edited")])
def test_an_edited_context_begins_a_new_prefix_consistent_segment(
        tok: HFTokenizer, edit: str, reason: str) -> None:
    ctx = TokenContext(tok, FMT)
    first = [Message("system", "s"), Message("user", "task"), ]
    ctx.begin(first, TOOLS, 0)
    r1 = _reply(ctx, "step one")
    convo = [*first, r1, Message("user", "a long tool result " * 5)]
    ctx.begin(convo, TOOLS, 1)
    r2 = _reply(ctx, "step two")
    tools = TOOLS
    if edit == "prune":
        edited = [*first, r1, Message("user", "[pruned]"), r2, Message("user", "go on")]
    elif edit == "drop":
        edited = [*first, r1]
    elif edit == "system":
        edited = [Message("system", "new"), *convo[1:], r2, Message("user", "go on")]
    elif edit == "tools":
        edited, tools = [*convo, r2, Message("user", "go on")], []
    else:
        edited = [*first, Message("assistant", "something else"), *convo[3:], r2,
                  Message("user", "go on")]
    begun = ctx.begin(edited, tools, 2)
    assert begun.new_segment == reason
    assert len(ctx.segments) == 2
    seg = ctx.segments[1]
    assert (seg.start_turn, seg.start_reason) == (2, reason)
    assert seg.prompt_ids == tok.encode(FMT.prompt(edited, tools)) == begun.prompt_ids
    assert seg.response_ids == []
    old = ctx.segments[0]  # the first segment is untouched, and its own context
    assert old.loss_mask.count(1) == len(tok.encode("step one")) + len(
        tok.encode("step two")) + 2


def test_a_retried_request_takes_the_unread_reply_back(tok: HFTokenizer) -> None:
    ctx = TokenContext(tok, FMT)
    first = [Message("user", "hi")]
    ctx.begin(first, [], 0)
    r1 = _reply(ctx, "hello")
    second = [*first, r1, Message("user", "more")]
    before = list(ctx.context)
    ctx.begin(second, [], 1)
    _reply(ctx, "lost reply")
    begun = ctx.begin(second, [], 1)  # the same request again
    assert begun.retried and begun.new_segment is None
    seg = ctx.segments[0]
    assert "lost reply" not in tok.decode(seg.response_ids)
    assert begun.prompt_ids[:len(before)] == before and len(ctx.segments) == 1
    # A retried first call starts over.
    ctx2 = TokenContext(tok, FMT)
    ctx2.begin(first, [], 0)
    _reply(ctx2, "x")
    again = ctx2.begin(first, [], 0)
    assert again.retried and again.new_segment == "start" and len(ctx2.segments) == 1


def test_forced_tool_choice_is_context_not_a_sample(tok: HFTokenizer) -> None:
    ctx = TokenContext(tok, FMT)
    choice = ToolChoice("function", "python")
    forced = FMT.forced_prefix(choice)
    begun = ctx.begin([Message("user", "q")], TOOLS, 0, forced)
    assert tok.decode(begun.prompt_ids).endswith('<tool_call>\n{"name": "python", "arguments": ')
    reply = FMT.reply(forced + '{"code": "print(1)"}}\n</tool_call>', choice)
    assert reply.calls == [Call.of("python", {"code": "print(1)"})] and reply.content is None
    assert FMT.reply('<tool_call>\n{"name": "python", "arguments": {}}\n</tool_call>',
                     ToolChoice("none")).calls == []


def test_unknown_chat_formats_are_refused_by_name() -> None:
    assert chat_format("hermes").name == "hermes"
    with pytest.raises(ValueError, match="no chat format 'llama3'"):
        chat_format("llama3")
