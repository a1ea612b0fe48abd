"""Transcripts: programs from questions, real tool observations, pieces and masks."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import record

from treadle.agent.chat import Call, HermesFormat, prompt_messages
from treadle.agent.loop import tool_messages
from treadle.agent.tokenizer import HFTokenizer
from treadle.train.model import IM_END_ID
from treadle.train.transcripts import (
    HELDOUT_POOL,
    HELDOUT_SEED,
    KINDS,
    Transcript,
    heldout_tasks,
    math_suite,
    program_for,
    tokenize,
    train_tasks,
)
from treadle.types import Task


@pytest.mark.parametrize(("kind", "question", "program"), [
    ("arith", "Compute (3 + 4) * 5 - 6.", "print((3 + 4) * 5 - 6)"),
    ("arith", "Compute 7^2 + 8^2 - 9 * 10.", "print(7**2 + 8**2 - 9 * 10)"),
    ("modpow", "What is the remainder when 3^40 is divided by 7?", "print(3**40 % 7)"),
    ("lcm", "What is the least common multiple of 12 and 18?",
     "import math\nprint(math.lcm(12, 18))"),
    ("fraction", "Compute 1/2 divided by 3/4. Give the result as a fraction in lowest terms.",
     "from fractions import Fraction as F\nprint(F('1/2') / F('3/4'))"),
])
def test_program_is_the_question_rewritten(kind: str, question: str, program: str) -> None:
    task = Task("t", "p", "math", {"question": question, "answer": "0", "kind": kind})
    assert program_for(task) == program


def test_unknown_kind_or_question_is_refused() -> None:
    with pytest.raises(ValueError, match="no program"):
        program_for(Task("t", "p", "math", {"question": "Solve for x: x = 1.", "kind": "linear"}))
    with pytest.raises(ValueError, match="no program"):
        program_for(Task("t", "p", "math", {"question": "Compute x + 1.", "kind": "arith"}))


def test_every_kind_has_a_program_for_many_generated_tasks() -> None:
    tasks = math_suite().tasks(400, seed=7)
    assert {t.metadata["kind"] for t in tasks} == set(KINDS)
    for task in tasks:
        compile(program_for(task), task.task_id, "exec")


def test_train_and_heldout_tasks_share_no_id_or_question() -> None:
    train = train_tasks(3000, seed=0)
    held = heldout_tasks(HELDOUT_POOL)
    assert len(train) == 3000 and len({t.task_id for t in train}) == 3000
    assert not {t.task_id for t in train} & {t.task_id for t in held}
    assert not {t.metadata["question"] for t in train} & {t.metadata["question"] for t in held}
    # Without the filter some would collide (lcm has only 85^2 questions).
    raw = math_suite().tasks(3000, seed=0)
    assert {t.metadata["question"] for t in raw} & {t.metadata["question"] for t in held}
    assert heldout_tasks(5) == math_suite().tasks(5, seed=HELDOUT_SEED)
    with pytest.raises(ValueError, match="held-out seed"):
        train_tasks(1, seed=HELDOUT_SEED)
    with pytest.raises(ValueError, match="at most"):
        heldout_tasks(HELDOUT_POOL + 1)


def test_pieces_are_the_agent_formats_with_the_real_tool_output(
        transcripts: list[Transcript]) -> None:
    fmt = HermesFormat()
    suite = math_suite()
    tasks = {t.task_id: t for t in train_tasks(len(transcripts))}
    for tr in transcripts:
        task = tasks[tr.task_id]
        prompt, call, observation, answer = tr.pieces
        assert prompt == fmt.prompt(prompt_messages(task.prompt),
                                    [tool.spec for tool in suite.tools(task)])
        assert call.endswith("<|im_end|>") and answer.endswith("<|im_end|>")
        parsed = fmt.reply(call).calls
        assert parsed == [Call.of("python", {"code": program_for(task)})]
        # The python tool printed the gold answer (str(Fraction) is how it prints).
        assert observation == fmt.continuation(tool_messages([task.metadata["answer"]]), True)
        (submit,) = fmt.reply(answer).calls
        assert submit == Call.of("submit_answer", {"answer": task.metadata["answer"]})
        assert tr.kind == task.metadata["kind"]


def test_example_ids_are_the_pieces_appended_and_mask_covers_replies(
        tiny_dir: Path, transcripts: list[Transcript]) -> None:
    tok = HFTokenizer(tiny_dir)
    for tr in transcripts:
        ex = tokenize(tr, tok)
        pieces = [tok.encode(p) for p in tr.pieces]
        assert ex.ids == [i for p in pieces for i in p]
        assert ex.piece_lengths == [len(p) for p in pieces]
        assert ex.mask == [int(k % 2 == 1) for k, p in enumerate(pieces) for _ in p]
        # Each reply's last token is <|im_end|>; prompt and observation end elsewhere.
        ends = [sum(ex.piece_lengths[:k + 1]) - 1 for k in range(4)]
        assert [ex.ids[e] == IM_END_ID for e in ends] == [False, True, False, True]
        assert [ex.mask[e] for e in ends] == [0, 1, 0, 1]


def test_recording_is_deterministic(transcripts: list[Transcript]) -> None:
    assert record(6) == transcripts[:6]


def test_answered_directly_is_the_prompt_then_the_same_answer(
        transcripts: list[Transcript]) -> None:
    fmt = HermesFormat()
    for tr in transcripts:
        direct = tr.answered_directly()
        assert direct.pieces == (tr.pieces[0], tr.pieces[3])
        assert (direct.task_id, direct.kind) == (tr.task_id, tr.kind)
        (submit,) = fmt.reply(direct.pieces[1]).calls
        assert submit.name == "submit_answer"
        with pytest.raises(ValueError, match="without the tool"):
            direct.answered_directly()
