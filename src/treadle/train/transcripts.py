"""Synthetic tool-use transcripts of the `math` suite, in the agent loop's own pieces.

One transcript is one solved episode, four pieces as the agent loop appends them:

1. prompt: the Hermes format's `prompt` of the task's messages and tool specs;
2. reply: a `python` call whose program is a near-copy of the question
   (``Compute 3 * 4 - 5.`` → ``print(3 * 4 - 5)``; `program_for`);
3. observation: the format's `continuation` of that program's result as a ``tool``
   message (run by the real `python` tool in a real sandbox, through a real `Episode`);
4. reply: `submit_answer` with what the program printed.

`Transcript.answered_directly` drops pieces 2 and 3: the same answer without the
tool (a policy that guesses).

Each piece is tokenized on its own and the ids appended, never re-tokenized, as the
agent loop does; the loss mask is 1 exactly on reply tokens (their closing
``<|im_end|>`` included). Every recorded transcript is scored by the suite and must
earn reward 1 (anything else is a bug here, raised as RuntimeError).

Kinds: `KINDS` (arith, fraction, lcm, modpow), those where the program is the
question rewritten, so a tiny model can learn it by copying. Task sets: held-out
tasks are the suite's own ``tasks(n, seed=HELDOUT_SEED)``; training tasks come from
any other seed, minus every question among the first `HELDOUT_POOL` held-out tasks,
so the two never share a task id or a question.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass

from treadle.agent.chat import Call, HermesFormat, Message, prompt_messages
from treadle.agent.tokenizer import Tokenizer
from treadle.envs.base import open_episode
from treadle.envs.suites.math import MathSuite
from treadle.sandbox.base import SandboxBackend
from treadle.types import Task

KINDS = ("arith", "fraction", "lcm", "modpow")
HELDOUT_SEED = 1  # MathSuite seed of the held-out tasks
HELDOUT_POOL = 2000  # held-out tasks whose questions training never sees
FORMAT = HermesFormat()

_FRACTION_OPS = {"+": "+", "-": "-", "times": "*", "divided by": "/"}
_MODPOW = re.compile(r"What is the remainder when (\d+)\^(\d+) is divided by (\d+)\?")
_LCM = re.compile(r"What is the least common multiple of (\d+) and (\d+)\?")
_FRACTION = re.compile(r"Compute (\d+/\d+) (\+|-|times|divided by) (\d+/\d+)\. .*")
_ARITH = re.compile(r"Compute ([-+*^() \d]+)\.")


def math_suite() -> MathSuite:
    """The math suite restricted to `KINDS`."""
    return MathSuite(kinds=list(KINDS))


def heldout_tasks(n: int) -> list[Task]:
    """The first `n` held-out tasks (n <= HELDOUT_POOL)."""
    if n > HELDOUT_POOL:
        raise ValueError(f"at most {HELDOUT_POOL} held-out tasks, asked for {n}")
    return math_suite().tasks(n, seed=HELDOUT_SEED)


def train_tasks(n: int, seed: int = 0) -> list[Task]:
    """`n` training tasks from `seed`, none sharing a question with the held-out pool."""
    if seed == HELDOUT_SEED:
        raise ValueError(f"seed {HELDOUT_SEED} is the held-out seed")
    held = {t.metadata["question"] for t in heldout_tasks(HELDOUT_POOL)}
    suite = math_suite()
    out: list[Task] = []
    size = n
    while len(out) < n:  # a prefix property of tasks(): grow until enough survive
        out = [t for t in suite.tasks(size, seed=seed) if t.metadata["question"] not in held]
        size += n - len(out)
    return out[:n]


def program_for(task: Task) -> str:
    """A Python program printing the answer of a `KINDS` task, written from its
    question text alone; ValueError for a kind or question it does not know."""
    question, kind = str(task.metadata["question"]), task.metadata.get("kind")
    if kind == "arith" and (m := _ARITH.fullmatch(question)):
        return f"print({m[1].replace('^', '**')})"
    if kind == "modpow" and (m := _MODPOW.fullmatch(question)):
        return f"print({m[1]}**{m[2]} % {m[3]})"
    if kind == "lcm" and (m := _LCM.fullmatch(question)):
        return f"import math\nprint(math.lcm({m[1]}, {m[2]}))"
    if kind == "fraction" and (m := _FRACTION.fullmatch(question)):
        return (f"from fractions import Fraction as F\n"
                f"print(F('{m[1]}') {_FRACTION_OPS[m[2]]} F('{m[3]}'))")
    raise ValueError(f"task {task.task_id!r} (kind {kind!r}): no program for {question!r:.80}")


@dataclass(frozen=True, slots=True)
class Transcript:
    """One solved episode as text pieces, in the order the agent loop appends them."""

    task_id: str  # the task it solves
    kind: str  # the task's math kind
    pieces: tuple[str, ...]  # prompt, reply, observation, reply (replies end in <|im_end|>)

    @staticmethod
    def is_reply(index: int) -> bool:
        """Whether piece `index` is sampled by the model (odd positions)."""
        return index % 2 == 1

    def answered_directly(self) -> Transcript:
        """The same episode without the tool: the prompt, then `submit_answer` of the
        value the program printed (the answer the suite scored 1). A model cannot
        compute it in its head; the SFT mix uses these to start from a policy that
        often skips the tool (`SFTConfig.direct_share`)."""
        if len(self.pieces) != 4:
            raise ValueError(f"transcript {self.task_id}: already without the tool")
        return Transcript(self.task_id, self.kind, (self.pieces[0], self.pieces[3]))


@dataclass(frozen=True, slots=True)
class Example:
    """A tokenized transcript: the ids of the pieces appended, and the loss mask."""

    ids: list[int]  # every piece's ids, concatenated in order
    mask: list[int]  # 1 on reply tokens (<|im_end|> included), 0 on prompt/observation
    piece_lengths: list[int]  # tokens per piece (sums to len(ids))


async def _record(task: Task, backend: SandboxBackend, suite: MathSuite) -> Transcript:
    program = program_for(task)
    async with open_episode(suite, task, backend) as episode:
        prompt = FORMAT.prompt(prompt_messages(task.prompt), episode.tool_specs)
        result = await episode.call("python", {"code": program})
        if not result.ok:
            raise RuntimeError(f"task {task.task_id}: the program failed: {result.observation()}")
        printed = result.output.strip()
        await episode.call("submit_answer", {"answer": printed})
        score = await episode.score()
    if score.reward != 1.0:
        raise RuntimeError(f"task {task.task_id}: the transcript scored {score.reward} "
                           f"({score.detail})")
    return Transcript(task.task_id, str(task.metadata["kind"]), (
        prompt,
        FORMAT.reply_text("", [Call.of("python", {"code": program})]),
        FORMAT.continuation([Message("tool", result.observation())], reply_closed=True),
        FORMAT.reply_text("", [Call.of("submit_answer", {"answer": printed})])))


async def record_transcripts(tasks: Sequence[Task], backend: SandboxBackend, *,
                             concurrency: int = 4) -> list[Transcript]:
    """A transcript per task, in task order, each episode in its own sandbox.

    `concurrency` episodes run at once (sandbox start-up, not the program, is the
    cost: ~50 ms a transcript at 4 on 2 cores with the `local` backend).
    """
    suite = math_suite()
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> Transcript:
        async with gate:
            return await _record(task, backend, suite)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def tokenize(transcript: Transcript, tokenizer: Tokenizer) -> Example:
    """The example of a transcript: each piece encoded separately, then appended."""
    ids: list[int] = []
    mask: list[int] = []
    lengths: list[int] = []
    for index, piece in enumerate(transcript.pieces):
        piece_ids = tokenizer.encode(piece)
        ids += piece_ids
        mask += [int(Transcript.is_reply(index))] * len(piece_ids)
        lengths.append(len(piece_ids))
    return Example(ids, mask, lengths)
